"""Every attention backend the installed vLLM can import: its own cache, registered and round-tripped.

Per backend module of ``vllm/v1/attention/backends`` (and ``mla/``) that imports on
this stack: build a cache exactly as vLLM's runner does (the backend's
``get_kv_cache_shape`` allocated in its ``get_kv_cache_stride_order`` on vLLM <= 0.23;
the [blocks, heads, tokens, cell] view in each layout of ``supported_kv_cache_layouts``
on vLLM >= 0.32), describe it with `backend_dims_of`, store 20 tokens from
some slots and load them into a poisoned cache at other slots, then compare every
element of every token against a reference indexed straight from the documented
layout.  A backend whose layout lmcache-ascend cannot read must be refused with a
KVCacheShapeError (never moved).  The module prints the matrix (``pytest -s``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

from tests.kv_worker._geometry import geometry as group_geometry
from lmcache_ascend.connector.attention_backends import backend_dims_of
from lmcache_ascend.kv_worker import ChunkMover, DimRole, KVCacheShapeError, PackedKV, plan_kv_caches

vllm = pytest.importorskip("vllm")
from vllm.v1.attention.backend import AttentionBackend  # noqa: E402

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 5, 16, 2, 64
TOKENS = 20  # one block and a part of the next: partial blocks must move only their own tokens
POISON = 0xA5  # byte
NEW_FAMILY = importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None


def _backend_modules():
    import vllm.v1.attention.backends as package

    names = [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__) if not info.ispkg]
    mla = importlib.import_module(f"{package.__name__}.mla")
    names += [f"{mla.__name__}.{info.name}" for info in pkgutil.iter_modules(mla.__path__)]
    return sorted(names)


def _backends():
    found, not_importable = [], {}
    for module_name in _backend_modules():
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - recorded: which backends a stack cannot import, and why
            not_importable[module_name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module_name and issubclass(cls, AttentionBackend) and not inspect.isabstract(cls):
                found.append(cls)
    return found, not_importable


BACKENDS, NOT_IMPORTABLE = _backends()
MATRIX: dict[str, str] = {}


def _inverse(order):
    return tuple(sorted(range(len(order)), key=lambda i: order[i]))


def _spec(backend):
    """The layer's KV-cache spec as vLLM >= 0.32 builds it: the model's spec, then the backend's customize_spec."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if "mla" in backend.__module__.split("."):
        spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float16)
    else:
        head_size_v = getattr(backend, "head_size_v", None)  # FLASH_ATTN_DIFFKV's own V head size
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float16,
            head_size_v=head_size_v if isinstance(head_size_v, int) else HEAD_SIZE,
        )
    return backend.customize_spec(spec)


def _caches(backend) -> list[tuple[str, callable, object, object]]:
    """(case, cache factory, layout, spec) as vLLM's runner would register them; raises KVCacheShapeError if refused."""
    if NEW_FAMILY:
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
        from vllm.v1.kv_cache_layout import KVCacheLayout

        spec = _spec(backend)
        shape_bytes = compute_layer_kv_cache_shape_bytes(spec, NUM_BLOCKS)  # (B, H, N, C bytes)
        supported = backend.supported_kv_cache_layouts() or tuple(KVCacheLayout)
        cases = []
        for kv_layout in supported:
            config = type("Config", (), {"cache_config": type("C", (), {
                "get_resolved_kv_cache_layout": staticmethod(lambda kv_layout=kv_layout: kv_layout)})()})()
            backend_dims = backend_dims_of(backend, config, spec)
            order = kv_layout.layer_view_order
            cases.append((kv_layout.name, lambda order=order: _allocate(shape_bytes, order, spec.dtype), backend_dims, spec))
        return cases
    from vllm.config import DeviceConfig, VllmConfig

    backend_dims = backend_dims_of(backend, VllmConfig(device_config=DeviceConfig(device="cpu")))
    shape = tuple(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE))
    order = backend_dims.stride_order or tuple(range(len(shape)))
    return [("stride order " + str(order), lambda: _allocate(shape, order, torch.float32), backend_dims, None)]


def _allocate(shape, order, dtype):
    """uint8 storage in the physical `order`, viewed as `dtype` (the last dim is innermost in every order)."""
    physical = torch.empty(tuple(shape[i] for i in order), dtype=torch.uint8 if NEW_FAMILY else dtype)
    logical = physical.permute(_inverse(order))
    return logical.view(dtype) if NEW_FAMILY else logical


