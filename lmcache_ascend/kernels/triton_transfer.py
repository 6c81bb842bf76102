"""Triton implementation of the paged <-> chunk transfer: one launch per group.

One source for CUDA and Ascend (triton-ascend): only portable `tl` ops
(loads/stores with masks, pointer bitcasts, integer arithmetic); no inline
assembly, no int-to-pointer casts. Every address is reached as a byte or
element offset from one of two anchor tensors passed to the kernel (the chunk
buffer for data, the first plane's slot array for slots), so caches living in
other allocations are addressed by their (signed, 64-bit) distance.

Grid: (programs, layers x planes). Program (i, l*P + p) moves bytes
[i*BYTES_PER_PROGRAM, (i+1)*BYTES_PER_PROGRAM) of plane p's region of layer l,
walking it as a flat run of vectors (the chunk side is contiguous; each vector
looks up its row's slot), so no lanes idle on row ends. Each plane moves with
the widest element width (16/4/2/1 bytes) dividing its row bytes, block strides,
cache addresses, chunk region offsets and the data anchor; 16 bytes are four
int32 the compiler is told are 16-byte aligned, so it emits 128-bit accesses.
Slot and row arithmetic is int32 where the host guarantees it fits (cache rows
and region bytes below 2**31).
"""

from __future__ import annotations

import logging
import math
import os
from array import array

import torch
import triton
import triton.language as tl

from lmcache_ascend.kernels.spec import ResolvedTransfer, widest_element_width

__all__ = ["supports_device", "triton_transfer"]

logger = logging.getLogger(__name__)

# Vectors per tile and bytes each program moves (tuned on H100, see
# scripts/bench_transfer.py --tune).
VECTORS_PER_TILE = 512
BYTES_PER_PROGRAM = 8192
NUM_WARPS = 4

# The kernel reads two int64 tables of 5 fields per entry:
#   static (per layer x plane, cached on the group): cache address, rows in the
#     cache (num_blocks * block_size), block stride (bytes), block size, row bytes;
#   plane (per plane, per call): slot offset (elements from the slot anchor,
#     start included), count, region offset (bytes from the data anchor, for
#     layer 0), element width (bytes), unused.


