"""What describes a paged <-> chunk transfer: its limits, its errors and the chunk side's layout.

The paged side is `paged.py`, the per-call checks and batches `resolve.py`: everything a
backend needs is checked and derived there, once, before any launch; the backends (torch
reference, Triton) trust a `ResolvedTransfer` and do no checking of their own.
Pure logic: torch only (tensors are the subject).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "DEFAULT_REGION_ALIGNMENT",
    "ELEMENT_WIDTHS",
    "INT32_LIMIT",
    "MAX_PLANES",
    "ChunkRegions",
    "TransferError",
    "align_up",
    "chunk_regions",
    "non_negative_int",
    "positive_int",
    "strided_chunk_regions",
    "triton_interpreting",
    "widest_element_width",
]

# Each plane's region in the chunk starts on this many bytes (so every region
# can be moved with the widest vector load whatever the planes before it hold).
DEFAULT_REGION_ALIGNMENT = 32
# Upper bound on planes per layer: DSA-C8 has 4; the bound keeps per-launch
# tables small and catches a caller passing layers where planes were meant.
MAX_PLANES = 16
# Widths (bytes) the kernels move per element, widest first. 8 is left out on
# purpose: it is never better than 16 and never possible where 4 is not.
ELEMENT_WIDTHS = (16, 4, 2, 1)
# Row and slot arithmetic in the kernels is 32-bit: rows per cache and bytes per
# chunk region stay below this.
INT32_LIMIT = 2**31


class TransferError(ValueError):
    """A transfer description or one of its tensors is outside the contract."""


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= `value`."""
    return -(-value // alignment) * alignment


def widest_element_width(*byte_quantities: int, widths: Sequence[int] = ELEMENT_WIDTHS) -> int:
    """Widest of `widths` (default 16/4/2/1 bytes) dividing every quantity (sizes, offsets, addresses)."""
    common = 0
    for quantity in byte_quantities:
        common = math.gcd(common, int(quantity))
    for width in widths:
        if common % width == 0:
            return width
    return 1


def triton_interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET set and not 0): kernels then run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TransferError(f"{what}={value!r} is not allowed; allowed: an int > 0")
    return value


def non_negative_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TransferError(f"{what}={value!r} is not allowed; allowed: an int >= 0")
    return value


@dataclass(frozen=True)
class ChunkRegions:
    """Where each (layer, plane) region lies in a group's part of the chunk buffer.

    Region (layer l, plane p) starts `l * layer_stride + plane_offsets[p]` bytes
    from the group's start; its row t lies `t * row_pitch[p]` bytes further and
    holds `row_bytes[p]` bytes. The packed layout (`chunk_regions`) puts a layer's
    planes one after another, each `align_up(row_bytes * region_rows, alignment)`
    bytes with rows back to back (pitch = row bytes); `strided_chunk_regions`
    describes other orders (LMCache's K/V-major `[2, L, T, H]`, token-major rows).
    """

    row_bytes: tuple[int, ...]
    region_rows: tuple[int, ...]
    plane_offsets: tuple[int, ...]
    plane_region_bytes: tuple[int, ...]
    layer_stride: int
    layer_count: int
    alignment: int
    row_pitch: tuple[int, ...] = ()  # empty: rows back to back (pitch = row bytes)
    extent_bytes: int = -1  # bytes the group spans; -1: layer_stride * layer_count

    def __post_init__(self) -> None:
        if not self.row_pitch:
            object.__setattr__(self, "row_pitch", tuple(self.row_bytes))
        if self.extent_bytes < 0:
            object.__setattr__(self, "extent_bytes", self.layer_stride * self.layer_count)

    @property
    def total_bytes(self) -> int:
        return self.extent_bytes

    def region_offset(self, layer: int, plane: int) -> int:
        """Byte offset of (layer, plane)'s region from the group's start."""
        return layer * self.layer_stride + self.plane_offsets[plane]


def chunk_regions(
    row_bytes: Sequence[int],
    region_rows: Sequence[int],
    layer_count: int,
    alignment: int = DEFAULT_REGION_ALIGNMENT,
) -> ChunkRegions:
    """The chunk layout of a group whose planes have these row sizes and row counts."""
    positive_int("layer_count", layer_count)
    positive_int("alignment", alignment)
    if alignment & (alignment - 1):
        raise TransferError(f"alignment={alignment} is not allowed; allowed: a power of two")
    if len(row_bytes) != len(region_rows):
        raise TransferError(
            f"row_bytes has {len(row_bytes)} planes but region_rows has {len(region_rows)}; they must match"
        )
    if not 1 <= len(row_bytes) <= MAX_PLANES:
        raise TransferError(f"plane count={len(row_bytes)} is not allowed; allowed: 1..{MAX_PLANES}")
    offsets: list[int] = []
    sizes: list[int] = []
    cursor = 0
    for plane, (width, rows) in enumerate(zip(row_bytes, region_rows)):
        positive_int(f"row_bytes[{plane}]", width)
        non_negative_int(f"region_rows[{plane}]", rows)
        offsets.append(cursor)
        size = align_up(width * rows, alignment)
        sizes.append(size)
        cursor += size
    return ChunkRegions(
        row_bytes=tuple(row_bytes),
        region_rows=tuple(region_rows),
        plane_offsets=tuple(offsets),
        plane_region_bytes=tuple(sizes),
        layer_stride=cursor,
        layer_count=layer_count,
        alignment=alignment,
    )


def strided_chunk_regions(
    row_bytes: Sequence[int],
    region_rows: Sequence[int],
    plane_offsets: Sequence[int],
    row_pitch: Sequence[int],
    layer_stride: int,
    layer_count: int,
) -> ChunkRegions:
    """A chunk layout with explicit plane offsets, row pitches and layer stride (bytes).

    Regions of different planes may interleave (token-major rows) but must not
    share a byte: that is the caller's to guarantee; sizes are checked here.
    """
    positive_int("layer_count", layer_count)
    non_negative_int("layer_stride", layer_stride)
    planes = len(row_bytes)
    if not 1 <= planes <= MAX_PLANES:
        raise TransferError(f"plane count={planes} is not allowed; allowed: 1..{MAX_PLANES}")
    for name, values in (("region_rows", region_rows), ("plane_offsets", plane_offsets), ("row_pitch", row_pitch)):
        if len(values) != planes:
            raise TransferError(f"{name} has {len(values)} planes but row_bytes has {planes}; they must match")
    extent = 0
    for plane in range(planes):
        width = positive_int(f"row_bytes[{plane}]", row_bytes[plane])
        rows = non_negative_int(f"region_rows[{plane}]", region_rows[plane])
        offset = non_negative_int(f"plane_offsets[{plane}]", plane_offsets[plane])
        pitch = positive_int(f"row_pitch[{plane}]", row_pitch[plane])
        if pitch < width:
            raise TransferError(f"row_pitch[{plane}]={pitch} < row_bytes[{plane}]={width}; rows would overlap")
        if rows:
            extent = max(extent, (layer_count - 1) * layer_stride + offset + (rows - 1) * pitch + width)
    return ChunkRegions(
        row_bytes=tuple(row_bytes),
        region_rows=tuple(region_rows),
        plane_offsets=tuple(plane_offsets),
        plane_region_bytes=tuple(pitch * rows for pitch, rows in zip(row_pitch, region_rows)),
        layer_stride=layer_stride,
        layer_count=layer_count,
        alignment=1,
        row_pitch=tuple(row_pitch),
        extent_bytes=extent,
    )
