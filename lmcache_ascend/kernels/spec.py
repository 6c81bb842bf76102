"""Typed description of a paged <-> chunk transfer, and its host-side validation.

Everything a backend needs is checked and derived here, once, before any launch:
the backends (torch reference, Triton) trust a `ResolvedTransfer` and do no
checking of their own. Pure logic: torch only (tensors are the subject).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch

from lmcache_ascend.bounded_cache import BoundedCache

__all__ = [
    "DEFAULT_REGION_ALIGNMENT",
    "ELEMENT_WIDTHS",
    "MAX_PLANES",
    "ChunkBuffers",
    "ChunkLayout",
    "ChunkRows",
    "PagedGeometry",
    "PagedGroup",
    "PagedPlane",
    "PlaneSlots",
    "ResolvedChunkBatch",
    "ResolvedTransfer",
    "TransferError",
    "align_up",
    "chunk_buffers",
    "chunk_layout",
    "chunk_rows",
    "pool_chunk_buffers",
    "resolve_transfer",
    "resolve_chunk_batch",
    "strided_chunk_layout",
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
_INT32_LIMIT = 2**31


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


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TransferError(f"{what}={value!r} is not allowed; allowed: an int > 0")
    return value


def _non_negative_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TransferError(f"{what}={value!r} is not allowed; allowed: an int >= 0")
    return value


@dataclass(frozen=True)
class ChunkLayout:
    """Where each (layer, plane) region lies in a group's part of the chunk buffer.

    Region (layer l, plane p) starts `l * layer_stride + plane_offsets[p]` bytes
    from the group's start; its row t lies `t * row_pitch[p]` bytes further and
    holds `row_bytes[p]` bytes. The packed layout (`chunk_layout`) puts a layer's
    planes one after another, each `align_up(row_bytes * region_rows, alignment)`
    bytes with rows back to back (pitch = row bytes); `strided_chunk_layout`
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


def chunk_layout(
    row_bytes: Sequence[int],
    region_rows: Sequence[int],
    layer_count: int,
    alignment: int = DEFAULT_REGION_ALIGNMENT,
) -> ChunkLayout:
    """The chunk layout of a group whose planes have these row sizes and row counts."""
    _positive_int("layer_count", layer_count)
    _positive_int("alignment", alignment)
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
        _positive_int(f"row_bytes[{plane}]", width)
        _non_negative_int(f"region_rows[{plane}]", rows)
        offsets.append(cursor)
        size = align_up(width * rows, alignment)
        sizes.append(size)
        cursor += size
    return ChunkLayout(
        row_bytes=tuple(row_bytes),
        region_rows=tuple(region_rows),
        plane_offsets=tuple(offsets),
        plane_region_bytes=tuple(sizes),
        layer_stride=cursor,
        layer_count=layer_count,
        alignment=alignment,
    )


