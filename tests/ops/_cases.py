"""Random cases of LMCache's KV ops, run on `lmcache_ascend.ops` and on LMCache 0.5.6's torch baseline.

Shared by the pytest suite (cases drawn by hypothesis) and the H100 script
(cases drawn by `random.Random`): a `draw` object has `int(lo, hi)` and
`pick(seq)`. Every case builds two identical worlds from one seed, poisons the
outputs of both (0xA5 bytes), runs our op in one and the baseline in the other,
and compares every byte of every tensor of both worlds. The baseline has no
CPU fp8 `index_copy_`, so it sees fp8 tensors as uint8 views of the same bytes.
"""

from __future__ import annotations

import random

import torch

from lmcache_ascend.layouts import (
    BLOCK_OP,
    MULTI_LAYER_OP,
    SINGLE_LAYER_OP,
    UNILATERAL_OP,
    format_by_code,
    formats_taken_by,
    paged_layer_shape,
)
from lmcache_ascend.patches.lmcache.c_ops_npu import OPS as PER_TOKEN_OPS

# The per-token ops (LMCache 0.4.x's c_ops and 0.5.x's device ops alike), then 0.5.x's block op.
OPS = (*PER_TOKEN_OPS, BLOCK_OP)
# The engine KV formats, as the layouts declare them: a layout's formats are drawn by every op
# that takes them, and the paged tensors of a case are shaped by what each format is.
FORMATS = format_by_code()
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8, torch.float8_e4m3fn,
          torch.float8_e5m2)
POISON = 0xA5
H2D, D2H = 0, 1


class RandomDraw:
    """The `draw` interface over `random.Random` (the device script has no hypothesis)."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.random.randint(lo, hi)

    def pick(self, seq):
        return seq[self.random.randrange(len(seq))]


class HypothesisDraw:
    """The `draw` interface over hypothesis's `st.data()` (the pytest suite)."""

    def __init__(self, data) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        from hypothesis import strategies as st

        return self.data.draw(st.integers(lo, hi))

    def pick(self, seq):
        from hypothesis import strategies as st

        return self.data.draw(st.sampled_from(seq))


def _filled(shape, dtype, gen, device, poison=False):
    nbytes = max(1, int(torch.Size(shape).numel())) * torch.empty(0, dtype=dtype).element_size()
    if poison:
        raw = torch.full((nbytes,), POISON, dtype=torch.uint8)
    else:  # Python's generator: the same bytes on every torch and Python version
        raw = torch.frombuffer(bytearray(gen.randbytes(nbytes)), dtype=torch.uint8)
    flat = raw.view(dtype)
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        # LMCache's torch baseline returns the canonical NaN for a NaN with a payload (0x7FD6
        # came back as 0x7E00 in float16), so a byte comparison with it can hold no NaN: ours
        # would keep the payload and differ.
        flat[torch.isnan(flat)] = 0
    return flat.to(device)[: torch.Size(shape).numel()].view(shape)


def _baseline_view(tensor):
    return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor


def _slots(draw, gen, count, capacity, holes, distinct=True):
    """`count` slots of a `capacity`-slot cache: distinct valid slots, some -1 holes (and a -1 prefix)."""
    order = gen.sample(range(capacity), min(count, capacity)) if distinct else [
        gen.randrange(capacity) for _ in range(count)]
    if len(order) < count:
        order += [-1] * (count - len(order))
    if holes:
        prefix = draw.int(0, count) if draw.int(0, 2) == 0 else 0
        order = [-1] * prefix + order[prefix:]
        for _ in range(draw.int(0, 2)):
            if count:
                order[draw.int(0, count - 1)] = -1
    return torch.tensor(order, dtype=torch.int64)


