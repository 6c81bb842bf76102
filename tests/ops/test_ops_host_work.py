"""What `lmcache_ascend.ops` keeps between calls, and how many launches a call makes (CPU, torch reference).

LMCache hands an engine's pointer table to every call, so the paged caches
behind it are described once; a table rewritten in place must be read again.
A block call moves its whole objects in one launch.
"""

from __future__ import annotations

import torch

from lmcache_ascend.kernels import launch_counter
from lmcache_ascend.op_surface import arguments
import lmcache_ascend.ops as ops

H2D, D2H = 0, 1
MLA = 3  # NL_X_NB_BS_HS: one latent row per token, per layer [NB, BS, H]
LAYERS, BLOCKS, BLOCK, HIDDEN = 2, 6, 4, 8


def _caches(fill: float) -> list[torch.Tensor]:
    return [torch.full((BLOCKS, BLOCK, HIDDEN), fill) for _ in range(LAYERS)]


def _table(caches: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64)


def _rows(caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([cache.reshape(-1, HIDDEN)[slots] for cache in caches])


def test_a_pointer_table_rewritten_in_place_is_read_again():
    first, second = _caches(-1.0), _caches(-2.0)
    table = _table(first)
    slots = torch.tensor([0, 5, 10, 23])
    chunk = torch.arange(LAYERS * 4 * HIDDEN, dtype=torch.float32).reshape(1, LAYERS, 4, HIDDEN)
    ops.multi_layer_kv_transfer(chunk, table, slots, "cpu", BLOCKS * BLOCK, H2D, MLA, BLOCK, HIDDEN)
    assert torch.equal(_rows(first, slots), chunk[0])
    table.copy_(_table(second))  # the same tensor, now naming other caches
    ops.multi_layer_kv_transfer(chunk + 1000, table, slots, "cpu", BLOCKS * BLOCK, H2D, MLA, BLOCK, HIDDEN)
    assert torch.equal(_rows(second, slots), chunk[0] + 1000)
    assert torch.equal(_rows(first, slots), chunk[0]), "the first caches were written through a stale table"
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert all((cache.reshape(-1, HIDDEN)[untouched] == -2.0).all() for cache in second)


def _desc() -> ops.PageBufferShapeDesc:
    desc = ops.PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 1, LAYERS, BLOCKS, BLOCK, 1, HIDDEN
    desc.element_size, desc.dtype = 4, torch.float32
    return desc


def test_a_block_call_moves_its_whole_objects_in_one_launch():
    caches = _caches(0.0)
    for layer, cache in enumerate(caches):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(layer)))
    block_ids = torch.tensor([4, 1, 5, 0, 2])  # 5 blocks in objects of 2: the last object half full
    objects = [torch.full((LAYERS, 2 * BLOCK, HIDDEN), float("nan")) for _ in range(3)]
    before = launch_counter.torch
    ops.multi_layer_block_kv_transfer(_table(caches), objects, block_ids, "cpu", D2H, _desc(), 2 * BLOCK, MLA, 0)
    assert launch_counter.torch - before == 1
    for index, obj in enumerate(objects):
        ids = block_ids[2 * index: 2 * index + 2]
        for layer in range(LAYERS):
            expected = caches[layer][ids].reshape(-1, HIDDEN)
            assert torch.equal(obj[layer, : len(expected)], expected), (index, layer)
            assert obj[layer, len(expected):].isnan().all(), "rows past the request's blocks were written"
    # A skipped prefix that cuts into an object: that object moves on its own, the rest together.
    objects = [torch.zeros(LAYERS, 2 * BLOCK, HIDDEN) for _ in range(3)]
    before = launch_counter.torch
    ops.multi_layer_block_kv_transfer(_table(caches), objects, block_ids, "cpu", D2H, _desc(), 2 * BLOCK, MLA, 1)
    assert launch_counter.torch - before == 2
    assert (objects[0][:, :BLOCK] == 0).all()
    assert torch.equal(objects[0][0, BLOCK:], caches[0][block_ids[1]])


def test_a_cache_list_given_other_tensors_is_read_again():
    """LMCache may hand the layer tensors as a list: the same list holding other tensors is another description."""
    first, second = _caches(0.0), _caches(0.0)
    for layer in range(LAYERS):
        first[layer].copy_(torch.full_like(first[layer], 1.0 + layer))
        second[layer].copy_(torch.full_like(second[layer], 10.0 + layer))
    paged = list(first)
    block_ids = torch.tensor([3, 0])
    objects = [torch.zeros(LAYERS, 2 * BLOCK, HIDDEN)]
    ops.multi_layer_block_kv_transfer(paged, objects, block_ids, "cpu", D2H, _desc(), 2 * BLOCK, MLA, 0)
    assert [float(objects[0][layer].unique()) for layer in range(LAYERS)] == [1.0, 2.0]
    paged[1] = second[1]  # the same list object, one entry replaced
    ops.multi_layer_block_kv_transfer(paged, objects, block_ids, "cpu", D2H, _desc(), 2 * BLOCK, MLA, 0)
    assert [float(objects[0][layer].unique()) for layer in range(LAYERS)] == [1.0, 11.0]