def _token_v032(backend, spec, cache, slot):
    """K and V of one slot as the backend's own code reads its [B, H, N, C] view (vLLM >= 0.32)."""
    block, offset = divmod(slot, cache.shape[2])
    name = backend.get_name()
    if name == "CPU_ATTN":  # cpu_attn.py: view(B, H, 2 * N, D), K rows then V rows
        b, h, n, c = cache.shape
        rows = cache.contiguous().view(b, h, 2 * n, c // 2)
        return rows[block, :, offset], rows[block, :, n + offset]
    if name in ("B12X", "ROCM_SEGMENTED_ATTN"):  # kv_cache.unbind(1) / kv_cache[:, 0], kv_cache[:, 1]
        key, value = cache.unbind(1)
        return (key[block, offset].unflatten(-1, (spec.num_kv_heads, spec.head_size)),
                value[block, offset].unflatten(-1, (spec.num_kv_heads, spec.head_size)))
    if not spec.head_size_v:  # MLA: one latent per token
        return (cache[block, :, offset],)
    if spec.state_content_bytes is not None:  # a packed slot per (token, head): moved verbatim
        return (cache.transpose(1, 2)[block, offset],)
    # flash_attn.py and the like: kv_cache.transpose(1, 2).split(head_size, dim=-1)
    key, value = cache.transpose(1, 2).split([spec.head_size, spec.head_size_v], dim=-1)
    return key[block, offset], value[block, offset]


def _token_v023(cache, backend_dims, slot):
    """Every element of one slot, indexed from the roles get_kv_cache_shape documents (vLLM <= 0.23)."""
    roles = list(backend_dims.dims)
    if backend_dims.packed_kv is PackedKV.ROWS_PER_BLOCK_HEAD:  # cpu_attn.py: view(B, H, 2 * N, D), K rows then V rows
        b, h, n, c = cache.shape
        rows = cache.contiguous().view(b, h, 2 * n, c // 2)
        block, offset = divmod(slot, n)
        return (rows[block, :, offset], rows[block, :, n + offset])
    index = [slice(None)] * cache.ndim
    index[roles.index(DimRole.BLOCK)] = slot // cache.shape[roles.index(DimRole.TOKEN)]
    index[roles.index(DimRole.TOKEN)] = slot % cache.shape[roles.index(DimRole.TOKEN)]
    return (cache[tuple(index)],)


def _token_bytes(backend, spec, cache, backend_dims, slot):
    parts = _token_v032(backend, spec, cache, slot) if NEW_FAMILY else _token_v023(cache, backend_dims, slot)
    return torch.cat([part.contiguous().view(torch.uint8).flatten() for part in parts])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"{b.__module__.rsplit('.', 1)[-1]}.{b.__name__}")
def test_backend_cache_round_trips_every_token_or_is_refused(backend):
    name = f"{backend.__module__.rsplit('.', 1)[-1]}.{backend.__name__}"
    try:
        cases = _caches(backend)
    except KVCacheShapeError as error:
        MATRIX[name] = f"refused at registration: {error}"
        assert backend.get_name() in str(error)
        return
    except NotImplementedError:
        MATRIX[name] = "no KV-cache shape (not a paged attention cache)"
        return
    store_slots = torch.arange(BLOCK_SIZE, BLOCK_SIZE + TOKENS)
    load_slots = torch.tensor([NUM_BLOCKS * BLOCK_SIZE - 1 - t for t in range(TOKENS)])
    geometry = {0: group_geometry(0)}
    generator = torch.Generator().manual_seed(0)
    for case, allocate, backend_dims, spec in cases:
        source, target = allocate(), allocate()
        # Every byte random (exact in any dtype), the target poisoned.
        source.view(torch.uint8).copy_(torch.randint(0, 256, source.view(torch.uint8).shape, generator=generator,
                                                     dtype=torch.uint8))
        target.view(torch.uint8).fill_(POISON)
        _, store_planner = plan_kv_caches({"l": source}, {"l": (0,)}, geometry, TOKENS, backend_dims={"l": backend_dims})
        _, load_planner = plan_kv_caches({"l": target}, {"l": (0,)}, geometry, TOKENS, backend_dims={"l": backend_dims})
        chunk = torch.zeros(store_planner.full_plan.total_bytes, dtype=torch.uint8)
        ChunkMover(store_planner, backend="torch").move(chunk, 0, TOKENS, {0: store_slots}, store=True)
        ChunkMover(load_planner, backend="torch").move(chunk, 0, TOKENS, {0: load_slots}, store=False)
        moved = set(load_slots.tolist())
        for t in range(TOKENS):
            loaded = _token_bytes(backend, spec, target, backend_dims, int(load_slots[t]))
            stored = _token_bytes(backend, spec, source, backend_dims, int(store_slots[t]))
            assert torch.equal(loaded, stored), (case, t)
        for slot in range(NUM_BLOCKS * BLOCK_SIZE):
            if slot not in moved:
                assert bool((_token_bytes(backend, spec, target, backend_dims, slot) == POISON).all()), (case, slot)
    MATRIX[name] = "covered: " + "; ".join(f"{case} as {backend_dims.describe()}" for case, _, backend_dims, _ in cases)


def test_print_matrix():
    print(f"\nvLLM {vllm.__version__}: {len(BACKENDS)} backend classes imported")
    for name, outcome in sorted(MATRIX.items()):
        print(f"  {name}: {outcome}")
    for module, reason in sorted(NOT_IMPORTABLE.items()):
        print(f"  {module}: not importable ({reason})")
