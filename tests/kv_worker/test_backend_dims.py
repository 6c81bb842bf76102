"""Layouts described by the attention backend: the vLLM CPU cache, head-major planes,
HMA's cross-group sharing, and the errors.

Each round trip stores tokens from one set of slots, loads them into a poisoned
cache at other slots, and checks every element of every token against a reference
read straight from the backend's documented layout, and that nothing else moved.
"""

from __future__ import annotations

import pytest
import torch

from tests.kv_worker._geometry import geometry as group_geometry
from lmcache_ascend.kv_worker import (
    ChunkPlanner,
    ChunkMover,
    KVFormat,
    KVCacheShapeError,
    build_layer_groups,
    detect_layer_planes,
    plan_kv_caches,
)
from lmcache_ascend.kv_worker.backend_dims import (
    BackendDims,
    DimRole,
    PackedKV,
    ShapeProbe,
    cell_dims,
    dims_from_probe,
)

B, H, N, D = 6, 4, 8, 16  # blocks, KV heads, block size, head size
POISON = -7.0


def cpu_cache(seed: int | None) -> torch.Tensor:
    """vLLM CPU_ATTN's cache: [num_blocks, num_kv_heads, block_size, 2 * head_size]."""
    if seed is None:
        return torch.full((B, H, N, 2 * D), POISON)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((B, H, N, 2 * D), generator=generator)