def strided_chunk_layout(
    row_bytes: Sequence[int],
    region_rows: Sequence[int],
    plane_offsets: Sequence[int],
    row_pitch: Sequence[int],
    layer_stride: int,
    layer_count: int,
) -> ChunkLayout:
    """A chunk layout with explicit plane offsets, row pitches and layer stride (bytes).

    Regions of different planes may interleave (token-major rows) but must not
    share a byte: that is the caller's to guarantee; sizes are checked here.
    """
    _positive_int("layer_count", layer_count)
    _non_negative_int("layer_stride", layer_stride)
    planes = len(row_bytes)
    if not 1 <= planes <= MAX_PLANES:
        raise TransferError(f"plane count={planes} is not allowed; allowed: 1..{MAX_PLANES}")
    for name, values in (("region_rows", region_rows), ("plane_offsets", plane_offsets), ("row_pitch", row_pitch)):
        if len(values) != planes:
            raise TransferError(f"{name} has {len(values)} planes but row_bytes has {planes}; they must match")
    extent = 0
    for plane in range(planes):
        width = _positive_int(f"row_bytes[{plane}]", row_bytes[plane])
        rows = _non_negative_int(f"region_rows[{plane}]", region_rows[plane])
        offset = _non_negative_int(f"plane_offsets[{plane}]", plane_offsets[plane])
        pitch = _positive_int(f"row_pitch[{plane}]", row_pitch[plane])
        if pitch < width:
            raise TransferError(f"row_pitch[{plane}]={pitch} < row_bytes[{plane}]={width}; rows would overlap")
        if rows:
            extent = max(extent, (layer_count - 1) * layer_stride + offset + (rows - 1) * pitch + width)
    return ChunkLayout(
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


@dataclass(frozen=True)
class PagedGeometry:
    """One layer's tensor of one plane, in bytes (derived, validated)."""

    address: int  # data_ptr() of the tensor itself: a view's own first byte
    storage_offset_bytes: int  # the same place, counted from its storage's start
    num_blocks: int
    block_stride_bytes: int  # from one block to the next (>= block_size * row_bytes)

    def byte_view(self, tensor: torch.Tensor, block_size: int, row_bytes: int) -> torch.Tensor:
        """A uint8 (num_blocks, block_size, row_bytes) view of exactly the tensor's bytes."""
        view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        view.set_(
            tensor.untyped_storage(),
            self.storage_offset_bytes,
            (self.num_blocks, block_size, row_bytes),
            (self.block_stride_bytes, row_bytes, 1),
        )
        return view


def _trailing_dims_contiguous(tensor: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _geometry(what: str, tensor: torch.Tensor, block_size: int, row_bytes: int) -> PagedGeometry:
    if not isinstance(tensor, torch.Tensor):
        raise TransferError(f"{what} is a {type(tensor).__name__}; allowed: a torch.Tensor")
    if tensor.layout is not torch.strided or tensor.is_quantized:
        raise TransferError(f"{what} has layout {tensor.layout}; allowed: a plain strided tensor")
    if tensor.dtype.is_complex:
        raise TransferError(f"{what} has dtype {tensor.dtype}; allowed: a real or integer dtype")
    element = tensor.element_size()
    if tensor.dim() < 2:
        raise TransferError(
            f"{what} has shape {tuple(tensor.shape)}; allowed: >= 2 dims, blocks first "
            "(num_blocks, block_size, ...)"
        )
    if row_bytes % element:
        raise TransferError(
            f"{what}: row_bytes={row_bytes} is not a multiple of its {tensor.dtype} element size ({element})"
        )
    block_bytes = math.prod(tensor.shape[1:]) * element
    if block_bytes != block_size * row_bytes:
        raise TransferError(
            f"{what} has shape {tuple(tensor.shape)} ({tensor.dtype}): {block_bytes} bytes per block, "
            f"but block_size={block_size} x row_bytes={row_bytes} = {block_size * row_bytes}"
        )
    if not _trailing_dims_contiguous(tensor):
        raise TransferError(
            f"{what} has strides {tensor.stride()} for shape {tuple(tensor.shape)}: "
            "each block's bytes must be contiguous (only the block dim may be strided)"
        )
    num_blocks = int(tensor.shape[0])
    if num_blocks == 0:
        raise TransferError(f"{what} has shape {tuple(tensor.shape)}: num_blocks=0; allowed: >= 1 block")
    if num_blocks * block_size >= _INT32_LIMIT:
        raise TransferError(
            f"{what} has {num_blocks} blocks x block_size={block_size} rows; allowed: fewer than 2**31 rows"
        )
    block_stride_bytes = tensor.stride(0) * element if num_blocks > 1 else block_bytes
    if block_stride_bytes < block_bytes:
        raise TransferError(
            f"{what}: block stride {block_stride_bytes} bytes is smaller than a block ({block_bytes} bytes); "
            "blocks must not overlap"
        )
    return PagedGeometry(
        address=tensor.data_ptr(),
        storage_offset_bytes=tensor.storage_offset() * element,
        num_blocks=num_blocks,
        block_stride_bytes=block_stride_bytes,
    )


@dataclass(frozen=True)
class PagedPlane:
    """One plane of a layer group: per layer one paged tensor.

    Each tensor is seen as `num_blocks` (its dim 0) blocks of `block_size` rows of
    `row_bytes` bytes, rows one after another inside a block; only the block
    dim may be strided (views into a shared blob are fine: the view's own
    `data_ptr()` is used). Slot s is row `s % block_size` of block
    `s // block_size`. The dtype does not matter beyond its element size.
    """

    caches: tuple[torch.Tensor, ...]
    block_size: int
    row_bytes: int
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.caches, torch.Tensor) or not isinstance(self.caches, Sequence):
            raise TransferError(
                f"plane {self.name!r}: caches is a {type(self.caches).__name__}; "
                "allowed: a sequence of tensors, one per layer"
            )
        object.__setattr__(self, "caches", tuple(self.caches))
        _positive_int(f"plane {self.name!r} block_size", self.block_size)
        _positive_int(f"plane {self.name!r} row_bytes", self.row_bytes)
        if not self.caches:
            raise TransferError(f"plane {self.name!r} has 0 layers; allowed: >= 1 tensor")


@dataclass(frozen=True)
class PlaneSlots:
    """Which paged rows one plane moves for one chunk.

    Chunk row t (0 <= t < count) <-> paged slot `slots[start + t]`. Slots < 0
    (vLLM's -1, or the null block) or >= num_blocks * block_size are skipped
    in both directions. `region_rows` (default `count`) sizes the plane's region
    in the chunk, so a partial last chunk can keep the full-chunk layout.
    """

    slots: torch.Tensor
    start: int = 0
    count: int | None = None
    region_rows: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.slots, torch.Tensor):
            raise TransferError(f"slots is a {type(self.slots).__name__}; allowed: a 1-D int64 torch.Tensor")
        _non_negative_int("start", self.start)
        if self.count is None:
            object.__setattr__(self, "count", max(self.slots.numel() - self.start, 0))
        _non_negative_int("count", self.count)
        if self.region_rows is None:
            object.__setattr__(self, "region_rows", self.count)
        _non_negative_int("region_rows", self.region_rows)


