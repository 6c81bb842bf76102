"""Host side of the Triton backend, checked in-process on CPU (no kernel launch).

The kernel reads one int64 table per (group, chunk shape, chunk offset, buffer
alignment), built and uploaded once; per-call values travel as scalar arguments.
These tests check every element of that table against values computed here from
the tensors themselves, that it is built once and rebuilt exactly when its key
changes, and the fixed regression cases on the torch reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmcache_ascend.kernels import PagedGroup, PagedPlane, PlaneSlots, TransferError, resolve_transfer
from lmcache_ascend.kernels import triton_transfer as tt
from tests.kernels._regressions import out_of_range_slot_cases


def _group() -> PagedGroup:
    blob = torch.zeros((3, 5, 4 * 132 + 4 * 2 + 8), dtype=torch.int8)  # per layer: blocks of 3 planes' bytes
    layers = []
    for layer in range(3):
        layers.append((
            blob[layer, :, : 4 * 132].view(5, 4, 132),
            blob[layer, :, 4 * 132 : 4 * 132 + 8].view(torch.float16).view(5, 4, 1),
            torch.zeros((7, 2, 96), dtype=torch.bfloat16),
        ))
    return PagedGroup((
        PagedPlane(tuple(layer[0] for layer in layers), 4, 132, name="indexer"),
        PagedPlane(tuple(layer[1] for layer in layers), 4, 2, name="scale"),
        PagedPlane(tuple(layer[2] for layer in layers), 2, 192, name="latent"),
    ))


def _slots(counts=(6, 6, 3)) -> tuple[PlaneSlots, ...]:
    return tuple(PlaneSlots(torch.arange(count, dtype=torch.int64)) for count in counts)


def _widest(*quantities: int) -> int:
    common = 0
    for quantity in quantities:
        common = math.gcd(common, quantity)
    return next(width for width in (16, 4, 2, 1) if common % width == 0)


@pytest.mark.parametrize("chunk_offset", [0, 4, 96])
def test_table_holds_exactly_each_tensors_geometry_and_each_regions_offset_and_width(chunk_offset):
    group = _group()
    slots = _slots()
    regions = group.chunk_regions([s.region_rows for s in slots])
    chunk = torch.full((chunk_offset + regions.total_bytes,), 0x5A, dtype=torch.uint8)
    transfer = resolve_transfer(group, slots, chunk, store=True, chunk_offset=chunk_offset)
    table = _table(transfer, chunk.data_ptr()).table
    expected: list[int] = []
    for layer in range(group.layer_count):
        for plane in group.planes:
            tensor = plane.caches[layer]
            stride = tensor.stride(0) * tensor.element_size()
            expected += [tensor.data_ptr(), tensor.shape[0] * plane.block_size, stride, plane.block_size,
                         plane.row_bytes]
    for index, plane in enumerate(group.planes):
        region = chunk_offset + regions.plane_offsets[index]
        addresses = [plane.caches[layer].data_ptr() for layer in range(group.layer_count)]
        strides = [plane.caches[layer].stride(0) * plane.caches[layer].element_size() for layer in range(3)]
        width = _widest(plane.row_bytes, *addresses, *strides, chunk.data_ptr(), region, regions.layer_stride)
        expected += [region, width, plane.row_bytes]  # packed layout: the row pitch is the row bytes
    assert table.dtype == torch.int64 and table.tolist() == expected  # every element, no padding
    assert tt.plane_widths(transfer) == tuple(expected[-8::3])


def test_table_is_uploaded_once_per_chunk_shape_and_rebuilt_when_the_key_changes():
    group = _group()
    slots = _slots()
    regions = group.chunk_regions([s.region_rows for s in slots])
    chunk = torch.zeros(regions.total_bytes + 64, dtype=torch.uint8)
    first = _table(resolve_transfer(group, slots, chunk, store=True), chunk.data_ptr())
    again = _table(resolve_transfer(group, slots, chunk, store=False), chunk.data_ptr())
    assert again.table is first.table  # per call: a lookup, no new tensor, no upload
    shifted = _table(resolve_transfer(group, slots, chunk, store=True, chunk_offset=32), chunk.data_ptr())
    assert shifted.table is not first.table
    assert shifted.table.tolist()[-9::3] == [32 + offset for offset in regions.plane_offsets]
    other_shape = _slots((5, 6, 3))
    reshaped = _table(resolve_transfer(group, other_shape, chunk, store=True), chunk.data_ptr())
    assert reshaped.table is not first.table
    # The count of a call is not part of the table: a shorter last chunk reuses the full-chunk table.
    partial = tuple(PlaneSlots(s.slots, 0, s.count - 1, region_rows=s.region_rows) for s in slots)
    assert _table(resolve_transfer(group, partial, chunk, store=True), chunk.data_ptr()).table is first.table


def _table(transfer, anchor):
    return tt._device_table(transfer.group, transfer.regions, transfer.chunk_offset, anchor)


def test_misaligned_slot_array_is_refused_naming_the_plane_before_any_launch():
    group = _group()
    regions = group.chunk_regions([6, 6, 3])
    chunk = torch.zeros(regions.total_bytes, dtype=torch.uint8)
    backing = bytearray(8 * 6 + 4)
    # An int64 tensor 4 bytes off its element alignment (reachable through frombuffer).
    misaligned = torch.frombuffer(backing, dtype=torch.int64, offset=4, count=6)
    assert misaligned.data_ptr() % 8 == 4
    slots = (PlaneSlots(torch.arange(6)), PlaneSlots(misaligned), PlaneSlots(torch.arange(3)))
    transfer = resolve_transfer(group, slots, chunk, store=True)
    with pytest.raises(TransferError, match=r"slots\[1\] starts at address 0x[0-9a-f]+, not a multiple of 8"):
        tt.triton_transfer(transfer)  # raises on the host: nothing is launched (CPU, no interpreter)


def test_fixed_out_of_range_slot_cases_on_the_reference():
    assert out_of_range_slot_cases("torch") == 8