def test_a_new_list_of_the_same_tensors_is_the_same_description():
    caches = _caches(3.0)
    block_ids = torch.tensor([1, 2])
    first = [torch.zeros(LAYERS, 2 * BLOCK, HIDDEN)]
    ops.multi_layer_block_kv_transfer(list(caches), first, block_ids, "cpu", D2H, _desc(), 2 * BLOCK, MLA, 0)
    second = [torch.zeros(LAYERS, 2 * BLOCK, HIDDEN)]
    ops.multi_layer_block_kv_transfer(list(caches), second, block_ids, "cpu", D2H, _desc(), 2 * BLOCK, MLA, 0)
    assert (first[0] == 3.0).all() and torch.equal(first[0], second[0])
    assert sum(key[0] == tuple(map(id, caches)) for key in arguments.tables._entries) == 1, "described twice"


def test_a_description_without_every_field_is_keyed_and_moved():
    """Every block call keys its repeat on the description's fields; one an older LMCache's description
    lacks (`block_stride_elems`) is None in the key, and the call moves what a full description moves."""
    import types

    from lmcache_ascend.op_surface import per_block

    full = _desc()
    partial = types.SimpleNamespace(**{field: getattr(full, field) for field in per_block._SHAPE_DESC_FIELDS
                                       if field != "block_stride_elems"})
    assert per_block._shape_desc_values(full) == tuple(getattr(full, f) for f in per_block._SHAPE_DESC_FIELDS)
    assert per_block._shape_desc_values(partial) == tuple(
        None if field == "block_stride_elems" else getattr(full, field) for field in per_block._SHAPE_DESC_FIELDS)
    caches = [torch.arange(BLOCKS * BLOCK * HIDDEN, dtype=torch.float32).reshape(BLOCKS, BLOCK, HIDDEN) + layer
              for layer in range(LAYERS)]
    moved = []
    for desc in (full, partial):
        objects = [torch.full((LAYERS, 2 * BLOCK, HIDDEN), -1.0)]
        ops.multi_layer_block_kv_transfer(caches, objects, [4, 1], "cpu", D2H, desc, 2 * BLOCK, MLA, 0)
        moved.append(objects[0])
    slots = torch.cat([torch.arange(4 * BLOCK, 5 * BLOCK), torch.arange(BLOCK, 2 * BLOCK)])
    assert torch.equal(moved[0], _rows(caches, slots)) and torch.equal(moved[1], moved[0])


def test_the_op_surface_reads_the_backend_flag_on_every_call(monkeypatch):
    """LMCACHE_ASCEND_TRANSFER_BACKEND is the op surface's to read (the kernels take the backend from it)."""
    import pytest

    from lmcache_ascend.flags import FlagError
    from lmcache_ascend.kernels import TransferError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    caches = _caches(-1.0)
    slots = torch.tensor([0, 5, 10, 23])
    chunk = torch.arange(LAYERS * 4 * HIDDEN, dtype=torch.float32).reshape(1, LAYERS, 4, HIDDEN)

    def call():
        ops.multi_layer_kv_transfer(chunk, _table(caches), slots, "cpu", BLOCKS * BLOCK, H2D, MLA, BLOCK, HIDDEN)

    monkeypatch.setenv("LMCACHE_ASCEND_TRANSFER_BACKEND", "cuda")
    with pytest.raises(FlagError, match=r"LMCACHE_ASCEND_TRANSFER_BACKEND='cuda' is not allowed"):
        call()
    monkeypatch.setenv("LMCACHE_ASCEND_TRANSFER_BACKEND", "triton")
    with pytest.raises(TransferError, match=r"backend 'triton' cannot run on device cpu"):
        call()
    assert (_rows(caches, slots) == -1.0).all(), "a refused call moved rows"
    monkeypatch.setenv("LMCACHE_ASCEND_TRANSFER_BACKEND", "torch")
    call()
    assert torch.equal(_rows(caches, slots), chunk[0])



BUNDLE = 17  # NL_X_NP_X_NB_BS_ONE_HS: per layer a tuple of plane tensors [NB, BS, 1, HS]


def _plane_call(paged: list, fill_check: list[float]) -> None:
    """A block call over per-layer plane entries (one float32 plane); checks each layer's object bytes."""
    desc = ops.PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 1, LAYERS, BLOCKS, BLOCK, 1, HIDDEN
    desc.element_size, desc.dtype = 4, None
    objects = [torch.zeros(LAYERS, 2 * BLOCK, HIDDEN * 4, dtype=torch.uint8)]
    ops.multi_layer_block_kv_transfer(paged, objects, torch.tensor([2, 4]), "cpu", D2H, desc, 2 * BLOCK, BUNDLE, 0)
    values = objects[0].view(torch.float32)
    assert [float(values[layer].unique()) for layer in range(LAYERS)] == fill_check


def _planes(fill: float) -> list[torch.Tensor]:
    return [torch.full((BLOCKS, BLOCK, 1, HIDDEN), fill + layer) for layer in range(LAYERS)]


def test_a_list_of_per_layer_tuples_is_described_once():
    """LMCache hands per-layer plane tuples in a new list each call: the same tuples are the same description."""
    paged = [(plane,) for plane in _planes(5.0)]
    for _ in range(2):
        _plane_call(list(paged), [5.0, 6.0])
    assert sum(key[0] == tuple(map(id, paged)) for key in arguments.tables._entries) == 1, "described twice"


def test_a_list_of_per_layer_lists_changed_in_place_is_read_again():
    """Lists inside the list may change under the same objects: their tensors, not the lists, are the description."""
    first, second = _planes(1.0), _planes(7.0)
    paged = [[plane] for plane in first]
    _plane_call(paged, [1.0, 2.0])
    paged[1][0] = second[1]  # the same inner list, now holding another layer tensor
    _plane_call(paged, [1.0, 8.0])