def cpu_token_kv(cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [heads, head_size] of one slot, read as cpu_attn.py documents it:
    view (num_blocks, num_kv_heads, 2 * block_size, head_size), K rows then V rows."""
    rows = cache.view(B, H, 2 * N, D)
    block, offset = divmod(slot, N)
    return rows[block, :, offset], rows[block, :, N + offset]


CPU_DIMS_V032 = cell_dims("CPU_ATTN", packs_kv=True)  # vLLM >= 0.32's per-layer view
CPU_DIMS_V023 = dims_from_probe("CPU_ATTN", (13, 3, 64, 160), ShapeProbe())  # vLLM 0.23's get_kv_cache_shape


def _roundtrip(source: dict, target: dict, dims_by_layer: dict, plane_groups: dict, geometry: dict,
               store_slots: dict, load_slots: dict, tokens: int) -> None:
    _, store_planner = plan_kv_caches(source, plane_groups, geometry, tokens, backend_dims=dims_by_layer)
    _, load_planner = plan_kv_caches(target, plane_groups, geometry, tokens, backend_dims=dims_by_layer)
    chunk = torch.full((store_planner.full_plan.total_bytes,), 0xA5, dtype=torch.uint8)
    ChunkMover(store_planner, backend="torch").move(chunk, 0, tokens, store_slots, store=True)
    ChunkMover(load_planner, backend="torch").move(chunk, 0, tokens, load_slots, store=False)


@pytest.mark.parametrize("backend_dims", [CPU_DIMS_V032, CPU_DIMS_V023], ids=["vllm-0.32", "vllm-0.23"])
def test_cpu_layout_round_trips_every_token(backend_dims):
    assert backend_dims.packed_kv is PackedKV.ROWS_PER_BLOCK_HEAD
    tokens = 20  # 2.5 blocks: a partial block must move only its own tokens
    store_slots = torch.arange(N, N + tokens)  # blocks 1, 2 and half of 3
    load_slots = torch.tensor([5 * N - 1 - t for t in range(tokens)])  # elsewhere, reversed
    source = {"l0": cpu_cache(1), "l1": cpu_cache(2)}
    target = {"l0": cpu_cache(None), "l1": cpu_cache(None)}
    dims_by_layer = {name: backend_dims for name in source}
    geometry = {0: group_geometry(0)}
    _roundtrip(source, target, dims_by_layer, {n: (0,) for n in source}, geometry, {0: store_slots}, {0: load_slots}, tokens)
    for name in source:
        written = torch.zeros(B * N, dtype=torch.bool)
        for t in range(tokens):
            k_src, v_src = cpu_token_kv(source[name], int(store_slots[t]))
            k_dst, v_dst = cpu_token_kv(target[name], int(load_slots[t]))
            assert torch.equal(k_dst, k_src) and torch.equal(v_dst, v_src), (name, t)
            written[int(load_slots[t])] = True
        for slot in torch.nonzero(~written).flatten().tolist():
            k, v = cpu_token_kv(target[name], slot)
            assert bool((k == POISON).all() and (v == POISON).all()), (name, slot)


def test_cpu_layout_planes_are_per_head_k_and_v():
    layer = detect_layer_planes("l0", cpu_cache(0), [0], backend_dims=CPU_DIMS_V032)
    assert layer.format is KVFormat.HEAD_MAJOR
    assert [(p.head, p.plane_index) for p in layer.planes] == [(h, kv) for h in range(H) for kv in (0, 1)]
    assert {(p.block_size, p.num_blocks, p.row_bytes, p.kernel_block_rows) for p in layer.planes} == {(N, B, D * 4, N)}
    # Control: the old guess from the number of dims (4 dims -> MLA [num_blocks,
    # block_size, ...]) read the head count as the block size and a whole
    # [block_size, 2 * head_size] slab as one row.
    guessed_block_size, guessed_row_bytes = cpu_cache(0).shape[1], N * 2 * D * 4
    assert (guessed_block_size, guessed_row_bytes) != (layer.planes[0].block_size, layer.planes[0].row_bytes)


def test_cpu_layout_without_its_rows_rule_moves_other_tokens():
    """Control: the same tensor read as packed per cell moves the wrong bytes for a token."""
    per_cell = BackendDims("CPU_ATTN", CPU_DIMS_V032.dims, PackedKV.PER_CELL)
    source, target = {"l0": cpu_cache(3)}, {"l0": cpu_cache(None)}
    slots = {0: torch.arange(0, 3)}
    _roundtrip(source, target, {"l0": per_cell}, {"l0": (0,)}, {0: group_geometry(0)}, slots, slots, 3)
    # Token 1's V lies in row N + 1 of the [2 * block_size, head_size] interior: not moved.
    _, v_src = cpu_token_kv(source["l0"], 1)
    _, v_dst = cpu_token_kv(target["l0"], 1)
    assert bool((v_dst == POISON).all()) and not torch.equal(v_dst, v_src)


def test_hma_shared_tensor_moves_every_group_and_kv_sharing_moves_once():
    """vLLM's hybrid manager backs a layer of each KV-cache group with one tensor (disjoint blocks)."""
    shared = cpu_cache(4)
    source = {"full.0": shared, "swa.0": shared, "shared_kv.1": shared}  # shared_kv.1: KV sharing in group 0
    target_tensor = cpu_cache(None)
    target = {"full.0": target_tensor, "swa.0": target_tensor, "shared_kv.1": target_tensor}
    plane_groups = {"full.0": (0,), "swa.0": (1,), "shared_kv.1": (0,)}
    dims_by_layer = {name: CPU_DIMS_V032 for name in source}
    geometry = {0: group_geometry(0), 1: group_geometry(1)}
    layers, backend_dims = plan_kv_caches(source, plane_groups, geometry, N, backend_dims=dims_by_layer)
    members = [name for group in backend_dims.layer_groups for name in group.member_names]
    assert sorted(members) == sorted(f"{layer}#h{h}" for layer in ("full.0", "swa.0") for h in range(H))
    # Control: the old identity (bytes only, no group) is equal for both groups'
    # planes, so the old rule dropped swa.0 entirely.
    def bytes_identity(rows):
        return rows.untyped_storage().data_ptr(), rows.storage_offset(), tuple(rows.shape), rows.stride()
    assert bytes_identity(layers[0].paged_rows[0]) == bytes_identity(layers[1].paged_rows[0])

    store_slots = {0: torch.arange(0, N), 1: torch.arange(2 * N, 3 * N)}  # group 0: block 0, group 1: block 2
    load_slots = {0: torch.arange(4 * N, 5 * N), 1: torch.arange(N, 2 * N)}
    _roundtrip(source, target, dims_by_layer, plane_groups, geometry, store_slots, load_slots, N)
    for group in (0, 1):
        for t in range(N):
            k_src, v_src = cpu_token_kv(shared, int(store_slots[group][t]))
            k_dst, v_dst = cpu_token_kv(target_tensor, int(load_slots[group][t]))
            assert torch.equal(k_dst, k_src) and torch.equal(v_dst, v_src), (group, t)


@pytest.mark.parametrize("bundle", [True, False])
def test_head_major_members_bundled_and_exploded(bundle):
    layer = detect_layer_planes("l0", cpu_cache(0), [0], backend_dims=CPU_DIMS_V032)
    groups = build_layer_groups([layer], {0: group_geometry(0)}, bundle_multi_spec=bundle)
    names = [name for group in groups for name in group.member_names]
    if bundle:
        assert names == [f"l0#h{h}" for h in range(H)] and groups[0].num_planes == 2
    else:
        assert names == [f"l0#h{h}#p{kv}" for h in range(H) for kv in (0, 1)] and groups[0].num_planes == 1
    ChunkPlanner(groups, {0: group_geometry(0)}, N)


def test_token_major_layout_is_one_row_per_token():
    # FLASH_ATTN-style [2, num_blocks, block_size, heads, head_size]: K and V planes, rows of every head.
    backend_dims = BackendDims("X", (DimRole.KV, DimRole.BLOCK, DimRole.TOKEN, DimRole.HEAD, DimRole.CONTENT))
    cache = torch.randn(2, B, N, H, D)
    layer = detect_layer_planes("l", cache, [0], backend_dims=backend_dims)
    assert layer.format is KVFormat.MERGED
    assert [(p.plane_index, p.row_bytes, p.kernel_block_rows) for p in layer.planes] == [(0, H * D * 4, 1), (1, H * D * 4, 1)]
    assert torch.equal(layer.paged_rows[1][N + 3, 0], cache[1, 1, 3].reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: detect_layer_planes("l", cpu_cache(0), [0]),
         r"layer 'l': a KV tensor of shape \(6, 4, 8, 32\), dtype torch.float32 came without"),
        (lambda: detect_layer_planes("l", torch.zeros(B, H, N), [0], backend_dims=CPU_DIMS_V032),
         r"layer 'l' \(shape \(6, 4, 8\).*dtype torch.float32, backend 'CPU_ATTN'.*3 dims, but the backend documents 4"),
        (lambda: dims_from_probe("MYSTERY", (13, 64, 3, 7), ShapeProbe()),
         r"backend 'MYSTERY'.*= \(13, 64, 3, 7\) has a dim of size 7"),
        (lambda: dims_from_probe("MYSTERY", (13, 3, 64, 160), ShapeProbe()),
         r"backend 'MYSTERY'.*packs K and V in one dim of 160"),
        (lambda: cell_dims("MYSTERY", packs_kv=True), r"backend 'MYSTERY': its KV-cache cells pack K and V"),
        (lambda: BackendDims("X", (DimRole.BLOCK, DimRole.CONTENT)), r"exactly one block dim and one token dim"),
        (lambda: detect_layer_planes(
            "l", torch.zeros(B, D, N, H).permute(0, 2, 3, 1), [0],
            backend_dims=BackendDims("X", (DimRole.BLOCK, DimRole.TOKEN, DimRole.HEAD, DimRole.CONTENT))),
         r"the bytes of one token row are not contiguous"),
    ],
)
def test_errors_name_layer_shape_dtype_and_backend(call, message):
    with pytest.raises(KVCacheShapeError, match=message):
        call()