def _device_signature(tensor: torch.Tensor) -> tuple[bool, bool, int]:
    return (tensor.is_cpu, tensor.is_cuda, tensor.get_device())


@dataclass(frozen=True)
class PagedGroup:
    """A layer group: all planes of all its layers, moved by one launch.

    Built once (at KV-cache registration); validation and per-tensor geometry
    are computed here, and backends may cache device-side tables on it.
    """

    planes: tuple[PagedPlane, ...]
    geometry: tuple[tuple[PagedGeometry, ...], ...] = field(init=False, repr=False, compare=False)
    device: torch.device = field(init=False, repr=False, compare=False)
    backend_cache: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.planes, PagedPlane) or not isinstance(self.planes, Sequence):
            raise TransferError(
                f"planes is a {type(self.planes).__name__}; allowed: a sequence of PagedPlane"
            )
        planes = tuple(self.planes)
        object.__setattr__(self, "planes", planes)
        if not 1 <= len(planes) <= MAX_PLANES:
            raise TransferError(f"plane count={len(planes)} is not allowed; allowed: 1..{MAX_PLANES}")
        for index, plane in enumerate(planes):
            if not isinstance(plane, PagedPlane):
                raise TransferError(f"planes[{index}] is a {type(plane).__name__}; allowed: PagedPlane")
        layer_counts = [len(plane.caches) for plane in planes]
        if len(set(layer_counts)) != 1:
            raise TransferError(f"planes have different layer counts {layer_counts}; all must be equal")
        device = planes[0].caches[0].device if isinstance(planes[0].caches[0], torch.Tensor) else None
        geometry = []
        for layer in range(layer_counts[0]):
            per_plane = []
            for index, plane in enumerate(planes):
                what = f"plane {index} ({plane.name or 'unnamed'}) layer {layer} cache"
                tensor = plane.caches[layer]
                per_plane.append(_geometry(what, tensor, plane.block_size, plane.row_bytes))
                if tensor.device != device:
                    raise TransferError(
                        f"{what} is on {tensor.device} but plane 0 layer 0 is on {device}; "
                        "all tensors of a transfer must be on one device"
                    )
            geometry.append(tuple(per_plane))
        object.__setattr__(self, "geometry", tuple(geometry))
        object.__setattr__(self, "device", device)
        # Reading `tensor.device` builds a Python object (over a microsecond); the
        # per-call checks compare these cheap attributes instead where they decide
        # equality on their own (CPU and CUDA tensors), see `on_group_device`.
        object.__setattr__(self, "_device_signature", _device_signature(planes[0].caches[0]))
        object.__setattr__(self, "_device_signature_exact", device is not None and device.type in ("cpu", "cuda"))

    def on_group_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on this group's device (exact; cheap for CPU and CUDA)."""
        if _device_signature(tensor) != self._device_signature:
            return False
        return self._device_signature_exact or tensor.device == self.device

    @property
    def layer_count(self) -> int:
        return len(self.planes[0].caches)

    @property
    def plane_count(self) -> int:
        return len(self.planes)

    def chunk_layout(
        self, region_rows: Sequence[int], alignment: int = DEFAULT_REGION_ALIGNMENT
    ) -> ChunkLayout:
        """This group's chunk layout for the given rows per plane (memoized: one per chunk shape)."""
        return self.cache("chunk_layouts", 256).get_or_build((tuple(region_rows), alignment), lambda: chunk_layout(
            [plane.row_bytes for plane in self.planes], region_rows, self.layer_count, alignment))

    def cache(self, name: str, bound: int) -> BoundedCache:
        """The group's bounded cache `name` (made on first use): what callers derive from this group's
        fixed geometry, kept with it (`docs/hot-path.md`)."""
        found = self.backend_cache.get(name)
        if found is None:
            found = self.backend_cache[name] = BoundedCache(bound)
        return found


