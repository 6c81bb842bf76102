"""LMCache's own vLLM GPU connector (VLLMPagedMemGPUConnectorV2) on CPU tensors: our bound ops vs its torch baseline.

Run in a fresh interpreter with PYTHONOPTIMIZE=1: the connector asserts that the
caches are CUDA tensors, a hardware check (as its `torch.cuda.Stream`s are, which
are faked here: no-op streams). Everything else is LMCache 0.5.6's code. For each
layout a world with LMCache's CPU `device_ops` (the torch baseline) and a world
with an `NpuDeviceOps` that bound `lmcache_ascend.ops` run the same stores
(`from_gpu`, `batched_from_gpu`) and loads (`to_gpu`, `batched_to_gpu`) on
identical poisoned buffers; every byte of every buffer is compared.
"""

from __future__ import annotations

import contextlib
import random
import sys

import torch

POISON = 0xA5


class _NoStream:
    """A CUDA stream on a machine without one: every wait and sync is already done."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass


def _fake_cuda_streams() -> None:
    torch.cuda.Stream = _NoStream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()


def _memory_obj(shape, dtype, mla):
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.full((nbytes,), POISON, dtype=torch.uint8)
    metadata = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=nbytes, ref_count=1,
                                 fmt=MemoryFormat.KV_MLA_FMT if mla else MemoryFormat.KV_2LTD)
    return TensorMemoryObj(raw, metadata, None)


def _random_bytes(tensor, rng):
    flat = tensor.view(-1).view(torch.uint8)
    flat.copy_(torch.frombuffer(bytearray(rng.randbytes(flat.numel())), dtype=torch.uint8))


# (name, per-layer cache shape from (nb, bs, nh, hs), mla)
LAYOUTS = (
    ("flash-attn [2, NB, BS, NH, HS]", lambda nb, bs, nh, hs: (2, nb, bs, nh, hs), False),
    ("flash-infer [NB, 2, BS, NH, HS]", lambda nb, bs, nh, hs: (nb, 2, bs, nh, hs), False),
    ("MLA [NB, BS, HS]", lambda nb, bs, nh, hs: (nb, bs, hs), True),
)


def _world(device_ops, caches, layers, hidden, mla):
    from lmcache.v1.gpu_connector import gpu_connectors

    gpu_connectors.device_ops = device_ops
    # vLLM's GPU backends register NHD caches (without the hint LMCache takes a CPU host for vLLM's CPU backend).
    return gpu_connectors.VLLMPagedMemGPUConnectorV2(hidden, layers, use_gpu=False, use_mla=mla,
                                                     layout_hints={"kv_layout": "NHD"})


def run(seed: int, corrupt: bool = False) -> list[str]:
    """One random case per layout; returns the problems found (empty: byte-equal, and bytes moved).

    `corrupt` (the control): our op flips one stored byte, which must be found.
    """
    import lmcache
    from lmcache.v1.platform.devices.npu.device_ops import NpuDeviceOps

    import lmcache_ascend.ops as ops

    baseline_ops = lmcache.device_ops
    ours = NpuDeviceOps()
    ours.ensure_native()
    assert ours.multi_layer_kv_transfer is ops.multi_layer_kv_transfer
    calls = []
    bound = ours.multi_layer_kv_transfer

    def counted(key_value, *args, **kwargs):
        calls.append(1)
        bound(key_value, *args, **kwargs)
        if corrupt and args[4].value == 1 and key_value.numel():  # a store: flip its first byte
            key_value.view(torch.uint8).view(-1)[0] ^= 0xFF

    ours.multi_layer_kv_transfer = counted

    rng = random.Random(seed)
    problems = []
    for name, shape_of, mla in LAYOUTS:
        # Block size and head count apart, so that LMCache tells NHD from HND by the shape.
        layers, nb, bs, nh, hs = rng.randint(1, 3), rng.randint(2, 5), rng.choice((16, 32)), rng.choice((2, 4)), \
            rng.choice((8, 64))
        dtype = rng.choice((torch.bfloat16, torch.float16, torch.float32))
        hidden = hs if mla else nh * hs
        tokens = nb * bs
        slots = torch.tensor(rng.sample(range(nb * bs), tokens), dtype=torch.int64)
        chunks = sorted(rng.sample(range(1, tokens), min(2, tokens - 1))) if tokens > 2 else []
        bounds = list(zip([0, *chunks], [*chunks, tokens]))
        caches = [torch.empty(shape_of(nb, bs, nh, hs), dtype=dtype) for _ in range(layers)]
        for cache in caches:
            _random_bytes(cache, rng)
        payload = [torch.empty((1 if mla else 2, layers, end - start, hidden), dtype=dtype) for start, end in bounds]
        for tensor in payload:
            _random_bytes(tensor, rng)
        cached = rng.randint(0, bounds[0][1])  # vLLM's own prefix: the load skips it
        outcome = []
        for device_ops in (baseline_ops, ours):
            connector = _world(device_ops, caches, layers, hidden, mla)
            kv = [c.clone() for c in caches]
            stored = [_memory_obj((1 if mla else 2, layers, end - start, hidden), dtype, mla) for start, end in bounds]
            connector.from_gpu(stored[0], *bounds[0], kvcaches=kv, slot_mapping=slots)
            connector.batched_from_gpu(stored[1:], [s for s, _ in bounds[1:]], [e for _, e in bounds[1:]],
                                       kvcaches=kv, slot_mapping=slots)
            loaded = [torch.full_like(c.view(torch.uint8), POISON).view(dtype) for c in caches]
            objects = [_memory_obj(p.shape, dtype, mla) for p in payload]
            for obj, p in zip(objects, payload):
                obj.tensor.copy_(p)
            connector.to_gpu(objects[0], *bounds[0], kvcaches=loaded, slot_mapping=slots, vllm_cached_tokens=cached)
            connector.batched_to_gpu(objects[1:], [s for s, _ in bounds[1:]], [e for _, e in bounds[1:]],
                                     kvcaches=loaded, slot_mapping=slots)
            outcome.append([o.tensor.view(torch.uint8).clone() for o in stored] + [c.view(torch.uint8) for c in loaded])
        for index, (a, b) in enumerate(zip(*outcome)):
            if not torch.equal(a, b):
                problems.append(f"seed {seed} {name}: buffer {index} differs in {int((a != b).sum())} bytes")
        if all(torch.all(t == POISON) for t in outcome[1]):
            problems.append(f"seed {seed} {name}: nothing moved (control)")
    if not calls:
        problems.append("LMCache's connector never called our bound op")
    return problems


def main(cases: int, corrupt: bool = False) -> None:
    if sys.flags.optimize < 1:
        raise SystemExit("run with PYTHONOPTIMIZE=1 (the connector's CUDA-device assertion)")
    _fake_cuda_streams()
    problems = []
    for seed in range(cases):
        problems += run(seed, corrupt)
    for problem in problems:
        print("PROBLEM", problem)
    print(f"CASES {cases} PROBLEMS {len(problems)}")
    sys.exit(1 if problems else 0)
