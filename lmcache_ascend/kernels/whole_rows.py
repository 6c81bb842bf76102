"""Whole token rows: the multi-chunk launch for chunks whose token rows hold every plane side by side.

LMCache's memory objects for plane tuples (DeepSeek-V4's bundle: an fp8 latent, a bf16
rope part, an int8 indexer key and an fp16 scale, 770 bytes a token) put a layer's
planes next to each other in one token row. The row pitch then has no wide divisor, and
the per-plane kernel (`triton_transfer`) moves each plane 2 bytes at a time, one plane
per program: a store writes each row's plane segments from different programs at
different times, so the object's memory sectors are written in pieces. Here one program
moves whole rows: every plane of one block of rows of one layer of one chunk. Its lanes
walk a row's columns, each column's cache address read from a map built once per
program (which plane, where its block starts), so the object side is read or written
contiguously and each sector is written whole by one program.

Used on CUDA (and by the interpreter on the CPU, where the tests run it) where
`whole_rows_layout` accepts a launch. An NPU keeps the per-plane kernel, whose rows are the
contiguous DMA transfers triton-ascend lowers well: a column map is a gather, which it would
move element by element (so tests/ascend does not judge this kernel).

On one H100 (torch 2.11, Triton 3.6) this kernel moved the DeepSeek-V4-like bundle's block call
at 16384 tokens in 300 us against the per-plane kernel's 476-481 us and a same-byte copy's 272
(torch profiler); docs/design-decisions.md has the op's table and the shapes tried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from lmcache_ascend.kernels.spec import widest_element_width

if TYPE_CHECKING:
    from lmcache_ascend.kernels.resolve import ResolvedChunkBatch

__all__ = ["WholeRows", "element_view", "whole_rows_layout", "whole_rows_tables"]

# Columns a program holds per step: rows of up to this many elements go 1024 / columns rows a step
# (H100, the bundle's 385-element rows padded to 512: 2 rows a step with 4 warps was fastest of
# 1-16 rows and 1-16 warps).
_STEP_ELEMENTS = 1024
# Wider rows take the per-plane kernel (a step would hold more than a program's registers keep).
_MAX_COLUMNS = 2048
NUM_WARPS = 4
_ELEMENT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class WholeRows:
    """The shape of a whole-row launch: its constexprs and the grid's blocks per chunk."""

    planes: int
    block_size: int
    element: int  # bytes moved per element: the widest width dividing every offset, size and address
    row: int  # elements of a token row (its pitch)
    columns: int  # a power of two >= row
    rows_per_step: int
    blocks: int  # the most blocks any chunk moves: grid dim 0
    layers: int  # grid dim 1

    def constexprs(self, store: bool) -> tuple[tuple[str, object], ...]:
        return (("STORE", store), ("PLANES", self.planes), ("BLOCK_SIZE", self.block_size),
                ("ELEMENT", self.element), ("ROW", self.row), ("COLUMNS", self.columns),
                ("ROWS_PER_STEP", self.rows_per_step))