@dataclass(frozen=True)
class ResolvedTransfer:
    """A validated launch: what every backend consumes."""

    group: PagedGroup
    slots: tuple[PlaneSlots, ...]
    chunk_bytes: torch.Tensor  # flat uint8 view of the whole chunk buffer
    chunk_offset: int  # where this group's part starts, in bytes
    layout: ChunkLayout
    store: bool


def _chunk_as_bytes(chunk: torch.Tensor) -> torch.Tensor:
    if not isinstance(chunk, torch.Tensor):
        raise TransferError(f"chunk is a {type(chunk).__name__}; allowed: a contiguous torch.Tensor")
    if chunk.layout is not torch.strided or not chunk.is_contiguous():
        raise TransferError(
            f"chunk has shape {tuple(chunk.shape)} strides {chunk.stride()}; allowed: a contiguous tensor"
        )
    if chunk.dtype == torch.uint8 and chunk.dim() == 1:
        return chunk  # already flat bytes (the common case: no new view per call)
    flat = torch.empty(0, dtype=torch.uint8, device=chunk.device)
    flat.set_(
        chunk.untyped_storage(),
        chunk.storage_offset() * chunk.element_size(),
        (chunk.numel() * chunk.element_size(),),
        (1,),
    )
    return flat


def _check_layout(group: PagedGroup, slots: tuple[PlaneSlots, ...], layout: ChunkLayout) -> None:
    if not isinstance(layout, ChunkLayout):
        raise TransferError(f"layout is a {type(layout).__name__}; allowed: ChunkLayout")
    row_bytes = tuple(plane.row_bytes for plane in group.planes)
    if layout.row_bytes != row_bytes or layout.layer_count != group.layer_count:
        raise TransferError(
            f"layout has row_bytes {layout.row_bytes} x {layout.layer_count} layers but the group has "
            f"{row_bytes} x {group.layer_count}; they must match"
        )
    for index, plane_slots in enumerate(slots):
        if layout.region_rows[index] < plane_slots.count:
            raise TransferError(
                f"slots[{index}]: count={plane_slots.count} > layout region_rows={layout.region_rows[index]}; "
                "the region must hold every moved row"
            )
        if layout.plane_region_bytes[index] >= _INT32_LIMIT:
            raise TransferError(
                f"plane {index}: a region of {layout.plane_region_bytes[index]} bytes; allowed: below 2**31 bytes"
            )