def test_declared_stride_order_is_checked():
    tensor = torch.zeros(N, B, D).transpose(0, 1)  # blocks inner to tokens
    declared = BackendDims("X", (DimRole.BLOCK, DimRole.TOKEN, DimRole.CONTENT), stride_order=(0, 1, 2))
    with pytest.raises(KVCacheShapeError, match=r"backend 'X'.*strides disagree with the backend's stride order \(0, 1, 2\)"):
        detect_layer_planes("l", tensor, [0], backend_dims=declared)


def test_layers_of_groups_not_transferred_are_never_described():
    """A mamba-like state buffer vLLM lists under no attention layer, in a skipped group, needs no layout."""
    from lmcache_ascend.kv_worker import transferred_kv_caches

    caches = {"attn.0": cpu_cache(5), "mamba.1": torch.zeros(B, 7, dtype=torch.uint8)}
    plane_groups = {"attn.0": (0,), "mamba.1": (1,)}
    skipped = {0: group_geometry(0), 1: group_geometry(1, transferred=False)}
    assert list(transferred_kv_caches(caches, plane_groups, skipped)) == ["attn.0"]
    layers, _ = plan_kv_caches(caches, plane_groups, skipped, N, backend_dims={"attn.0": CPU_DIMS_V032})
    assert [layer.layer_name for layer in layers] == ["attn.0"]
    # Control: the same buffer in a transferred group is refused for want of a layout.
    moved = {0: group_geometry(0), 1: group_geometry(1)}
    with pytest.raises(KVCacheShapeError, match=r"layer 'mamba.1': a KV tensor of shape \(6, 7\), dtype torch.uint8"):
        plan_kv_caches(caches, plane_groups, moved, N, backend_dims={"attn.0": CPU_DIMS_V032})


def test_head_slots_and_unreadable_backends_are_refused_with_the_reason():
    slots = cell_dims("B12X", packs_kv=True, head_slots=2)
    assert slots.dims == (DimRole.BLOCK, DimRole.KV, DimRole.TOKEN, DimRole.CONTENT)
    # AITER's shuffle layout publishes 2 head slots under the name FLASH_ATTN: not read, refused.
    with pytest.raises(KVCacheShapeError, match=r"backend 'FLASH_ATTN': its spec publishes 2 head slots"):
        cell_dims("FLASH_ATTN", packs_kv=True, head_slots=2)
    with pytest.raises(KVCacheShapeError, match=r"backend 'B12X': its KV-cache cells pack K and V"):
        cell_dims("B12X", packs_kv=True)  # B12X always unbinds 2 slots: one per KV head is not its layout
    with pytest.raises(KVCacheShapeError, match=r"backend 'ROCM_ATTN' is refused: .*x-packed key"):
        dims_from_probe("ROCM_ATTN", (2, 13, 64, 3, 80), ShapeProbe())  # vLLM 0.23's shape hides the x-packing
    # FLASH_ATTN_DIFFKV's cell of head_size + its own V head size (vLLM 0.23's probe).
    diffkv = dims_from_probe("FLASH_ATTN_DIFFKV", (13, 64, 3, 208), ShapeProbe(), head_size_v=128)
    assert diffkv.packed_kv is PackedKV.PER_CELL
