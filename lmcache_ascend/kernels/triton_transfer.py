"""Triton implementation of the paged <-> chunk transfer: one launch per group, or per call for many chunks.

One source for CUDA and Ascend (triton-ascend): only portable `tl` ops
(loads/stores with masks, integer arithmetic); no inline assembly, no
int-to-pointer casts, no pointer casts between element widths (triton-ascend
cannot lower them). Every address is reached as a byte offset from one of two
anchor tensors passed to the kernel (the chunk buffer, as bytes, for data; the
first plane's slot array for slots), so caches living in other allocations are
addressed by their (signed, 64-bit) distance.

One chunk, one group (`triton_transfer`): grid (programs, layers x planes).
Program (i, l*P + p) moves rows [i*T, (i+1)*T) of plane p's region of layer l,
T = TILE for a plane moved 16 bytes at a time, fewer for narrower ones
(`rows_per_program`). Many chunks, every group of a call (`triton_transfer_chunk_batches`,
in one launch): grid (work items, chunks), each work item one program's T
rows of one (group, layer, plane) region. A program reads its rows' slots, then
moves each row as contiguous byte ranges on both sides (on Ascend: row-sized
DMA transfers between global memory and the unified buffer). Each plane moves
with the widest width (16/4/2/1 bytes) dividing its row bytes, block strides,
cache addresses, chunk region offsets and the data anchor, which the compiler
is told, so on CUDA 16 bytes are one 128-bit access. Slot and row arithmetic is
int32 where the host guarantees it fits (cache rows below 2**31).

Host cost per call is kept to a dictionary lookup, a few integer operations per
plane and a direct launch of the cached compiled kernel: every table is built
and uploaded once (see `_device_table`, `_chunks_launch`), per-call values are
scalar arguments (or, for many chunks, their addresses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.kernels.launcher import Relaunch, integer_type, relaunch_of
from lmcache_ascend.kernels.launcher import launch as _launch  # the seam every launch goes through
from lmcache_ascend.kernels.paged import (
    PagedGroup,
)
from lmcache_ascend.kernels.resolve import (
    ResolvedChunkBatch,
    ResolvedTransfer,
)
from lmcache_ascend.kernels.upload import stream_table, to_device
from lmcache_ascend.kernels.whole_rows import (
    NUM_WARPS as WHOLE_ROWS_WARPS,
    WholeRows,
    element_view,
    whole_rows_kernel,
    whole_rows_layout,
    whole_rows_tables,
)
from lmcache_ascend.kernels.spec import (
    MAX_PLANES,
    ChunkRegions,
    TransferError,
    triton_interpreting,
    widest_element_width,
)

__all__ = [
    "prepare_chunks_relaunch",
    "prepare_relaunch",
    "supports_device",
    "triton_transfer",
    "triton_transfer_chunk_batches",
]

# A program moves one tile: TILE rows of one (layer, plane) region, each row as SEGMENTS
# contiguous column steps of SEGMENT bytes (the last one masked at the row's end). SEGMENTS is
# fixed per launch by its widest row (`launch_segments`), so every loop is unrolled at compile
# time (no loop bound is a run-time value). A tile step is TILE x SEGMENT bytes (8 KiB by
# default): on Ascend the unified-buffer working set of one step (192 KiB UB per vector core
# on A2), moved as one DMA transfer per row of SEGMENT bytes (a multiple of the 32-byte UB
# alignment); on CUDA 64 bytes per thread of 4 warps (54 registers on sm_90, Triton 3.9). On one
# H100 (torch 2.11, Triton 3.6; scripts/bench_transfer.py, the 16K-token request, kernel us store /
# load) this shape runs DeepSeek-V4-like 281 / 284 and MLA 854 / 867, where a same-byte copy kernel
# runs 246 / 245 and 760 / 759. Measured before the narrow-width branches took fewer rows (the
# kernel then had 255 registers and spilled), segments covering whole rows (4/2048/4: 553 / 552 and
# 1038 / 1050) and one block per program without column steps (16/128/4 at best: 368 / 368 and
# 1089 / 1124) were slower than this shape (351 / 359 and 995 / 989).
ROWS_PER_TILE = 64
ROW_SEGMENT_BYTES = 128
NUM_WARPS = 4


@dataclass(frozen=True)
class LaunchShape:
    """How a launch splits its regions: rows per program (a power of two), bytes of a row per step
    (a power of two), warps."""

    tile: int
    segment: int
    num_warps: int


DEFAULT_LAUNCH_SHAPE = LaunchShape(ROWS_PER_TILE, ROW_SEGMENT_BYTES, NUM_WARPS)
# On CUDA a launch takes 16 rows by 256 bytes a step: each row's bytes in half the steps, and
# four times the programs, so more of a row's loads are in flight at once (a step's load
# waits before its store). One H100, kernel time against DEFAULT_LAUNCH_SHAPE: block calls of
# K/V rows (2048 bytes) 0.89 -> 0.96 of a same-byte copy, MLA rows (1152) 0.89 -> 0.92, the
# connector's requests 0.86-0.89 -> 0.87-0.92 of the copy kernel (docs/design-decisions.md,
# "Launch shape on CUDA"). Elsewhere (an NPU, the interpreter) the default stays: untimed there.
CUDA_LAUNCH_SHAPE = LaunchShape(16, 256, 4)
# A multi-chunk launch picks its shape by the most bytes one region of any of its groups
# moves: (up to this many region bytes, shape), the first that fits; larger regions take the
# device's `default_launch_shape`. Where every region is small (a few KiB: DSv4's indexer
# scales and compressed groups), smaller tiles spread them over more programs instead of
# leaving most rows of a 64-row tile masked.
CHUNK_LAUNCH_SHAPES: tuple[tuple[int, LaunchShape], ...] = ((8192, LaunchShape(16, ROW_SEGMENT_BYTES, 4)),)


def default_launch_shape(device: torch.device) -> LaunchShape:
    """The shape of a launch on `device` (one chunk, or many whose regions are not small)."""
    return CUDA_LAUNCH_SHAPE if device.type == "cuda" else DEFAULT_LAUNCH_SHAPE


def chunk_launch_shape(max_region_bytes: int, device: torch.device) -> LaunchShape:
    """The launch shape of a multi-chunk launch on `device` whose largest region (of any group)
    moves `max_region_bytes`."""
    for limit, shape in CHUNK_LAUNCH_SHAPES:
        if max_region_bytes <= limit:
            return shape
    return default_launch_shape(device)


def rows_per_program(tile: int, width: int) -> int:
    """Rows one program moves of a plane moved `width` bytes at a time: `tile` at 16 bytes, else
    tile x width / 16 rounded up to a multiple of 4 (triton-ascend's linalg lowering fails on a
    1-row tile)."""
    return tile if width == 16 else -(-tile * width // 64) * 4


def launch_segments(max_row_bytes: int, segment: int) -> int:
    """Column steps of `segment` bytes a launch unrolls to cover its widest row (`max_row_bytes`)."""
    return max(-(-max_row_bytes // segment), 1)

# The kernel reads one int64 device table, built and uploaded ONCE per (group,
# chunk shape, chunk offset, chunk-buffer alignment) and cached on the group:
#   [layers * planes] rows of 5: cache address, rows in the cache
#     (num_blocks * block_size), block stride (bytes), block size, row bytes;
#   then [planes] rows of 3: region offset (bytes from the chunk buffer's start,
#     layer 0), element width (bytes), row pitch (bytes from one chunk row to the
#     next: the row bytes for packed regions, more for interleaved ones).
# What changes per call (each plane's slot offset and count) travels as scalar
# kernel arguments, so a call uploads nothing.
_GEOMETRY_FIELDS = 5
_REGION_FIELDS = 3
# Cached tables per group (chunk shapes are few in practice; bounded anyway: docs/hot-path.md).
_MAX_CACHED_TABLES = 64


def supports_device(device: torch.device) -> bool:
    """Whether this kernel can run on `device` in this process."""
    if device.type == "cpu":
        return triton_interpreting()
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "npu":
        # triton-ascend registers an "npu" driver; plain Triton has none.
        try:
            return triton.runtime.driver.active.get_current_target().backend == "npu"
        except Exception:  # noqa: BLE001 - any failure means "not usable here"
            return False
    return False


@triton.jit
def _move_rows(
    data_anchor,  # uint8*: every data address is a byte offset from it
    slot_ptr,  # int64*: the slot (or block id) array
    row_base,  # the region's row 0 is row `row_base` of that array's rows
    first_row,  # first row of the region this program moves (TILE rows from it, cut at count)
    count,
    cache_delta,  # cache address minus the data anchor's, bytes
    cache_rows,
    block_size,
    block_stride,
    row_bytes,
    region_offset,  # the region's start, bytes from the data anchor
    row_pitch,  # bytes from one chunk row of the region to the next
    STORE: tl.constexpr,
    ROWS_PER_ID: tl.constexpr,  # > 1: the array holds block ids of this many slots each, not slots
    WIDTH: tl.constexpr,  # bytes dividing every offset and size below (16/4/2/1)
    TILE: tl.constexpr,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
):
    # A tile is TILE rows by SEGMENT contiguous bytes of each, per step: one slot per row, then
    # the row's bytes as one contiguous range on both sides. On Ascend the rows become a loop
    # of row-sized DMA transfers (global <-> UB); on CUDA each thread moves WIDTH-byte accesses
    # (the hints below say every offset is a multiple of WIDTH, so 16 bytes are 128-bit).
    # Bytes stay bytes: no pointer changes element type (triton-ascend cannot lower that).
    if first_row < count:  # programs past the region (a plane shorter than the grid) move nothing
        lane = tl.arange(0, SEGMENT)
        bound = (row_bytes // WIDTH) * WIDTH  # == row_bytes; written so the compiler sees the divisor
        tile_rows = first_row + tl.arange(0, TILE)
        in_region = tile_rows < count
        block_size32 = block_size.to(tl.int32)
        if ROWS_PER_ID > 1:
            # Row r's slot is ids[r // n] * n + r % n: whole blocks, expanded here rather than by
            # a pass of their own over a slot array. n is a compile-time constant (a block size:
            # a power of two in practice, so a shift and a mask); rows of a call stay below 2**31.
            rows = (row_base + tile_rows).to(tl.int32)
            id_index = rows // ROWS_PER_ID
            ids = tl.load(slot_ptr + id_index, mask=in_region, other=-1)
            in_id = rows - id_index * ROWS_PER_ID
            slots = tl.where(ids >= 0, ids * ROWS_PER_ID + in_id, -1)
            valid = in_region & (slots >= 0) & (slots < cache_rows)
            if block_size32 == ROWS_PER_ID:
                # The ids name the cache's own blocks (LMCache's block op): no division by the
                # block size, which per row is most of a narrow plane's work (DSv4-like bundle
                # objects: 2-byte rows; H100: 3-10% off the slot form's kernel time).
                blocks = tl.where(valid, ids, 0).to(tl.int32)
                in_block = in_id
            else:
                slot32 = tl.where(valid, slots, 0).to(tl.int32)
                blocks = slot32 // block_size32
                in_block = slot32 - blocks * block_size32
        else:
            slots = tl.load(slot_ptr + row_base + tile_rows, mask=in_region, other=-1)
            valid = in_region & (slots >= 0) & (slots < cache_rows)
            # Valid slots are < cache_rows < 2**31 (checked on the host): int32 from here.
            slot32 = tl.where(valid, slots, 0).to(tl.int32)
            blocks = slot32 // block_size32
            in_block = slot32 - blocks * block_size32
        cache_offsets = tl.multiple_of(
            cache_delta + blocks.to(tl.int64) * block_stride + in_block.to(tl.int64) * row_bytes, WIDTH)
        chunk_offsets = tl.multiple_of(region_offset + tile_rows.to(tl.int64) * row_pitch, WIDTH)
        if not STORE:
            # Loading, a row whose slot is not valid is written back onto its own chunk bytes,
            # unchanged, so the store into the cache rows is masked by ranges only (a per-row mask
            # there makes triton-ascend scatter element by element). Safe: those are the bytes this
            # program has just read, and nothing writes a chunk buffer while a load reads it (a
            # retrieve only reads its memory objects; staging copies are stream-ordered before the
            # launch), so every reader sees the same bytes before and after.
            cache_offsets = tl.multiple_of(tl.where(valid, cache_offsets, chunk_offsets), WIDTH)
        for segment in tl.static_range(SEGMENTS):
            # Steps past this plane's row end (a plane narrower than the launch's widest) are skipped.
            if segment * SEGMENT < bound:
                columns = segment * SEGMENT + lane
                cache_ptrs = data_anchor + (cache_offsets[:, None] + columns[None, :])
                chunk_ptrs = data_anchor + (chunk_offsets[:, None] + columns[None, :])
                if STORE:
                    mask = valid[:, None] & (columns < bound)[None, :]
                    tl.store(chunk_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
                else:
                    mask = in_region[:, None] & (columns < bound)[None, :]
                    tl.store(cache_ptrs, tl.load(chunk_ptrs, mask=mask), mask=mask)


@triton.jit
def _move_plane(data_anchor, slot_ptr, row_base, program, count, cache_delta, cache_rows, block_size, block_stride,
                row_bytes, region_offset, width, row_pitch, STORE: tl.constexpr, ROWS_PER_ID: tl.constexpr,
                TILE: tl.constexpr, SEGMENT: tl.constexpr, SEGMENTS: tl.constexpr):
    """Program `program`'s rows of one (layer, plane) region, told the widest width the table allows.
    The branches differ only in what the compiler may assume; every one moves bytes. A width of W
    bytes moves TILE x W / 16 rows a program (at least 4; `rows_per_program`), so every branch
    holds the same few accesses per thread: the kernel's registers are its widest branch's, and a
    narrow branch with TILE rows would hold 16 / W times as many (on CUDA: fewer programs resident).
    The caller loads every scalar before its first branch, so a program waits for one round of
    table loads."""
    if width == 16:
        _move_rows(data_anchor, slot_ptr, row_base, program.to(tl.int64) * TILE, count, cache_delta,
                   cache_rows, block_size, block_stride, row_bytes, region_offset, row_pitch, STORE, ROWS_PER_ID, 16,
                   TILE, SEGMENT, SEGMENTS)
    elif width == 4:
        _move_rows(data_anchor, slot_ptr, row_base, program.to(tl.int64) * ((TILE * 4 + 63) // 64 * 4),
                   count, cache_delta, cache_rows, block_size, block_stride, row_bytes, region_offset, row_pitch,
                   STORE, ROWS_PER_ID, 4, (TILE * 4 + 63) // 64 * 4, SEGMENT, SEGMENTS)
    elif width == 2:
        _move_rows(data_anchor, slot_ptr, row_base, program.to(tl.int64) * ((TILE * 2 + 63) // 64 * 4),
                   count, cache_delta, cache_rows, block_size, block_stride, row_bytes, region_offset, row_pitch,
                   STORE, ROWS_PER_ID, 2, (TILE * 2 + 63) // 64 * 4, SEGMENT, SEGMENTS)
    else:
        _move_rows(data_anchor, slot_ptr, row_base, program.to(tl.int64) * ((TILE + 63) // 64 * 4),
                   count, cache_delta, cache_rows, block_size, block_stride, row_bytes, region_offset, row_pitch,
                   STORE, ROWS_PER_ID, 1, (TILE + 63) // 64 * 4, SEGMENT, SEGMENTS)


# Per-call values (each plane's slot offset and count) are scalar arguments, one
# per possible plane (MAX_PLANES); planes past the group's count get 0 and are
# never read (PLANES is a compile-time constant).
_SLOT_OFFSET_NAMES = tuple(f"slot_offset_{plane}" for plane in range(MAX_PLANES))
_COUNT_NAMES = tuple(f"count_{plane}" for plane in range(MAX_PLANES))
# Integer arguments are not specialized on their values; pointers are (on 16-byte
# alignment, which the 128-bit accesses need), so a compiled binary is reused
# exactly when the direction, tile shape, plane count, the pointers' alignment
# and the integers' widths (i32/i64) match.
_UNSPECIALIZED_INTEGERS = ("data_anchor_address", "layer_stride", *_SLOT_OFFSET_NAMES, *_COUNT_NAMES)


@triton.jit
def _pick(plane, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, PLANES: tl.constexpr):
    """v[plane] as int64; only the first PLANES candidates are compiled in."""
    value = v0.to(tl.int64)
    if PLANES > 1:
        value = tl.where(plane == 1, v1.to(tl.int64), value)
    if PLANES > 2:
        value = tl.where(plane == 2, v2.to(tl.int64), value)
    if PLANES > 3:
        value = tl.where(plane == 3, v3.to(tl.int64), value)
    if PLANES > 4:
        value = tl.where(plane == 4, v4.to(tl.int64), value)
    if PLANES > 5:
        value = tl.where(plane == 5, v5.to(tl.int64), value)
    if PLANES > 6:
        value = tl.where(plane == 6, v6.to(tl.int64), value)
    if PLANES > 7:
        value = tl.where(plane == 7, v7.to(tl.int64), value)
    if PLANES > 8:
        value = tl.where(plane == 8, v8.to(tl.int64), value)
    if PLANES > 9:
        value = tl.where(plane == 9, v9.to(tl.int64), value)
    if PLANES > 10:
        value = tl.where(plane == 10, v10.to(tl.int64), value)
    if PLANES > 11:
        value = tl.where(plane == 11, v11.to(tl.int64), value)
    if PLANES > 12:
        value = tl.where(plane == 12, v12.to(tl.int64), value)
    if PLANES > 13:
        value = tl.where(plane == 13, v13.to(tl.int64), value)
    if PLANES > 14:
        value = tl.where(plane == 14, v14.to(tl.int64), value)
    if PLANES > 15:
        value = tl.where(plane == 15, v15.to(tl.int64), value)
    return value


@triton.jit(do_not_specialize=_UNSPECIALIZED_INTEGERS)
def _paged_chunk_kernel(
    data_anchor,  # uint8*: the chunk buffer; every data address is relative to it
    data_anchor_address,  # its address as an int64
    slot_anchor,  # int64*: one slot array; every slot array is relative to it
    table,  # int64: [layers * planes, 5] geometry, then [planes, 2] regions
    layer_stride,
    slot_offset_0, slot_offset_1, slot_offset_2, slot_offset_3, slot_offset_4, slot_offset_5, slot_offset_6,
    slot_offset_7, slot_offset_8, slot_offset_9, slot_offset_10, slot_offset_11, slot_offset_12, slot_offset_13,
    slot_offset_14, slot_offset_15,
    count_0, count_1, count_2, count_3, count_4, count_5, count_6, count_7, count_8, count_9, count_10, count_11,
    count_12, count_13, count_14, count_15,
    PLANES: tl.constexpr,
    STORE: tl.constexpr,
    ROWS_PER_ID: tl.constexpr,  # > 1: the slot arrays hold block ids of this many slots each
    TILE: tl.constexpr,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
):
    program = tl.program_id(0)
    layer_plane = tl.program_id(1)
    layer = layer_plane // PLANES
    plane = layer_plane - layer * PLANES
    count = _pick(plane, count_0, count_1, count_2, count_3, count_4, count_5, count_6, count_7, count_8, count_9,
                  count_10, count_11, count_12, count_13, count_14, count_15, PLANES)
    slot_offset = _pick(plane, slot_offset_0, slot_offset_1, slot_offset_2, slot_offset_3, slot_offset_4,
                        slot_offset_5, slot_offset_6, slot_offset_7, slot_offset_8, slot_offset_9, slot_offset_10,
                        slot_offset_11, slot_offset_12, slot_offset_13, slot_offset_14, slot_offset_15, PLANES)
    entry = table + layer_plane.to(tl.int64) * 5
    region_entry = table + tl.num_programs(1).to(tl.int64) * 5 + plane * 3
    # Every table value at once, before the first branch (one round of loads per program).
    cache_address = tl.load(entry + 0)
    cache_rows = tl.load(entry + 1)
    block_stride = tl.load(entry + 2)
    block_size = tl.load(entry + 3)
    row_bytes = tl.load(entry + 4)
    region_start = tl.load(region_entry)
    width = tl.load(region_entry + 1)
    row_pitch = tl.load(region_entry + 2)
    region_offset = region_start + layer.to(tl.int64) * layer_stride
    _move_plane(data_anchor, slot_anchor, slot_offset, program, count,
                cache_address - data_anchor_address, cache_rows, block_size, block_stride, row_bytes, region_offset,
                width, row_pitch, STORE, ROWS_PER_ID, TILE, SEGMENT, SEGMENTS)


# Multi-chunk launch: the layer groups of a call (chunks and slots shared) in ONE launch.
# Grid (work items, chunks). Its tables, built and uploaded once per set of (rows, chunk
# offset) and address alignment (`_chunks_launch`), requests of one length sharing them:
#   table, int64 [table rows, 9]: one row per (group, layer, plane): cache address, rows in
#     the cache, block stride (bytes), block size, row bytes, region offset (bytes from a
#     chunk's start: the group's chunk offset + the plane's offset + layer x layer stride),
#     element width, row pitch, and the plane's column in the rows table;
#   work, int32 [work items, 2]: (table row, program in the row), each row given the programs
#     its largest region needs, so no program idles on a small region beside a large one;
#   rows, int64 [chunks, 2 x columns]: per (group, plane) column its row count, then its first
#     row in the slot tensor (an element of it; with block ids, a row of its expanded rows).
# Per call only the chunk addresses (int64 [chunks]: distances from the data anchor).


@triton.jit(do_not_specialize=("data_anchor_address", "columns"))
def _paged_chunks_kernel(
    data_anchor,  # a device tensor every data address is relative to
    data_anchor_address,
    slot_anchor,  # int64*: the one slot (or block id) tensor of the call
    table,  # int64 [table rows, 9]
    work_table,  # int32 [work items, 2]
    address_table,  # int64 [chunks]
    rows_table,  # int64 [chunks, 2 * columns]
    columns,
    STORE: tl.constexpr,
    ROWS_PER_ID: tl.constexpr,  # > 1: the slot tensor holds block ids of this many slots each
    TILE: tl.constexpr,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
):
    work = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    row = tl.load(work_table + 2 * work).to(tl.int64)
    program = tl.load(work_table + 2 * work + 1)
    entry = table + row * 9
    rows_entry = rows_table + chunk * (2 * columns)
    # Every table value at once, before the first branch: a program waits for its work item,
    # one round of (independent, cached) loads, its row count, then its slots and data.
    cache_address = tl.load(entry + 0)
    cache_rows = tl.load(entry + 1)
    block_stride = tl.load(entry + 2)
    block_size = tl.load(entry + 3)
    row_bytes = tl.load(entry + 4)
    region_offset = tl.load(entry + 5)
    width = tl.load(entry + 6)
    row_pitch = tl.load(entry + 7)
    column = tl.load(entry + 8)
    chunk_address = tl.load(address_table + chunk)
    count = tl.load(rows_entry + column)
    slot_offset = tl.load(rows_entry + columns + column)
    _move_plane(data_anchor, slot_anchor, slot_offset, program, count,
                cache_address - data_anchor_address, cache_rows, block_size, block_stride, row_bytes,
                region_offset + chunk_address, width, row_pitch, STORE, ROWS_PER_ID, TILE, SEGMENT, SEGMENTS)


@dataclass(frozen=True)
class _GroupGeometry:
    """What the kernel needs of a group that never changes: built once per group."""

    rows: tuple[int, ...]  # flat [layers * planes, 5] geometry rows (see the table layout above)
    plane_gcds: tuple[int, ...]  # per plane: gcd of its row bytes, block strides and cache addresses
    row_bytes: tuple[int, ...]
    layer_planes: int  # grid rows: layers x planes


@dataclass(frozen=True)
class _DeviceTable:
    """The uploaded table for one chunk shape / offset / buffer alignment, and the widths in it."""

    table: torch.Tensor
    widths: tuple[int, ...]
    address: int  # table.data_ptr()
    table_aligned: bool  # table address % 16 == 0 (part of the compiled kernel's key)


def _group_geometry(group: PagedGroup) -> _GroupGeometry:
    cached = group.backend_cache.get("triton.geometry")
    if cached is not None:
        return cached
    rows: list[int] = []
    plane_gcds = [plane.row_bytes for plane in group.planes]
    for layer in range(group.layer_count):
        for plane_index, plane in enumerate(group.planes):
            geometry = group.geometry[layer][plane_index]
            rows.extend((geometry.address, geometry.num_blocks * plane.block_size, geometry.block_stride_bytes,
                         plane.block_size, plane.row_bytes))
            plane_gcds[plane_index] = math.gcd(plane_gcds[plane_index], geometry.address, geometry.block_stride_bytes)
    cached = _GroupGeometry(tuple(rows), tuple(plane_gcds), tuple(plane.row_bytes for plane in group.planes),
                            group.layer_count * group.plane_count)
    group.backend_cache["triton.geometry"] = cached
    return cached


def _widths(geometry: _GroupGeometry, regions: ChunkRegions, chunk_offset: int, anchor: int) -> tuple[int, ...]:
    widths = []
    for plane_index, plane_gcd in enumerate(geometry.plane_gcds):
        quantities = [plane_gcd, anchor, chunk_offset + regions.plane_offsets[plane_index],
                      regions.row_pitch[plane_index]]
        if regions.layer_count > 1:
            quantities.append(regions.layer_stride)
        widths.append(widest_element_width(*quantities))
    return tuple(widths)


def _device_table(group: PagedGroup, regions: ChunkRegions, chunk_offset: int, anchor: int) -> _DeviceTable:
    """The kernel's table for this chunk shape: built and uploaded once, then looked up.

    Everything in it is a function of the group (fixed), the layout (offsets, row
    pitches, region rows), the chunk offset and `anchor` modulo 16 (the chunk
    buffer's address, or the gcd of every address a multi-chunk launch reaches),
    which together are the cache key.
    """
    return group.cache("triton.tables", _MAX_CACHED_TABLES).get_or_build(
        (regions, chunk_offset, anchor % 16), lambda: _build_device_table(group, regions, chunk_offset, anchor))


def _build_device_table(group: PagedGroup, regions: ChunkRegions, chunk_offset: int, anchor: int) -> _DeviceTable:
    geometry = _group_geometry(group)
    widths = _widths(geometry, regions, chunk_offset, anchor)
    values = list(geometry.rows)
    for plane_index, width in enumerate(widths):
        values.extend((chunk_offset + regions.plane_offsets[plane_index], width, regions.row_pitch[plane_index]))
    # A blocking copy from a tensor of its own: nothing on the host can change
    # under it, and it happens once per chunk shape, not per call.
    table = torch.tensor(values, dtype=torch.int64).to(group.device)
    return _DeviceTable(table, widths, table.data_ptr(), table.data_ptr() % 16 == 0)


def plane_widths(transfer: ResolvedTransfer) -> tuple[int, ...]:
    """The element width (bytes) each plane of this transfer moves with."""
    return _device_table(transfer.group, transfer.regions, transfer.chunk_offset, transfer.chunk_bytes.data_ptr()).widths


def _check_shape(shape: LaunchShape) -> None:
    for name in ("tile", "segment", "num_warps"):
        value = getattr(shape, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
            raise ValueError(f"launch shape {name}={value!r} is not allowed; allowed: a power of two")


def triton_transfer(transfer: ResolvedTransfer, *, shape: LaunchShape | None = None) -> None:
    """Run one validated transfer in a single kernel launch (no host-to-device copy after the first),
    in `shape` (tuning) or else the device's `default_launch_shape`."""
    launch = _single_chunk_launch(transfer, shape or default_launch_shape(transfer.group.device))
    if launch is not None:
        _launch(*launch)


def prepare_relaunch(transfer: ResolvedTransfer, *, shape: LaunchShape | None = None) -> "Relaunch | None":
    """The launch `triton_transfer(transfer, shape=shape)` made, ready to be made again over another
    chunk buffer and slot tensor (`Relaunch`), or None where no compiled kernel can be launched
    directly (not CUDA, not launched yet, or nothing to move)."""
    launch = _single_chunk_launch(transfer, shape or default_launch_shape(transfer.group.device))
    if launch is None:
        return None
    # the chunk's address is argument 0 (its pointer) and 1 (the anchor integer); the slots' is 2
    return relaunch_of(*launch, positions=((0, 1), (2,)))


def _single_chunk_launch(transfer: ResolvedTransfer, shape: LaunchShape):
    """The arguments of `_launch` for one validated transfer, or None if no plane moves a row."""
    _check_shape(shape)
    tile = shape.tile
    chunk = transfer.chunk_bytes
    anchor = chunk.data_ptr()
    device_table = _device_table(transfer.group, transfer.regions, transfer.chunk_offset, anchor)
    geometry = _group_geometry(transfer.group)
    planes = len(geometry.row_bytes)
    # The slot anchor is the first plane that moves rows (an empty tensor may have
    # no address at all); other planes' slots are reached by their distance from it.
    slot_anchor = None
    slot_anchor_address = 0
    slot_offsets = [0] * MAX_PLANES
    counts = [0] * MAX_PLANES
    max_programs = 0
    for plane_index, plane_slots in enumerate(transfer.slots):
        count = plane_slots.count
        if count == 0:
            continue  # offset 0, count 0: the plane's programs return at once
        slots = plane_slots.slots
        address = slots.data_ptr()
        if address % 8:
            raise TransferError(
                f"slots[{plane_index}] starts at address {address:#x}, not a multiple of 8; "
                "allowed: an int64 tensor aligned to its element size"
            )
        if slot_anchor is None:
            slot_anchor, slot_anchor_address = slots, address
        slot_offsets[plane_index] = (address - slot_anchor_address) // 8 + plane_slots.start
        counts[plane_index] = count
        programs = -(-count // rows_per_program(tile, device_table.widths[plane_index]))
        if programs > max_programs:
            max_programs = programs
    if slot_anchor is None:
        return None  # no plane moves a row
    grid = (max_programs, geometry.layer_planes, 1)
    layer_stride = transfer.regions.layer_stride
    rows_per_id = transfer.slots[0].rows_per_id  # one for every plane (resolve_transfer)
    arguments = (chunk, anchor, slot_anchor, device_table.table, layer_stride, *slot_offsets, *counts)
    # The compiled kernel's key: pointer alignments and integer widths (counts
    # are always i32: regions stay below 2**31 bytes).
    signature = (
        anchor % 16 == 0,
        slot_anchor_address % 16 == 0,
        device_table.table_aligned,
        integer_type(anchor),
        integer_type(layer_stride),
        tuple(integer_type(offset) for offset in slot_offsets[:planes]),
    )
    pointers = {0: anchor, 2: slot_anchor_address, 3: device_table.address}
    constexprs = (("PLANES", planes), ("STORE", transfer.store), ("ROWS_PER_ID", rows_per_id), ("TILE", tile),
                  ("SEGMENT", shape.segment), ("SEGMENTS", launch_segments(max(geometry.row_bytes), shape.segment)))
    return (_paged_chunk_kernel, grid, arguments, pointers, signature, constexprs, shape.num_warps,
            transfer.group.device)


# Device copies of staging pools' chunk offsets, by (device, offsets): the waves of
# requests of one shape use the same few.
_pool_offsets_tables: BoundedCache[torch.Tensor] = BoundedCache(_MAX_CACHED_TABLES)


def _pool_offsets_table(offsets: np.ndarray, device: torch.device) -> torch.Tensor:
    return _pool_offsets_tables.get_or_build(
        (device, offsets.tobytes()), lambda: to_device(np.array(offsets, dtype=np.int64), device))


@dataclass(frozen=True)
class _ChunksLaunch:
    """The tables of one multi-chunk launch (see `_paged_chunks_kernel`), uploaded once, and its shape.

    `relaunches`: per (direction, rows per id, chunks of a pool or at an address table), the first
    launch as a `Relaunch`, made again by later calls with only their table's (or pool's and
    offsets'), and slots' addresses new. It lives here, beside the tables its integers point to.
    """

    table: torch.Tensor
    work: torch.Tensor  # whole rows: the layers' first rows in a chunk (`whole_rows_tables`)
    rows_table: torch.Tensor
    work_items: int
    columns: int
    shape: LaunchShape
    segments: int  # column steps covering the widest row of any group (the SEGMENTS constexpr)
    whole_rows: WholeRows | None = None  # set: chunks of token rows moved whole (`kernels.whole_rows`)
    relaunches: dict = field(default_factory=dict, compare=False, repr=False)


# Multi-chunk launches by ((rows, chunk offset) of each group, alignment mod 16, shape, rows per id, mapped host).
_chunks_launches: BoundedCache[_ChunksLaunch] = BoundedCache(_MAX_CACHED_TABLES)


def _chunks_launch(batches: Sequence[ResolvedChunkBatch], alignment: int, shape: LaunchShape) -> _ChunksLaunch:
    """The launch of these groups' rows at their chunk offsets in `shape`, for chunk addresses whose gcd
    with the anchor is `alignment`: built and uploaded once, then looked up."""
    return _chunks_launches.get_or_build(_chunks_launch_key(batches, alignment, shape),
                                         lambda: _build_chunks_launch(batches, alignment, shape))


def _chunks_launch_key(batches: Sequence[ResolvedChunkBatch], alignment: int, shape: LaunchShape) -> tuple:
    # with what else `whole_rows_layout` reads: block ids or slots, and mapped host chunks
    first = batches[0]
    return (tuple((batch.rows, batch.chunk_offset) for batch in batches), alignment % 16, shape, first.rows_per_id,
            first.buffers.mapped_host)


def _build_chunks_launch(batches: Sequence[ResolvedChunkBatch], alignment: int, shape: LaunchShape) -> _ChunksLaunch:
    _check_shape(shape)
    device = batches[0].group.device
    counts_all = np.concatenate([batch.rows.counts for batch in batches], axis=1)
    starts_all = np.concatenate([batch.rows.starts for batch in batches], axis=1)
    # Blocking copies from arrays of their own, once per launch's rows (not per call).
    rows_table = torch.from_numpy(np.ascontiguousarray(np.concatenate([counts_all, starts_all], axis=1))).to(device)
    whole = whole_rows_layout(list(batches), alignment, _group_geometry(batches[0].group).plane_gcds)
    if whole is not None:
        table, origins = whole_rows_tables(batches[0], whole)
        return _ChunksLaunch(table=torch.from_numpy(table).to(device), work=torch.from_numpy(origins).to(device),
                             rows_table=rows_table, work_items=whole.blocks, columns=counts_all.shape[1], shape=shape,
                             segments=0, whole_rows=whole)
    table: list[tuple[int, ...]] = []
    programs: list[int] = []
    column = 0  # the group's first plane's column in the rows table
    widest = 1
    for batch in batches:
        rows, regions = batch.rows, batch.rows.regions
        geometry = _group_geometry(rows.group)
        planes = len(geometry.row_bytes)
        widths = _widths(geometry, regions, batch.chunk_offset, alignment)
        largest = rows.counts.max(axis=0)
        for layer in range(rows.group.layer_count):
            for plane in range(planes):
                first = (layer * planes + plane) * _GEOMETRY_FIELDS
                region = batch.chunk_offset + regions.plane_offsets[plane] + layer * regions.layer_stride
                table.append((*geometry.rows[first : first + _GEOMETRY_FIELDS], region, widths[plane],
                              regions.row_pitch[plane], column + plane))
                programs.append(-(-int(largest[plane]) // rows_per_program(shape.tile, widths[plane])))
        column += planes
        widest = max(widest, *geometry.row_bytes)
    programs_array = np.asarray(programs, dtype=np.int64)
    work = np.empty((int(programs_array.sum()), 2), dtype=np.int32)
    work[:, 0] = np.repeat(np.arange(len(table), dtype=np.int32), programs_array)
    work[:, 1] = np.arange(len(work), dtype=np.int64) - np.repeat(np.cumsum(programs_array) - programs_array,
                                                                  programs_array)
    return _ChunksLaunch(
        table=torch.tensor(table, dtype=torch.int64).to(device),
        work=torch.from_numpy(work).to(device),
        rows_table=rows_table,
        work_items=len(work),
        columns=counts_all.shape[1],
        shape=shape,
        segments=launch_segments(widest, shape.segment),
    )


def triton_transfer_chunk_batches(batches: Sequence[ResolvedChunkBatch], *, shape: LaunchShape | None = None) -> int:
    """Run validated multi-chunk transfers (one per layer group) in ONE launch; returns launches.

    Batches that share their chunks (the same addresses), slot tensor (and its kind) and direction
    (a call's layer groups do) go in one launch, in `shape` (tuning) or else `chunk_launch_shape` of
    their largest region; others in one launch per such set. Per launch at most one
    host-to-device copy: the chunk addresses, relative to the copy's own device tensor, which
    anchors every data address (chunk buffers may lie in other allocations or in mapped host
    memory: they are reached by their distance from it); chunks of one pool
    (`pool_chunk_buffers`) are anchored on the pool and upload nothing. Tables, grids and
    compiled kernels are looked up, not rebuilt.
    """
    sets: dict[tuple, list[ResolvedChunkBatch]] = {}  # (a given shape is checked before its first launch)
    for batch in batches:
        if batch.num_chunks and batch.rows.max_region_bytes:
            key = (batch.buffers.addresses.tobytes(), batch.slots.data_ptr(), batch.rows_per_id, batch.store)
            sets.setdefault(key, []).append(batch)
    for members in sets.values():
        _launch_chunks(members, shape or chunk_launch_shape(max(batch.rows.max_region_bytes for batch in members),
                                                            members[0].group.device))
    return len(sets)


def _launch_chunks(batches: list[ResolvedChunkBatch], shape: LaunchShape) -> None:
    """One launch of `batches` (chunks, slots and direction shared) in `shape`.

    A launch of the same rows made before is made again with this call's addresses (a few
    microseconds, against building its arguments and looking up its kernel: `_ChunksLaunch.relaunches`)."""
    first = batches[0]
    buffers, device = first.buffers, first.group.device
    slot_address = first.slots.data_ptr()
    if buffers.pool is not None:
        # Chunks of one pool (staging waves): the pool anchors them and their distances are
        # its offsets, whose device copy is looked up (no upload, and nothing on the copy
        # engine that the next wave's copies would queue behind).
        anchor_tensor, addresses = buffers.pool, _pool_offsets_table(buffers.pool_offsets, device)
        anchor = anchor_tensor.data_ptr()
        kind, positions, new_addresses = (first.store, first.rows_per_id, True), _POOL_RELAUNCH_POSITIONS, (
            anchor, addresses.data_ptr(), slot_address)
    else:
        addresses = stream_table(device, len(buffers))
        anchor = addresses.data_ptr()
        # its bytes anchor the data (the kernel addresses bytes: a uint8 view, same address)
        anchor_tensor = addresses.view(torch.uint8)
        to_device(buffers.addresses - anchor, device, out=addresses)
        kind, positions, new_addresses = (first.store, first.rows_per_id, False), _CHUNKS_RELAUNCH_POSITIONS, (
            anchor, slot_address)
    # Widths must divide every chunk's distance from the anchor: the gcd of them all stands for it.
    launch = _chunks_launch(batches, math.gcd(buffers.address_gcd, anchor), shape)
    relaunch = launch.relaunches.get(kind)
    if relaunch is not None and relaunch(*new_addresses):
        return
    arguments = _chunks_launch_arguments(launch, batches, anchor_tensor, addresses)
    _launch(*arguments)
    launch.relaunches[kind] = relaunch_of(*arguments, positions=positions)


# Where a multi-chunk relaunch puts its addresses: an address table anchors the data (arguments 0
# and 1) and is the table (5), the slots are 2; a pool anchors the data, its offsets are the table.
_CHUNKS_RELAUNCH_POSITIONS = ((0, 1, 5), (2,))
_POOL_RELAUNCH_POSITIONS = ((0, 1), (5,), (2,))


def _chunks_launch_arguments(launch: _ChunksLaunch, batches: list[ResolvedChunkBatch], anchor_tensor: torch.Tensor,
                             addresses: torch.Tensor):
    """The arguments of `_launch` for `batches` launched as `launch`, whose chunks lie at `addresses`
    (device, int64) from `anchor_tensor`'s first byte."""
    first = batches[0]
    whole = launch.whole_rows
    if whole is not None:
        anchor_tensor = element_view(anchor_tensor, whole.element)  # the same first byte
    anchor = anchor_tensor.data_ptr()
    slot_address, addresses_address = first.slots.data_ptr(), addresses.data_ptr()
    table_address, work_address, rows_address = (launch.table.data_ptr(), launch.work.data_ptr(),
                                                 launch.rows_table.data_ptr())
    arguments = (anchor_tensor, anchor, first.slots, launch.table, launch.work, addresses, launch.rows_table,
                 launch.columns)
    signature = (
        "chunks",
        anchor_tensor.dtype,
        anchor % 16 == 0,
        slot_address % 16 == 0,
        table_address % 16 == 0,
        work_address % 16 == 0,
        addresses_address % 16 == 0,
        rows_address % 16 == 0,
        integer_type(anchor),
    )
    pointers = {0: anchor, 2: slot_address, 3: table_address, 4: work_address, 5: addresses_address, 6: rows_address}
    if whole is not None:
        return (whole_rows_kernel, (whole.blocks, whole.layers, first.num_chunks), arguments, pointers, signature,
                whole.constexprs(first.store), WHOLE_ROWS_WARPS, first.group.device)
    constexprs = (("STORE", first.store), ("ROWS_PER_ID", first.rows_per_id), ("TILE", launch.shape.tile),
                  ("SEGMENT", launch.shape.segment), ("SEGMENTS", launch.segments))
    return (_paged_chunks_kernel, (launch.work_items, first.num_chunks, 1), arguments, pointers, signature, constexprs,
            launch.shape.num_warps, first.group.device)


def prepare_chunks_relaunch(batch: ResolvedChunkBatch) -> "ChunksRelaunch | None":
    """The launch `triton_transfer_chunk_batches([batch])` made, ready to be made again over other
    chunks of the same shapes and another slot tensor (`ChunksRelaunch`), or None where there is
    none (chunks of a staging pool, nothing to move, no direct launch on this device)."""
    if batch.buffers.pool is not None or not batch.num_chunks or not batch.rows.max_region_bytes:
        return None
    # The launch `_launch_chunks` kept for these rows, at the table it anchored them on.
    device = batch.group.device
    alignment = math.gcd(batch.buffers.address_gcd, stream_table(device, len(batch.buffers)).data_ptr())
    shape = chunk_launch_shape(batch.rows.max_region_bytes, device)
    launch = _chunks_launches.get(_chunks_launch_key([batch], alignment, shape))
    relaunch = None if launch is None else launch.relaunches.get((batch.store, batch.rows_per_id, False))
    if relaunch is None:
        return None
    return ChunksRelaunch(relaunch, alignment % 16, device)


class ChunksRelaunch:
    """A multi-chunk launch made again (see `Relaunch`): per call one host-to-device copy (the chunks'
    addresses, and the slot array where it is given on the host) and the kernel launch. Refused
    (False, nothing launched) where the chunks' alignment differs from the original's.

    The copy lands in a device table kept per calling thread and CUDA stream (`upload.stream_table`)."""

    __slots__ = ("_relaunch", "_alignment", "_device")

    def __init__(self, relaunch: Relaunch, alignment: int, device: torch.device):
        self._relaunch, self._alignment, self._device = relaunch, alignment, device

    def __call__(self, addresses: np.ndarray, slots: torch.Tensor | np.ndarray) -> bool:
        """`addresses`: the chunks' (int64); `slots`: the slot (or block id) tensor on the device, or
        an int64 array of them, uploaded after the addresses in the same copy."""
        count = len(addresses)
        on_host = isinstance(slots, np.ndarray)
        # a slot array from the host starts on a 16-byte boundary, as the original launch's tensor did
        slots_at = count + count % 2
        entries = slots_at + len(slots) if on_host else count
        table = stream_table(self._device, entries)
        anchor = table.data_ptr()
        slot_address = anchor + 8 * slots_at if on_host else slots.data_ptr()
        if math.gcd(int(np.gcd.reduce(addresses)), anchor) % 16 != self._alignment or not self._relaunch.fits(
                anchor, slot_address):
            return False
        values = np.empty(entries, dtype=np.int64)
        np.subtract(addresses, anchor, out=values[:count])
        if on_host:
            values[slots_at:] = slots
        to_device(values, self._device, out=table)
        return self._relaunch.launch_fitting(anchor, slot_address)