def resolve_transfer(
    group: PagedGroup,
    slots: Sequence[PlaneSlots],
    chunk: torch.Tensor,
    *,
    store: bool,
    chunk_offset: int = 0,
    alignment: int = DEFAULT_REGION_ALIGNMENT,
    layout: ChunkLayout | None = None,
) -> ResolvedTransfer:
    """Check a launch against the contract; raise TransferError naming the bad input.

    `layout` (default: the group's packed layout for the slots' region rows at
    `alignment`) places the regions in the chunk, e.g. a `strided_chunk_layout`.
    """
    if not isinstance(group, PagedGroup):
        raise TransferError(f"group is a {type(group).__name__}; allowed: PagedGroup")
    if not isinstance(store, bool):
        raise TransferError(f"store={store!r} is not allowed; allowed: True (paged -> chunk) or False")
    if isinstance(slots, PlaneSlots):
        slots = (slots,)
    slots = tuple(slots)
    if len(slots) != group.plane_count:
        raise TransferError(
            f"got {len(slots)} PlaneSlots for a group of {group.plane_count} planes; need one per plane"
        )
    for index, plane_slots in enumerate(slots):
        if not isinstance(plane_slots, PlaneSlots):
            raise TransferError(f"slots[{index}] is a {type(plane_slots).__name__}; allowed: PlaneSlots")
        tensor = plane_slots.slots
        if tensor.dtype != torch.int64:
            raise TransferError(f"slots[{index}] has dtype {tensor.dtype}; allowed: torch.int64 (use .long())")
        if tensor.dim() != 1 or (tensor.numel() > 1 and tensor.stride(0) != 1):
            raise TransferError(
                f"slots[{index}] has shape {tuple(tensor.shape)} strides {tensor.stride()}; "
                "allowed: a contiguous 1-D tensor"
            )
        if not group.on_group_device(tensor):
            raise TransferError(
                f"slots[{index}] is on {tensor.device} but the caches are on {group.device}; "
                "all tensors of a transfer must be on one device"
            )
        if plane_slots.start + plane_slots.count > tensor.numel():
            raise TransferError(
                f"slots[{index}]: start={plane_slots.start} + count={plane_slots.count} exceeds its "
                f"{tensor.numel()} entries"
            )
        if plane_slots.region_rows * group.planes[index].row_bytes >= _INT32_LIMIT:
            raise TransferError(
                f"slots[{index}]: region_rows={plane_slots.region_rows} x row_bytes="
                f"{group.planes[index].row_bytes} is 2 GiB or more; allowed: a region below 2**31 bytes"
            )
        if plane_slots.region_rows < plane_slots.count:
            raise TransferError(
                f"slots[{index}]: region_rows={plane_slots.region_rows} < count={plane_slots.count}; "
                "the region must hold every moved row"
            )
    chunk_bytes = _chunk_as_bytes(chunk)
    if not group.on_group_device(chunk_bytes):
        raise TransferError(
            f"chunk is on {chunk_bytes.device} but the caches are on {group.device}; "
            "all tensors of a transfer must be on one device"
        )
    _non_negative_int("chunk_offset", chunk_offset)
    if layout is None:
        layout = group.chunk_layout([s.region_rows for s in slots], alignment)
    else:
        _check_layout(group, slots, layout)
    if chunk_offset + layout.total_bytes > chunk_bytes.numel():
        raise TransferError(
            f"chunk holds {chunk_bytes.numel()} bytes but chunk_offset={chunk_offset} + the group's "
            f"{layout.total_bytes} bytes ({layout.layer_count} layers x {layout.layer_stride}) do not fit"
        )
    return ResolvedTransfer(
        group=group,
        slots=slots,
        chunk_bytes=chunk_bytes,
        chunk_offset=chunk_offset,
        layout=layout,
        store=store,
    )