def whole_rows_layout(batches: "list[ResolvedChunkBatch]", alignment: int,
                      plane_gcds: Sequence[int]) -> WholeRows | None:
    """The whole-row shape of a launch of `batches` whose chunk addresses have gcd `alignment` with
    the anchor (`plane_gcds`: per plane, the gcd of its row bytes, cache addresses and block strides),
    or None where the per-plane kernel moves them (not one group of token rows moved in
    whole blocks; rows the per-plane kernel moves 16 bytes wide anyway; chunks in mapped host memory;
    a device other than CUDA, or the CPU under the interpreter)."""
    if len(batches) != 1:
        return None
    batch = batches[0]
    group, rows, regions = batch.group, batch.rows, batch.rows.regions
    if group.device.type not in ("cuda", "cpu") or batch.buffers.mapped_host or batch.rows_per_id <= 1:
        return None
    block_size = batch.rows_per_id
    pitch = regions.row_pitch[0]
    if any(plane.block_size != block_size for plane in group.planes) or any(p != pitch for p in regions.row_pitch):
        return None
    starts = [offset - min(regions.plane_offsets) for offset in regions.plane_offsets]
    spans = sorted(zip(starts, regions.row_bytes))
    if spans[-1][0] + spans[-1][1] > pitch or any(a + w > b for (a, w), (b, _) in zip(spans, spans[1:])):
        return None  # planes that overlap, or leave the row: not side by side in it
    counts, first_rows = rows.counts, rows.starts
    if ((counts != counts[:, :1]).any() or (first_rows != first_rows[:, :1]).any()
            or (counts % block_size).any() or (first_rows % block_size).any()):
        return None  # planes that move different rows, or parts of blocks
    quantities = (pitch, alignment, batch.chunk_offset + min(regions.plane_offsets), regions.layer_stride,
                  *starts, *plane_gcds)
    if widest_element_width(*quantities) == 16:
        return None  # the per-plane kernel moves these 16 bytes at a time already
    element = widest_element_width(*quantities, widths=(8, 4, 2, 1))
    columns = triton.next_power_of_2(pitch // element)
    if columns > _MAX_COLUMNS:
        return None
    return WholeRows(planes=group.plane_count, block_size=block_size, element=element, row=pitch // element,
                     columns=columns, rows_per_step=math.gcd(block_size, max(1, _STEP_ELEMENTS // columns)),
                     blocks=int(counts[:, 0].max()) // block_size, layers=group.layer_count)


def whole_rows_tables(batch: "ResolvedChunkBatch", shape: WholeRows) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's tables: per (layer, plane) the cache's address, blocks, block stride, the plane's
    start in a row and its width (the last three in elements), and per layer the rows' first byte
    from a chunk's start."""
    group, regions = batch.group, batch.regions
    first = min(regions.plane_offsets)
    element = shape.element
    table = []
    for layer in range(group.layer_count):
        for plane_index, plane in enumerate(group.planes):
            geometry = group.geometry[layer][plane_index]
            table.append((geometry.address, geometry.num_blocks, geometry.block_stride_bytes // element,
                          (regions.plane_offsets[plane_index] - first) // element, plane.row_bytes // element))
    origins = [batch.chunk_offset + first + layer * regions.layer_stride for layer in range(group.layer_count)]
    return np.asarray(table, dtype=np.int64), np.asarray(origins, dtype=np.int64)


def element_view(anchor: torch.Tensor, element: int) -> torch.Tensor:
    """`anchor`'s first bytes as elements of `element` bytes (the kernel's data pointer: same address)."""
    flat = anchor.view(torch.uint8).view(-1)
    return flat[: flat.numel() - flat.numel() % element].view(_ELEMENT_DTYPES[element])


@triton.jit(do_not_specialize=("data_anchor_address", "columns"))
def whole_rows_kernel(
    data_anchor,  # elements of ELEMENT bytes: every data address is relative to it
    data_anchor_address,
    slot_anchor,  # int64*: the call's block ids
    table,  # int64 [layers * planes, 5]: see `whole_rows_tables`
    layer_origins,  # int64 [layers]: bytes from a chunk's start to its layer's first row
    address_table,  # int64 [chunks]: each chunk's distance from the data anchor, bytes
    rows_table,  # int64 [chunks, 2 x columns]: the chunks' row counts, then first rows (plane 0's)
    columns,
    STORE: tl.constexpr,
    PLANES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ELEMENT: tl.constexpr,
    ROW: tl.constexpr,
    COLUMNS: tl.constexpr,
    ROWS_PER_STEP: tl.constexpr,
):
    block = tl.program_id(0)
    layer = tl.program_id(1)
    chunk = tl.program_id(2).to(tl.int64)
    rows_entry = rows_table + chunk * (2 * columns)
    count = tl.load(rows_entry)
    if block * BLOCK_SIZE < count:  # chunks shorter than the longest move fewer blocks
        block_id = tl.load(slot_anchor + tl.load(rows_entry + columns) // BLOCK_SIZE + block)
        origin = (tl.load(address_table + chunk) + tl.load(layer_origins + layer)) // ELEMENT + block * (BLOCK_SIZE * ROW)
        column = tl.arange(0, COLUMNS)
        # Per column: the element its block's row 0 holds in the cache, and the distance between its
        # rows there (the plane's width). A column no plane covers (a gap between planes), or one of a
        # plane whose cache has no such block, or every column where the id is negative, points at the
        # chunk's own bytes instead: they are read and written back unchanged, as the per-plane kernel
        # leaves them (nothing else writes a chunk while a call moves it). A mask that singled those
        # columns out cost a quarter to a half more kernel time than this on an H100.
        cache_base = origin + column
        cache_pitch = tl.zeros([COLUMNS], dtype=tl.int32) + ROW
        for plane in tl.static_range(PLANES):
            entry = table + (layer * PLANES + plane).to(tl.int64) * 5
            cache = (tl.load(entry) - data_anchor_address) // ELEMENT
            blocks = tl.load(entry + 1)
            block_stride = tl.load(entry + 2)
            start = tl.load(entry + 3).to(tl.int32)
            width = tl.load(entry + 4).to(tl.int32)
            moved = (column >= start) & (column < start + width) & (block_id >= 0) & (block_id < blocks)
            cache_base = tl.where(moved, cache + block_id * block_stride + (column - start), cache_base)
            cache_pitch = tl.where(moved, width, cache_pitch)
        mask = (column < ROW)[None, :]
        # Two steps' loads are in flight before a step's store: the compiler may not move a load above
        # a store to the same memory, so each step would otherwise wait out its load (the bundle's
        # block call at 16384 tokens on an H100: 0.87 of a same-byte copy this way, 0.70 one step at a time).
        STEPS: tl.constexpr = BLOCK_SIZE // ROWS_PER_STEP
        source, target = _step(cache_base, cache_pitch, origin, column, 0, STORE, ROW, ROWS_PER_STEP)
        values = tl.load(data_anchor + source, mask=mask)
        if STEPS > 1:
            next_source, next_target = _step(cache_base, cache_pitch, origin, column, ROWS_PER_STEP, STORE, ROW,
                                             ROWS_PER_STEP)
            next_values = tl.load(data_anchor + next_source, mask=mask)
            for step in tl.static_range(2, STEPS):
                later_source, later_target = _step(cache_base, cache_pitch, origin, column, step * ROWS_PER_STEP,
                                                   STORE, ROW, ROWS_PER_STEP)
                later_values = tl.load(data_anchor + later_source, mask=mask)
                tl.store(data_anchor + target, values, mask=mask)
                values, target = next_values, next_target
                next_values, next_target = later_values, later_target
            tl.store(data_anchor + target, values, mask=mask)
            values, target = next_values, next_target
        tl.store(data_anchor + target, values, mask=mask)


@triton.jit
def _step(cache_base, cache_pitch, origin, column, first_row, STORE: tl.constexpr, ROW: tl.constexpr,
          ROWS_PER_STEP: tl.constexpr):
    """(source, target) element offsets of rows [first_row, first_row + ROWS_PER_STEP) of a block."""
    row = first_row + tl.arange(0, ROWS_PER_STEP)
    cache_at = cache_base[None, :] + (row[:, None] * cache_pitch[None, :]).to(tl.int64)
    chunk_at = origin + (row[:, None] * ROW + column[None, :])
    if STORE:
        return cache_at, chunk_at
    return chunk_at, cache_at

