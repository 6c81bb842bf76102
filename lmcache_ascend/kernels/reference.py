"""Torch reference of the paged <-> chunk transfer: any device, byte exact.

It is the contract's executable definition (the Triton kernel is tested against
it) and the CPU path. It works on integer views of the tensors' own bytes (the
widest of int64/int32/int16/uint8 that divides every size and offset involved),
so every dtype (int8, fp8, bf16, ...) and every view into a shared blob is
handled alike and moved bit for bit.
"""

from __future__ import annotations

import torch

from lmcache_ascend.kernels.resolve import (
    PlaneSlots,
    ResolvedChunkBatch,
    ResolvedTransfer,
)
from lmcache_ascend.kernels.spec import (
    TransferError,
    widest_element_width,
)

__all__ = ["INTEGER_OF_WIDTH", "VIEW_WIDTHS", "reference_transfer", "reference_transfer_chunks", "slots_at"]

INTEGER_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# The integer views torch has: 16-byte moves do not exist here.
VIEW_WIDTHS = tuple(INTEGER_OF_WIDTH)


def _view(storage: torch.UntypedStorage, device: torch.device, width: int, offset_bytes: int,
          shape: tuple[int, ...], stride_bytes: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `width`-byte integers over `storage` (offsets and strides given in bytes)."""
    view = torch.empty(0, dtype=INTEGER_OF_WIDTH[width], device=device)
    return view.set_(storage, offset_bytes // width, shape, tuple(stride // width for stride in stride_bytes))


def reference_transfer(transfer: ResolvedTransfer) -> None:
    """Run one validated transfer (see `lmcache_ascend.kernels` for the contract)."""
    group = transfer.group
    regions = transfer.regions
    chunk = transfer.chunk_bytes
    chunk_storage = chunk.untyped_storage()
    chunk_base = chunk.storage_offset() + transfer.chunk_offset
    for plane_index, (plane, plane_slots) in enumerate(zip(group.planes, transfer.slots)):
        count = plane_slots.count
        if count == 0:
            continue
        slots = _plane_slot_values(plane_slots)
        row_bytes = plane.row_bytes
        block_size = plane.block_size
        # Which rows move depends only on the cache's row count: worked out once
        # per distinct count (layers of a plane almost always share it).
        selections: dict[int, tuple[torch.Tensor, ...]] = {}
        for layer in range(group.layer_count):
            geometry = group.geometry[layer][plane_index]
            cache_rows = geometry.num_blocks * block_size
            selection = selections.get(cache_rows)
            if selection is None:
                valid = (slots >= 0) & (slots < cache_rows)
                rows = torch.nonzero(valid).flatten()
                valid_slots = slots[rows]
                blocks = torch.div(valid_slots, block_size, rounding_mode="floor")
                selection = (rows, valid_slots, blocks, valid_slots - blocks * block_size)
                selections[cache_rows] = selection
            rows, valid_slots, blocks, in_block = selection
            every_row = rows.numel() == count
            if rows.numel() == 0:
                continue
            region_start = chunk_base + regions.region_offset(layer, plane_index)
            pitch = regions.row_pitch[plane_index]
            width = widest_element_width(row_bytes, geometry.storage_offset_bytes, geometry.block_stride_bytes,
                                         region_start, pitch, widths=VIEW_WIDTHS)
            cache = plane.caches[layer]
            region = _view(chunk_storage, chunk.device, width, region_start, (count, row_bytes // width),
                           (pitch, width))
            every_row = every_row and pitch == row_bytes  # index_select(out=) needs a dense region
            if geometry.block_stride_bytes == block_size * row_bytes:
                # Blocks back to back: the cache is one run of rows, index it directly.
                paged_rows = _view(cache.untyped_storage(), cache.device, width, geometry.storage_offset_bytes,
                                   (geometry.num_blocks * block_size, row_bytes // width), (row_bytes, width))
                if transfer.store and every_row:  # no holes: index straight into the region
                    torch.index_select(paged_rows, 0, valid_slots, out=region)
                elif transfer.store:
                    region.index_copy_(0, rows, paged_rows.index_select(0, valid_slots))
                else:
                    paged_rows.index_copy_(0, valid_slots, region if every_row else region.index_select(0, rows))
                continue
            paged = _view(cache.untyped_storage(), cache.device, width, geometry.storage_offset_bytes,
                          (geometry.num_blocks, block_size, row_bytes // width),
                          (geometry.block_stride_bytes, row_bytes, width))
            if transfer.store:
                region.index_copy_(0, rows, paged[blocks, in_block])
            else:
                paged.index_put_((blocks, in_block), region.index_select(0, rows))


def slots_at(slots: torch.Tensor, positions: torch.Tensor, rows_per_id: int) -> torch.Tensor:
    """The cache slot of each row position: `slots` read there, or, where `slots` holds block ids
    (`rows_per_id` > 1), each id expanded to its rows (-1 stays a hole; see `PlaneSlots`)."""
    if rows_per_id == 1:
        return slots[positions]
    ids = slots[torch.div(positions, rows_per_id, rounding_mode="floor")]
    return torch.where(ids >= 0, ids * rows_per_id + positions % rows_per_id, -1)


def _plane_slot_values(plane_slots: PlaneSlots) -> torch.Tensor:
    """The slots of the plane's `count` rows from `start`."""
    start, count = plane_slots.start, plane_slots.count
    if plane_slots.rows_per_id == 1:
        return plane_slots.slots[start : start + count]
    rows = torch.arange(start, start + count, dtype=torch.int64, device=plane_slots.slots.device)
    return slots_at(plane_slots.slots, rows, plane_slots.rows_per_id)


def reference_transfer_chunks(batch: ResolvedChunkBatch) -> None:
    """Run a validated multi-chunk transfer chunk by chunk (the reference's definition of it)."""
    rows = batch.rows
    for index in range(batch.num_chunks):
        chunk = batch.buffers.chunk(index)
        if not batch.group.on_group_device(chunk):
            raise TransferError(
                f"chunks[{index}] is on {chunk.device}: the torch reference moves chunks on the caches' device "
                f"({batch.group.device}) only"
            )
        slots = tuple(
            PlaneSlots(batch.slots, int(start), int(count), region_rows=region_rows, rows_per_id=batch.rows_per_id)
            for start, count, region_rows in zip(rows.starts[index], rows.counts[index], rows.regions.region_rows)
        )
        reference_transfer(
            ResolvedTransfer(batch.group, slots, chunk, batch.chunk_offset, rows.regions, batch.store)
        )