@dataclass(frozen=True)
class ChunkBuffers:
    """Many chunk buffers, checked once (`chunk_buffers`, `pool_chunk_buffers`) and then addressed by integer.

    `addresses[c]` is chunk c's first byte and `sizes[c]` its bytes; every chunk holds
    at least `min_bytes`. `mapped_host`: the chunks are CUDA pinned host memory
    (reached through unified addressing); else they share one device. Either one
    tensor per chunk (`tensors`), or chunks at `pool_offsets` of one flat `pool`.
    """

    tensors: tuple[torch.Tensor, ...] = field(repr=False)
    addresses: np.ndarray  # int64 [chunks]
    sizes: np.ndarray  # int64 [chunks]
    min_bytes: int
    mapped_host: bool
    address_gcd: int  # gcd of every address (0 for none): the widest element width divides it
    pool: torch.Tensor | None = field(default=None, repr=False)
    pool_offsets: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.addresses)

    @property
    def keep_alive(self) -> tuple:
        """The tensors behind `addresses`."""
        return self.tensors if self.pool is None else (self.pool,)

    def chunk(self, index: int) -> torch.Tensor:
        """Chunk `index` as a flat uint8 tensor."""
        if self.pool is None:
            return self.tensors[index]
        offset = int(self.pool_offsets[index])
        return self.pool[offset : offset + int(self.sizes[index])]


def _address_gcd(addresses: np.ndarray) -> int:
    return int(np.gcd.reduce(addresses)) if len(addresses) else 0


def _chunk_problem(index: int, chunk: object, first: torch.Tensor, mapped_host: bool) -> str | None:
    """What is wrong with `chunk` (chunks[index]) for a batch led by `first`, or None."""
    if not isinstance(chunk, torch.Tensor) or chunk.dtype is not torch.uint8 or chunk.dim() != 1 or not chunk.is_contiguous():
        return (
            f"chunks[{index}] = {getattr(chunk, 'dtype', type(chunk).__name__)} "
            f"{tuple(getattr(chunk, 'shape', ()))}: allowed: a contiguous flat uint8 tensor"
        )
    if (chunk.is_cuda, chunk.get_device()) != (first.is_cuda, first.get_device()) or (
        mapped_host and not chunk.is_pinned()
    ):
        return (
            f"chunks[{index}] is on {chunk.device} (pinned: {chunk.is_cpu and chunk.is_pinned()}) but chunks[0] "
            f"is on {first.device} (pinned: {mapped_host}); all chunks of a batch must lie alike"
        )
    return None


_dtype_of = attrgetter("dtype")
_device_of = attrgetter("device")


def chunk_buffers(chunks: Sequence[torch.Tensor], *, mapped: bool = True) -> ChunkBuffers:
    """Check flat uint8 chunk buffers once: contiguous, one placement (one device, or pinned host).

    `mapped=False`: host chunks that kernels will not reach (they are copied, e.g. through
    staging) need not be pinned, and are not marked `mapped_host`.

    A request has tens of chunks, checked on every call: each property is read for all
    chunks at once (C-level maps, no per-chunk Python frame); only a failing batch is
    walked chunk by chunk, to name the first bad one.
    """
    chunks = tuple(chunks)
    count = len(chunks)
    if not chunks:
        empty = np.empty(0, dtype=np.int64)
        return ChunkBuffers(chunks, empty, empty, 0, False, 0)
    first = chunks[0]
    if not isinstance(first, torch.Tensor):
        raise TransferError(f"chunks[0] is a {type(first).__name__}; allowed: a flat uint8 torch.Tensor")
    mapped_host = mapped and first.is_cpu and first.is_pinned()
    Tensor = torch.Tensor
    try:
        # (stride (1,): 1-D and contiguous at once; a 1- or 0-byte chunk takes the walk below)
        alike = (
            set(map(_dtype_of, chunks)) == {torch.uint8}
            and set(map(Tensor.stride, chunks)) == {(1,)}
            and len(set(map(_device_of, chunks))) == 1
            and (not mapped_host or all(map(Tensor.is_pinned, chunks)))
        )
    except (TypeError, AttributeError):  # something that is not a tensor
        alike = False
    if not alike:
        for index, chunk in enumerate(chunks):
            problem = _chunk_problem(index, chunk, first, mapped_host)
            if problem is not None:
                raise TransferError(problem)
    addresses = np.fromiter(map(Tensor.data_ptr, chunks), dtype=np.int64, count=count)
    sizes = np.fromiter(map(Tensor.numel, chunks), dtype=np.int64, count=count)
    return ChunkBuffers(chunks, addresses, sizes, int(sizes.min()), mapped_host, _address_gcd(addresses))


