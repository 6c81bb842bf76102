"""The torch path of a multi-chunk transfer (a CPU worker's, and any device's without Triton).

The reference (`reference_transfer_chunks`) is the contract written out: per chunk it
works out which rows have a slot (holes are skipped row by row), then per layer and plane
the views and one indexed copy. A request of 16 chunks over two groups of four planes
pays that bookkeeping 16 times; on a CPU worker it was most of a store's time.

Here the bookkeeping is done once per batch: per plane every chunk's slots in one
tensor, checked once for holes; per layer and plane the cache's row view and the element
width. What is left per chunk is its region's view and one ``index_select`` into it (a
store) or ``index_copy_`` out of it (a load): one pass over the bytes, no temporary.
Slots are first mapped to rows of a view that spans the cache's blocks, so a cache whose
blocks lie further apart than their size (views into a shared page) takes the same path.

A batch with a hole (a slot below 0 or past a layer's cache) goes to the reference, as
does a cache whose block stride is not a whole number of rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lmcache_ascend.kernels.reference import INTEGER_OF_WIDTH, VIEW_WIDTHS, reference_transfer_chunks, slots_at
from lmcache_ascend.kernels.resolve import ResolvedChunkBatch
from lmcache_ascend.kernels.spec import widest_element_width

__all__ = ["torch_transfer_chunks"]


def torch_transfer_chunks(batch: ResolvedChunkBatch) -> None:
    """Move a validated batch (`resolve_chunk_batch`): hole-free batches here, others by the reference."""
    on_device = not batch.buffers.mapped_host and batch.group.on_group_device(batch.buffers.keep_alive[0])
    slots = _plane_slots(batch) if on_device else None  # (the slots are gathered only where they are used)
    if slots is None:
        reference_transfer_chunks(batch)
        return
    chunks = [batch.buffers.chunk(index) for index in range(batch.num_chunks)]
    bases = [chunk.storage_offset() + batch.chunk_offset for chunk in chunks]
    base_gcd = math.gcd(*bases)
    counts = batch.rows.counts
    for plane_index, (plane_slots, firsts) in enumerate(slots):
        if plane_slots is None:
            continue
        for layer in range(batch.group.layer_count):
            _move_layer_plane(batch, chunks, bases, base_gcd, layer, plane_index, plane_slots, firsts,
                              counts[:, plane_index])


def _plane_slots(batch: ResolvedChunkBatch) -> list[tuple[torch.Tensor | None, np.ndarray]] | None:
    """Per plane: the slots of every chunk's rows, chunk after chunk, and where each chunk's start in
    that tensor; None for the whole batch where a row has no slot in some layer's cache (a hole), or a
    cache's block stride is not a whole number of rows."""
    counts = batch.rows.counts
    device = batch.slots.device
    found = []
    for plane_index, plane in enumerate(batch.group.planes):
        plane_counts = counts[:, plane_index]
        firsts = np.concatenate(([0], np.cumsum(plane_counts)))
        if not firsts[-1]:
            found.append((None, firsts))
            continue
        if any(g[plane_index].block_stride_bytes % plane.row_bytes for g in batch.group.geometry):
            return None
        positions = np.repeat(batch.rows.starts[:, plane_index] - firsts[:-1], plane_counts) + np.arange(firsts[-1])
        positions = torch.from_numpy(positions).to(device)
        values = slots_at(batch.slots, positions, batch.rows_per_id)
        fewest_rows = min(g[plane_index].num_blocks for g in batch.group.geometry) * plane.block_size
        if not bool(((values >= 0) & (values < fewest_rows)).all()):
            return None
        found.append((values, firsts))
    return found


def _move_layer_plane(batch: ResolvedChunkBatch, chunks: list[torch.Tensor], bases: list[int], base_gcd: int,
                      layer: int, plane_index: int, slots: torch.Tensor, firsts: np.ndarray,
                      counts: np.ndarray) -> None:
    """One layer's rows of one plane, chunk by chunk, between its cache and the chunks' regions."""
    group, regions = batch.group, batch.regions
    plane = group.planes[plane_index]
    geometry = group.geometry[layer][plane_index]
    row_bytes, block_size = plane.row_bytes, plane.block_size
    pitch = regions.row_pitch[plane_index]
    offset = regions.region_offset(layer, plane_index)
    width = widest_element_width(row_bytes, pitch, base_gcd, offset, geometry.storage_offset_bytes,
                                 geometry.block_stride_bytes, widths=VIEW_WIDTHS)
    dtype = INTEGER_OF_WIDTH[width]
    rows_apart = geometry.block_stride_bytes // row_bytes  # rows from one block's start to the next's
    if rows_apart != block_size:
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        slots = blocks * rows_apart + (slots - blocks * block_size)
    cache = plane.caches[layer]
    rows = torch.empty(0, dtype=dtype, device=cache.device).set_(
        cache.untyped_storage(), geometry.storage_offset_bytes // width,
        ((geometry.num_blocks - 1) * rows_apart + block_size, row_bytes // width), (row_bytes // width, 1))
    dense = pitch == row_bytes  # index_select(out=) needs the region's rows back to back
    for index, chunk in enumerate(chunks):
        count = int(counts[index])
        if not count:
            continue
        region = torch.empty(0, dtype=dtype, device=chunk.device).set_(
            chunk.untyped_storage(), (bases[index] + offset) // width, (count, row_bytes // width), (pitch // width, 1))
        chunk_slots = slots[firsts[index] : firsts[index] + count]
        if not batch.store:
            rows.index_copy_(0, chunk_slots, region)
        elif dense:
            torch.index_select(rows, 0, chunk_slots, out=region)
        else:
            region.copy_(rows.index_select(0, chunk_slots))