def supports_device(device: torch.device) -> bool:
    """Whether this kernel can run on `device` in this process."""
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
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
def _move_region(
    data_anchor,
    slot_ptr,  # int64*: this plane's slots, already advanced by `start`
    first_byte,  # first byte of the region this program moves
    count,
    cache_delta,  # cache address minus the data anchor's, bytes
    cache_rows,
    block_size,
    block_stride,
    row_bytes,
    region_offset,  # the region's start, bytes from the data anchor
    STORE: tl.constexpr,
    ELEMENT: tl.constexpr,
    ELEMENT_BYTES: tl.constexpr,
    VECTOR: tl.constexpr,
    TILE: tl.constexpr,
    BYTES_PER_PROGRAM: tl.constexpr,
):
    # The region (count rows of row_bytes, one after another) is walked as a flat
    # run of VECTOR-element vectors: the chunk side is fully contiguous, the
    # paged side contiguous inside each row. Each vector finds its row's slot.
    VECTOR_BYTES: tl.constexpr = ELEMENT_BYTES * VECTOR
    STEPS: tl.constexpr = BYTES_PER_PROGRAM // (TILE * VECTOR_BYTES)
    base = data_anchor.to(tl.pointer_type(ELEMENT), bitcast=True)
    row_vectors = (row_bytes // VECTOR_BYTES).to(tl.int32)
    total_vectors = count.to(tl.int32) * row_vectors
    cache_base = cache_delta // ELEMENT_BYTES
    stride_elements = block_stride // ELEMENT_BYTES
    row_elements = row_bytes // ELEMENT_BYTES
    chunk_base = region_offset // ELEMENT_BYTES
    block_size32 = block_size.to(tl.int32)
    lane = tl.arange(0, VECTOR)
    for step in range(STEPS):
        vectors = (first_byte // VECTOR_BYTES).to(tl.int32) + step * TILE + tl.arange(0, TILE)
        in_region = vectors < total_vectors
        rows = vectors // row_vectors
        columns = vectors - rows * row_vectors
        slots = tl.load(slot_ptr + rows, mask=in_region, other=-1)
        valid = in_region & (slots >= 0) & (slots < cache_rows)
        # Valid slots are < cache_rows < 2**31 (checked on the host): int32 from here.
        slot32 = tl.where(valid, slots, 0).to(tl.int32)
        blocks = slot32 // block_size32
        in_block = slot32 - blocks * block_size32
        cache_elements = (
            cache_base
            + blocks.to(tl.int64) * stride_elements
            + in_block.to(tl.int64) * row_elements
            + columns.to(tl.int64) * VECTOR
        )
        chunk_elements = chunk_base + vectors.to(tl.int64) * VECTOR
        cache_elements = tl.multiple_of(cache_elements, VECTOR)
        chunk_elements = tl.multiple_of(chunk_elements, VECTOR)
        mask = valid[:, None] & (lane < VECTOR)[None, :]
        cache_ptrs = base + (cache_elements[:, None] + lane[None, :])
        chunk_ptrs = base + (chunk_elements[:, None] + lane[None, :])
        if STORE:
            tl.store(chunk_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
        else:
            tl.store(cache_ptrs, tl.load(chunk_ptrs, mask=mask), mask=mask)


# Integer arguments are not specialized on their values; pointers are (on 16-byte
# alignment, which the 128-bit accesses need), so a compiled binary is reused
# exactly when the direction, tile shape and the pointers' alignment match.
_UNSPECIALIZED_INTEGERS = ("data_anchor_address", "plane_count", "layer_stride")


@triton.jit(do_not_specialize=_UNSPECIALIZED_INTEGERS)
def _paged_chunk_kernel(
    data_anchor,  # uint8*: the chunk buffer; every data address is relative to it
    data_anchor_address,  # its address as an int64
    slot_anchor,  # int64*: one slot array; every slot array is relative to it
    static_table,  # int64 [layers * planes, 5]
    plane_table,  # int64 [planes, 5]
    plane_count,
    layer_stride,
    STORE: tl.constexpr,
    TILE: tl.constexpr,
    BYTES_PER_PROGRAM: tl.constexpr,
):
    program = tl.program_id(0)
    layer_plane = tl.program_id(1)
    layer = layer_plane // plane_count
    plane = layer_plane - layer * plane_count
    plane_entry = plane_table + plane * 5
    count = tl.load(plane_entry + 1)
    entry = static_table + layer_plane.to(tl.int64) * 5
    row_bytes = tl.load(entry + 4)
    first_byte = program.to(tl.int64) * BYTES_PER_PROGRAM
    if first_byte < count * row_bytes:
        slot_ptr = slot_anchor + tl.load(plane_entry + 0)
        region_offset = tl.load(plane_entry + 2) + layer * layer_stride
        width = tl.load(plane_entry + 3)
        cache_delta = tl.load(entry + 0) - data_anchor_address
        cache_rows = tl.load(entry + 1)
        block_stride = tl.load(entry + 2)
        block_size = tl.load(entry + 3)
        if width == 16:
            _move_region(data_anchor, slot_ptr, first_byte, count, cache_delta, cache_rows, block_size, block_stride,
                         row_bytes, region_offset, STORE, tl.int32, 4, 4, TILE, BYTES_PER_PROGRAM)
        elif width == 4:
            _move_region(data_anchor, slot_ptr, first_byte, count, cache_delta, cache_rows, block_size, block_stride,
                         row_bytes, region_offset, STORE, tl.int32, 4, 1, TILE, BYTES_PER_PROGRAM)
        elif width == 2:
            _move_region(data_anchor, slot_ptr, first_byte, count, cache_delta, cache_rows, block_size, block_stride,
                         row_bytes, region_offset, STORE, tl.int16, 2, 1, TILE, BYTES_PER_PROGRAM)
        else:
            _move_region(data_anchor, slot_ptr, first_byte, count, cache_delta, cache_rows, block_size, block_stride,
                         row_bytes, region_offset, STORE, tl.int8, 1, 1, TILE, BYTES_PER_PROGRAM)


def _static_tables(transfer: ResolvedTransfer) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Per-(layer, plane) geometry on the device, and each plane's alignment gcd; cached on the group."""
    group = transfer.group
    cached = group.backend_cache.get("triton")
    if cached is not None:
        return cached
    rows: list[list[int]] = []  # built once per group, so plain lists are fine
    plane_gcds = [plane.row_bytes for plane in group.planes]
    for layer in range(group.layer_count):
        for plane_index, plane in enumerate(group.planes):
            geometry = group.geometry[layer][plane_index]
            rows.append(
                [
                    geometry.address,
                    geometry.num_blocks * plane.block_size,
                    geometry.block_stride_bytes,
                    plane.block_size,
                    plane.row_bytes,
                ]
            )
            plane_gcds[plane_index] = math.gcd(
                plane_gcds[plane_index], geometry.address, geometry.block_stride_bytes
            )
    table = torch.tensor(rows, dtype=torch.int64).to(group.device)
    cached = (table, tuple(plane_gcds))
    group.backend_cache["triton"] = cached
    return cached


def plane_widths(transfer: ResolvedTransfer) -> tuple[int, ...]:
    """The element width (bytes) each plane of this transfer moves with."""
    _, plane_gcds = _static_tables(transfer)
    anchor = transfer.chunk_bytes.data_ptr()
    layout = transfer.layout
    widths = []
    for plane_index, plane_gcd in enumerate(plane_gcds):
        region = transfer.chunk_offset + layout.plane_offsets[plane_index]
        quantities = [plane_gcd, anchor, region]
        if layout.layer_count > 1:
            quantities.append(layout.layer_stride)
        widths.append(widest_element_width(*quantities))
    return tuple(widths)


def triton_transfer(transfer: ResolvedTransfer, *, tile: int = VECTORS_PER_TILE,
                    bytes_per_program: int = BYTES_PER_PROGRAM, num_warps: int = NUM_WARPS) -> None:
    """Run one validated transfer in a single kernel launch."""
    if bytes_per_program % (tile * 16):
        raise ValueError(f"bytes_per_program={bytes_per_program} must be a multiple of tile={tile} x 16 bytes")
    static_table, _ = _static_tables(transfer)
    widths = plane_widths(transfer)
    layout = transfer.layout
    slot_anchor = transfer.slots[0].slots
    slot_anchor_address = slot_anchor.data_ptr()
    plane_values = array("q")  # flat [planes, 5]; frombuffer avoids building a tensor from lists
    max_region_bytes = 0
    for plane_index, (plane, plane_slots) in enumerate(zip(transfer.group.planes, transfer.slots)):
        distance = plane_slots.slots.data_ptr() - slot_anchor_address
        # int64 arrays are 8-byte aligned, so the distance is whole elements.
        plane_values.extend(
            (
                distance // 8 + plane_slots.start,
                plane_slots.count,
                transfer.chunk_offset + layout.plane_offsets[plane_index],
                widths[plane_index],
                0,
            )
        )
        max_region_bytes = max(max_region_bytes, plane_slots.count * plane.row_bytes)
    if max_region_bytes == 0:
        return
    # From pageable memory the copy is staged before .to() returns, so the
    # array may go away at once; no device synchronization happens.
    plane_table = torch.frombuffer(plane_values, dtype=torch.int64).to(static_table.device, non_blocking=True)
    group = transfer.group
    grid = (triton.cdiv(max_region_bytes, bytes_per_program), group.layer_count * group.plane_count)
    arguments = (
        transfer.chunk_bytes,
        transfer.chunk_bytes.data_ptr(),
        slot_anchor,
        static_table,
        plane_table,
        group.plane_count,
        layout.layer_stride,
    )
    _launch(grid, arguments, transfer.store, tile, bytes_per_program, num_warps, static_table.device)


# Compiled kernels by (device, direction, tile, bytes per program, warps, pointer
# alignments): the same key Triton's JIT derives for this kernel, whose entry
# re-derives it on every call (tens of microseconds); a hit launches directly.
_compiled: dict[tuple, object] = {}
_direct_launch = {"enabled": True}


def _integer_type(value: int) -> str:
    """The type Triton gives an unspecialized int argument (part of the compiled kernel's key)."""
    if -(2**31) <= value < 2**31:
        return "i32"
    if 2**63 <= value < 2**64:
        return "u64"
    return "i64"


def _launch(grid, arguments, store, tile, bytes_per_program, num_warps, device) -> None:
    signature = tuple(
        argument.data_ptr() % 16 == 0 if isinstance(argument, torch.Tensor) else _integer_type(argument)
        for argument in arguments
    )
    key = (str(device), store, tile, bytes_per_program, num_warps, signature)
    compiled = _compiled.get(key) if _direct_launch["enabled"] else None
    constants = (store, tile, bytes_per_program)
    if compiled is not None:
        try:
            compiled[(grid[0], grid[1], 1)](*arguments, *constants)  # a compiled kernel wants all 3 grid dims
            return
        except (TypeError, IndexError, AttributeError) as error:  # argument binding, before any launch
            # A Triton build whose compiled-kernel call differs: use the JIT entry from now on.
            logger.warning("direct Triton launch failed (%s); using the JIT entry", error)
            _direct_launch["enabled"] = False
            _compiled.clear()
    compiled = _paged_chunk_kernel[grid](
        *arguments, STORE=store, TILE=tile, BYTES_PER_PROGRAM=bytes_per_program, num_warps=num_warps
    )
    # The interpreter returns no compiled kernel; only a real one is cached.
    if compiled is not None and hasattr(compiled, "run") and _direct_launch["enabled"]:
        _compiled[key] = compiled