def pool_chunk_buffers(pool: torch.Tensor, offsets: np.ndarray, chunk_bytes: int) -> ChunkBuffers:
    """Chunks of `chunk_bytes` at byte `offsets` of one flat uint8 `pool` (a staging buffer), checked at once."""
    if (
        not isinstance(pool, torch.Tensor)
        or pool.dtype is not torch.uint8
        or pool.dim() != 1
        or not pool.is_contiguous()
    ):
        raise TransferError(
            f"pool = {getattr(pool, 'dtype', type(pool).__name__)} {tuple(getattr(pool, 'shape', ()))}: "
            "allowed: a contiguous flat uint8 tensor"
        )
    offsets = np.asarray(offsets, dtype=np.int64)
    _non_negative_int("chunk_bytes", chunk_bytes)
    if offsets.ndim != 1:
        raise TransferError(f"offsets have shape {offsets.shape}; allowed: 1-D")
    if len(offsets) and (int(offsets.min()) < 0 or int(offsets.max()) + chunk_bytes > pool.numel()):
        raise TransferError(
            f"chunks of {chunk_bytes} bytes at offsets {int(offsets.min())}..{int(offsets.max())} do not fit the "
            f"pool of {pool.numel()} bytes"
        )
    addresses = offsets + pool.data_ptr()
    sizes = np.full(len(offsets), chunk_bytes, dtype=np.int64)
    mapped_host = pool.is_cpu and pool.is_pinned()
    return ChunkBuffers((), addresses, sizes, chunk_bytes if len(offsets) else 0, mapped_host,
                        _address_gcd(addresses), pool=pool, pool_offsets=offsets)


@dataclass(frozen=True, eq=False)
class ChunkRows:
    """Which slots each plane of each chunk moves, for one group and chunk layout: validated once (`chunk_rows`).

    Plane p of chunk c moves `counts[c, p]` rows whose slots are
    `slots[starts[c, p] : starts[c, p] + counts[c, p]]`, into / out of the first
    rows of its region. The arrays are read-only: callers keep and reuse a
    `ChunkRows` for every call with the same rows (requests of one length), and
    backends key what they derive from it (device tables) on its identity.
    """

    group: PagedGroup
    layout: ChunkLayout
    starts: np.ndarray  # int64 [chunks, planes]
    counts: np.ndarray  # int64 [chunks, planes]
    slots_needed: int  # the slot tensor must hold at least this many entries
    max_region_bytes: int  # the most bytes one (chunk, layer, plane) region moves

    @property
    def num_chunks(self) -> int:
        return len(self.starts)


def chunk_rows(group: PagedGroup, layout: ChunkLayout, starts: np.ndarray, counts: np.ndarray) -> ChunkRows:
    """Check per-chunk rows of a multi-chunk launch against `group` and `layout`; raise TransferError naming them."""
    if not isinstance(group, PagedGroup):
        raise TransferError(f"group is a {type(group).__name__}; allowed: PagedGroup")
    _check_layout(group, (), layout)
    starts = np.array(starts, dtype=np.int64)  # copies: the caller's arrays may change, these may not
    counts = np.array(counts, dtype=np.int64)
    if starts.ndim != 2 or starts.shape != counts.shape or starts.shape[1] != group.plane_count:
        raise TransferError(
            f"starts {starts.shape} / counts {counts.shape}: allowed: (chunks, planes) with planes = "
            f"{group.plane_count}"
        )
    if (starts < 0).any() or (counts < 0).any():
        raise TransferError("starts and counts must be >= 0")
    region_rows = np.asarray(layout.region_rows, dtype=np.int64)
    over = counts > region_rows[None, :]
    if over.any():
        chunk, plane = np.argwhere(over)[0]
        raise TransferError(
            f"chunk {chunk} plane {plane}: count={counts[chunk, plane]} > layout region_rows={region_rows[plane]}"
        )
    starts.flags.writeable = False
    counts.flags.writeable = False
    row_bytes = np.asarray([plane.row_bytes for plane in group.planes], dtype=np.int64)
    slots_needed = int((starts + counts).max()) if starts.size else 0
    max_region_bytes = int((counts * row_bytes[None, :]).max()) if counts.size else 0
    return ChunkRows(group, layout, starts, counts, slots_needed, max_region_bytes)