def build(op: str, draw, device: torch.device, big: bool = False) -> dict:
    """One case: {'tensors': [...], 'call': callable(ops, tensors, baseline: bool), 'meta': {...}}."""
    gen = random.Random(draw.int(0, 2**31 - 1))
    dtype = draw.pick(DTYPES)
    element = torch.empty(0, dtype=dtype).element_size()
    store = draw.int(0, 1) == 1
    layers = draw.int(1, 3 if not big else 4)
    bs = draw.pick((1, 2, 4, 16))
    nb = draw.int(1, 6)
    pbs = nb * bs
    hs = draw.pick((1, 2, 3, 8, 16)) * (1 if element > 1 else draw.pick((1, 4)))
    nh = draw.int(1, 3)
    meta = {"op": op, "dtype": str(dtype).replace("torch.", ""), "store": store, "layers": layers, "bs": bs}

    if op in (MULTI_LAYER_OP, UNILATERAL_OP):
        fmt = draw.pick(formats_taken_by(op))
        facts = FORMATS[fmt]
        mla = facts.mla
        hidden = hs if mla else nh * hs
        tokens = draw.int(0, min(pbs, 24))
        slots = _slots(draw, gen, tokens, pbs, holes=True)
        skip = draw.int(0, tokens + 1) if op == MULTI_LAYER_OP and draw.int(0, 1) else 0
        if mla or op == UNILATERAL_OP:  # rows of every slot: one tensor per layer (per K/V and layer)
            shape = (pbs, hidden)
            count = layers * (1 if mla else 2)
        elif facts.two_major:
            shape, count = (2, pbs, hidden), layers
        else:
            shape, count = (nb, 2, bs, hidden), layers
        paged = [_filled(shape, dtype, gen, device, poison=not store) for _ in range(count)]
        kv = _filled((1 if mla else 2, layers, tokens, hidden), dtype, gen, device, poison=store)
        pointers = draw.int(0, 1) == 1
        meta.update(fmt=fmt, tokens=tokens, skip=skip, pointers=pointers)
        tensors = [kv, slots.to(device), *paged]

        def call(ops, t, baseline):
            kv_, slots_, *paged_ = t
            if baseline:
                kv_, paged_ = _baseline_view(kv_), [_baseline_view(p) for p in paged_]
            table = (torch.tensor([p.data_ptr() for p in paged_], dtype=torch.int64, device=device) if pointers
                     else paged_)
            args = [kv_, table, slots_, device, pbs, D2H if store else H2D, ops.fmt(fmt)]
            if op == MULTI_LAYER_OP:
                ops.multi_layer_kv_transfer(*args, block_size=bs, head_size=hs, skip_prefix_n_tokens=skip)
            else:
                ops.multi_layer_kv_transfer_unilateral(*args)

    elif op == SINGLE_LAYER_OP:
        fmt = draw.pick(formats_taken_by(op))
        facts = FORMATS[fmt]
        mla = facts.mla
        token_major = draw.int(0, 1) == 1
        tokens = draw.int(0, min(pbs, 24))
        slots = _slots(draw, gen, tokens, pbs, holes=True)
        if mla:
            paged = _filled((nb, bs, hs), dtype, gen, device, poison=not store)
            lmc = _filled((tokens, hs), dtype, gen, device, poison=store)
        else:
            paged = _filled(paged_layer_shape(facts, nb, bs, nh, hs), dtype, gen, device, poison=not store)
            lmc = _filled((tokens, 2, nh * hs) if token_major else (2, tokens, nh * hs), dtype, gen, device,
                          poison=store)
        meta.update(fmt=fmt, tokens=tokens, token_major=token_major)
        tensors = [lmc, paged, slots.to(device)]

        def call(ops, t, baseline):
            lmc_, paged_, slots_ = t
            if baseline:
                lmc_, paged_ = _baseline_view(lmc_), _baseline_view(paged_)
            ops.single_layer_kv_transfer(lmc_, paged_, slots_, D2H if store else H2D, ops.fmt(fmt), token_major)

    elif op in ("load_and_reshape_flash", "reshape_and_cache_back_flash"):
        store = op == "load_and_reshape_flash"
        meta["store"] = store
        tokens = draw.int(0, min(pbs, 24))
        slots = _slots(draw, gen, tokens, pbs, holes=False)  # the baseline wraps -1 (see lmcache_ascend.ops)
        caches = [_filled((nb, bs, nh, hs), dtype, gen, device, poison=not store) for _ in range(2)]
        kv = _filled((2, layers, tokens, nh * hs), dtype, gen, device, poison=store)
        layer = draw.int(0, layers - 1)
        meta.update(tokens=tokens, layer=layer)
        tensors = [kv, *caches, slots.to(device)]

        def call(ops, t, baseline):
            kv_, k_, v_, slots_ = t
            if baseline:
                kv_, k_, v_ = _baseline_view(kv_), _baseline_view(k_), _baseline_view(v_)
            getattr(ops, op)(kv_, k_, v_, slots_, layer)

    else:
        return _build_block(draw, gen, device, dtype, store, layers, bs, nb, nh, hs, meta, big)
    return {"tensors": tensors, "call": call, "meta": meta}