@dataclass(frozen=True)
class ResolvedChunkBatch:
    """A validated multi-chunk transfer of one group: many chunks of one layout (the Triton backend moves every
    group of a call in one launch).

    Chunk c's part for this group starts `chunk_offset` bytes into the buffer at
    `buffers.addresses[c]` (device memory, or host memory the device maps: CUDA
    pinned memory); `rows` says which slots each plane of each chunk moves.
    """

    group: PagedGroup
    slots: torch.Tensor
    buffers: ChunkBuffers
    rows: ChunkRows
    chunk_offset: int
    store: bool

    @property
    def layout(self) -> ChunkLayout:
        return self.rows.layout

    @property
    def num_chunks(self) -> int:
        return len(self.buffers)


def resolve_chunk_batch(
    slots: torch.Tensor,
    chunks: ChunkBuffers | Sequence[torch.Tensor],
    rows: ChunkRows,
    *,
    store: bool,
    chunk_offset: int = 0,
) -> ResolvedChunkBatch:
    """Check a multi-chunk launch of `rows.group` against the contract; raise TransferError naming the bad input.

    `chunks`: `chunk_buffers` of the chunks (checked once for every group of a call), or
    the flat uint8 tensors themselves; on the group's device or, with CUDA caches, in
    pinned host memory the kernel reaches through unified addressing. One slot tensor
    serves every plane and chunk (`rows.starts` index into it). Per call only scalars
    are compared: `rows` was checked when it was made.
    """
    if not isinstance(rows, ChunkRows):
        raise TransferError(f"rows is a {type(rows).__name__}; allowed: ChunkRows (see chunk_rows)")
    group = rows.group
    if not isinstance(store, bool):
        raise TransferError(f"store={store!r} is not allowed; allowed: True (paged -> chunk) or False")
    if not isinstance(chunks, ChunkBuffers):
        chunks = chunk_buffers(chunks)
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous():
        raise TransferError(f"slots={getattr(slots, 'shape', slots)!r}: allowed: a contiguous 1-D int64 tensor")
    if not group.on_group_device(slots):
        raise TransferError(f"slots are on {slots.device} but the caches are on {group.device}")
    if len(chunks) != rows.num_chunks:
        raise TransferError(
            f"{len(chunks)} chunks but rows for {rows.num_chunks} chunks (chunks, planes) = {rows.starts.shape}; "
            "they must match"
        )
    _non_negative_int("chunk_offset", chunk_offset)
    if len(chunks):
        if rows.slots_needed > slots.numel():
            beyond = rows.starts + rows.counts > slots.numel()
            chunk, plane = np.argwhere(beyond)[0]
            raise TransferError(
                f"chunk {chunk} plane {plane}: start={rows.starts[chunk, plane]} + count={rows.counts[chunk, plane]} "
                f"exceeds the {slots.numel()} slots"
            )
        if chunks.min_bytes < chunk_offset + rows.layout.total_bytes:
            raise TransferError(
                f"a chunk holds {chunks.min_bytes} bytes but chunk_offset={chunk_offset} + the group's "
                f"{rows.layout.total_bytes} bytes do not fit"
            )
        if chunks.mapped_host:
            if group.device.type != "cuda":
                raise TransferError(
                    f"the chunks are pinned host memory but the caches are on {group.device}; allowed: host "
                    "chunks with CUDA caches only (unified addressing)"
                )
        elif not group.on_group_device(chunks.keep_alive[0]):
            raise TransferError(
                f"the chunks are on {chunks.keep_alive[0].device} but the caches are on {group.device}; allowed: "
                "the caches' device, or pinned host memory with CUDA caches"
            )
    return ResolvedChunkBatch(group=group, slots=slots, buffers=chunks, rows=rows, chunk_offset=chunk_offset,
                              store=store)