def _build_block(draw, gen, device, dtype, store, layers, bs, nb, nh, hs, meta, big):
    fmt = draw.pick(formats_taken_by(BLOCK_OP))
    facts = FORMATS[fmt]
    bundle = facts.kv_tuple and facts.mla  # per layer a tuple of planes of their own widths and dtypes
    nb = max(nb, 2)
    if facts.hnd:
        nh = min(nh, 3)
    planes_dtypes = None

    def cache(shape):
        return _filled(shape, dtype, gen, device, poison=not store)

    if facts.cross_layer:
        paged = cache((nb, layers, 2, nh, bs, hs) if facts.hnd else (nb, layers, 2, bs, nh, hs))
    elif facts.kv_list:
        shape = (nb * bs, nh, hs) if facts.pbs_fused else (nb, bs, nh, hs)
        paged = [[cache(shape) for _ in range(layers)] for _ in range(2)]
    elif bundle:
        # Widest elements first: each plane then starts on a multiple of its element size, which the
        # baseline needs to view a 1-token slice (we do not; see lmcache_ascend.ops).
        planes_dtypes = sorted((draw.pick(DTYPES) for _ in range(draw.int(1, 3))), key=lambda d: -d.itemsize)
        widths = [draw.pick((1, 2, 4, 8, 16)) for _ in planes_dtypes]
        paged = [tuple(_filled((nb, bs, 1, w), d, gen, device, poison=not store)
                       for w, d in zip(widths, planes_dtypes)) for _ in range(layers)]
    elif facts.kv_tuple:
        paged = [tuple(cache((nb, bs, nh, hs)) for _ in range(2)) for _ in range(layers)]
    else:
        paged = [cache(paged_layer_shape(facts, nb, bs, nh, hs)) for _ in range(layers)]
    per_object = draw.int(1, 3)
    chunk = per_object * bs
    blocks = draw.int(0, min(nb, 2 * per_object + 1))
    block_ids = torch.tensor(gen.sample(range(nb), blocks), dtype=torch.int64)
    objects_count = max(1, -(-blocks // per_object))
    if bundle:
        # Rows a multiple of 16 bytes: the baseline cannot view a 1-token slice of a row whose length is no
        # multiple of a plane's element size (a RuntimeError we do not share; see lmcache_ascend.ops).
        row = -(-sum(w * d.itemsize for w, d in zip(widths, planes_dtypes)) // 16) * 16 + draw.pick((0, 16))
        obj_shape, obj_dtype = (layers, chunk, row), torch.uint8
    elif facts.mla:
        obj_shape, obj_dtype = (layers, chunk, hs), dtype
    elif facts.single_plane:  # K and V packed in each row, or one of them alone
        obj_shape, obj_dtype = (layers, chunk, nh * hs), dtype
    else:
        obj_shape, obj_dtype = (2, layers, chunk, nh * hs), dtype
    objects = [_filled(obj_shape, obj_dtype, gen, device if draw.int(0, 1) else torch.device("cpu"), poison=store)
               for _ in range(objects_count)]
    skip = draw.int(0, blocks + 1) if draw.int(0, 1) else 0
    use_list = draw.int(0, 1) == 1
    meta.update(fmt=fmt, blocks=blocks, per_object=per_object, skip=skip, objects=objects_count)
    flat = _flatten(paged)
    tensors = [*flat, *objects, block_ids]

    def call(ops, t, baseline):
        paged_ = _unflatten(paged, t[: len(flat)], baseline)
        objects_ = t[len(flat): len(flat) + objects_count]
        if baseline:
            objects_ = [_baseline_view(o) for o in objects_]
        ids = t[-1].tolist() if use_list else t[-1].to(device)
        desc = ops.PageBufferShapeDesc()
        desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 2, layers, nb, bs, nh, hs
        desc.element_size = dtype.itemsize
        desc.dtype = _baseline_view(torch.empty(0, dtype=dtype)).dtype if baseline else dtype
        if bundle:  # planes of several dtypes
            desc.dtype = None
        ops.multi_layer_block_kv_transfer(paged_, list(objects_), ids, device, D2H if store else H2D, desc, chunk,
                                          ops.fmt(fmt), skip)

    return {"tensors": tensors, "call": call, "meta": meta}


def _flatten(paged):
    if isinstance(paged, torch.Tensor):
        return [paged]
    out = []
    for entry in paged:
        out += _flatten(entry)
    return out


def _unflatten(template, flat, baseline):
    items = iter(_baseline_view(t) if baseline else t for t in flat)

    def rebuild(node):
        if isinstance(node, torch.Tensor):
            return next(items)
        built = [rebuild(child) for child in node]
        return tuple(built) if isinstance(node, tuple) else built

    return rebuild(template)


def run_case(case, ours, baseline):
    """Run both; return (outcome, detail): 'equal', 'both-raise', or a mismatch description."""
    worlds = []
    errors = []
    for ops, is_baseline in ((ours, False), (baseline, True)):
        tensors = [t.clone() for t in case["tensors"]]
        try:
            case["call"](ops, tensors, is_baseline)
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - compared below
            errors.append(error)
        worlds.append(tensors)
    if errors[0] is not None or errors[1] is not None:
        if errors[0] is not None and errors[1] is not None:
            return "both-raise", f"ours: {errors[0]!r}; baseline: {errors[1]!r}"
        return "mismatch", f"ours raised {errors[0]!r}; baseline raised {errors[1]!r}"
    moved = False
    for index, (mine, theirs, before) in enumerate(zip(*worlds, case["tensors"])):
        a = _bytes(mine)
        b = _bytes(theirs)
        if not torch.equal(a, b):
            differing = int((a != b).sum())
            return "mismatch", f"tensor {index} {tuple(mine.shape)}: {differing} bytes differ"
        moved = moved or not torch.equal(a, _bytes(before))
    # The control: "moved" cases changed some poisoned byte (a no-op would pass as equal too).
    return "equal", "moved" if moved else "unchanged"


def _bytes(tensor):
    return tensor.contiguous().view(torch.uint8).cpu() if tensor.numel() else torch.empty(0, dtype=torch.uint8)
