"""A transfer's per-call inputs checked against the contract: slots, chunk buffers, rows, batches.

Pure logic: torch and numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.kernels.paged import PagedGroup
from lmcache_ascend.kernels.same_layout import SameLayout
from lmcache_ascend.kernels.spec import (
    DEFAULT_REGION_ALIGNMENT,
    ChunkRegions,
    INT32_LIMIT,
    TransferError,
    non_negative_int,
    positive_int,
)

__all__ = [
    "ChunkBuffers",
    "ChunkRows",
    "PlaneSlots",
    "ResolvedChunkBatch",
    "ResolvedTransfer",
    "chunk_buffers",
    "chunk_rows",
    "pool_chunk_buffers",
    "resolve_chunk_batch",
    "resolve_chunk_batches",
    "resolve_transfer",
]


@dataclass(frozen=True)
class PlaneSlots:
    """Which paged rows one plane moves for one chunk.

    Chunk row t (0 <= t < count) <-> paged slot `slots[start + t]`. Slots < 0
    (vLLM's -1, or the null block) or >= num_blocks * block_size are skipped
    in both directions. `region_rows` (default `count`) sizes the plane's region
    in the chunk, so a partial last chunk can keep the full-chunk layout.
    `rows_per_id` n > 1: `slots` holds block ids of n slots each, and `start` and
    `count` number their rows (row r: slot `slots[r // n] * n + r % n`).
    """

    slots: torch.Tensor
    start: int = 0
    count: int | None = None
    region_rows: int | None = None
    rows_per_id: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.slots, torch.Tensor):
            raise TransferError(f"slots is a {type(self.slots).__name__}; allowed: a 1-D int64 torch.Tensor")
        positive_int("rows_per_id", self.rows_per_id)
        non_negative_int("start", self.start)
        if self.count is None:
            object.__setattr__(self, "count", max(self.slots.numel() * self.rows_per_id - self.start, 0))
        non_negative_int("count", self.count)
        if self.region_rows is None:
            object.__setattr__(self, "region_rows", self.count)
        non_negative_int("region_rows", self.region_rows)


@dataclass(frozen=True)
class ResolvedTransfer:
    """A validated launch: what every backend consumes."""

    group: PagedGroup
    slots: tuple[PlaneSlots, ...]
    chunk_bytes: torch.Tensor  # flat uint8 view of the whole chunk buffer
    chunk_offset: int  # where this group's part starts, in bytes
    regions: ChunkRegions
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


def _check_regions(group: PagedGroup, slots: tuple[PlaneSlots, ...], regions: ChunkRegions) -> None:
    if not isinstance(regions, ChunkRegions):
        raise TransferError(f"layout is a {type(regions).__name__}; allowed: ChunkRegions")
    row_bytes = tuple(plane.row_bytes for plane in group.planes)
    if regions.row_bytes != row_bytes or regions.layer_count != group.layer_count:
        raise TransferError(
            f"layout has row_bytes {regions.row_bytes} x {regions.layer_count} layers but the group has "
            f"{row_bytes} x {group.layer_count}; they must match"
        )
    for index, plane_slots in enumerate(slots):
        if regions.region_rows[index] < plane_slots.count:
            raise TransferError(
                f"slots[{index}]: count={plane_slots.count} > layout region_rows={regions.region_rows[index]}; "
                "the region must hold every moved row"
            )
        if regions.plane_region_bytes[index] >= INT32_LIMIT:
            raise TransferError(
                f"plane {index}: a region of {regions.plane_region_bytes[index]} bytes; allowed: below 2**31 bytes"
            )


def _check_plane_slots(group: PagedGroup, index: int, plane_slots: PlaneSlots, first: PlaneSlots) -> None:
    """One plane's slot array against the contract (and against plane 0's, `first`)."""
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
    rows = tensor.numel() * plane_slots.rows_per_id
    if plane_slots.start + plane_slots.count > rows:
        raise TransferError(
            f"slots[{index}]: start={plane_slots.start} + count={plane_slots.count} exceeds its "
            + (f"{rows} entries" if plane_slots.rows_per_id == 1 else
               f"{rows} rows ({tensor.numel()} block ids of {plane_slots.rows_per_id} rows)")
        )
    if plane_slots.rows_per_id > 1 and rows >= INT32_LIMIT:
        raise TransferError(
            f"slots[{index}]: {tensor.numel()} block ids of {plane_slots.rows_per_id} rows; allowed: fewer "
            "than 2**31 rows in all"
        )
    if plane_slots.rows_per_id != first.rows_per_id:
        raise TransferError(
            f"slots[{index}] has rows_per_id={plane_slots.rows_per_id} but slots[0] has "
            f"{first.rows_per_id}; allowed: one kind of slot array per transfer"
        )
    if plane_slots.rows_per_id > 1 and plane_slots.count and tensor.data_ptr() != first.slots.data_ptr():
        raise TransferError(
            f"slots[{index}] holds block ids in another tensor than slots[0]; allowed: one block id "
            "tensor for every plane"
        )
    if plane_slots.region_rows * group.planes[index].row_bytes >= INT32_LIMIT:
        raise TransferError(
            f"slots[{index}]: region_rows={plane_slots.region_rows} x row_bytes="
            f"{group.planes[index].row_bytes} is 2 GiB or more; allowed: a region below 2**31 bytes"
        )
    if plane_slots.region_rows < plane_slots.count:
        raise TransferError(
            f"slots[{index}]: region_rows={plane_slots.region_rows} < count={plane_slots.count}; "
            "the region must hold every moved row"
        )


def resolve_transfer(
    group: PagedGroup,
    slots: Sequence[PlaneSlots],
    chunk: torch.Tensor,
    *,
    store: bool,
    chunk_offset: int = 0,
    alignment: int = DEFAULT_REGION_ALIGNMENT,
    regions: ChunkRegions | None = None,
) -> ResolvedTransfer:
    """Check a launch against the contract; raise TransferError naming the bad input.

    `layout` (default: the group's packed layout for the slots' region rows at
    `alignment`) places the regions in the chunk, e.g. a `strided_chunk_regions`.
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
        _check_plane_slots(group, index, plane_slots, slots[0])
    chunk_bytes = _chunk_as_bytes(chunk)
    if not group.on_group_device(chunk_bytes):
        raise TransferError(
            f"chunk is on {chunk_bytes.device} but the caches are on {group.device}; "
            "all tensors of a transfer must be on one device"
        )
    non_negative_int("chunk_offset", chunk_offset)
    if regions is None:
        regions = group.chunk_regions([s.region_rows for s in slots], alignment)
    else:
        _check_regions(group, slots, regions)
    if chunk_offset + regions.total_bytes > chunk_bytes.numel():
        raise TransferError(
            f"chunk holds {chunk_bytes.numel()} bytes but chunk_offset={chunk_offset} + the group's "
            f"{regions.total_bytes} bytes ({regions.layer_count} layers x {regions.layer_stride}) do not fit"
        )
    return ResolvedTransfer(
        group=group,
        slots=slots,
        chunk_bytes=chunk_bytes,
        chunk_offset=chunk_offset,
        regions=regions,
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
    if chunk.device != first.device or (mapped_host and not chunk.is_pinned()):
        return (
            f"chunks[{index}] is on {chunk.device} (pinned: {chunk.is_cpu and chunk.is_pinned()}) but chunks[0] "
            f"is on {first.device} (pinned: {mapped_host}); all chunks of a batch must lie alike"
        )
    return None


_dtype_of = attrgetter("dtype")
_device_of = attrgetter("device")

# A call's chunks are most often buffers of one size (LMCache's memory objects of full chunks): they
# are checked against the first in one C++ call, by (count, bytes, device); bounded (docs/hot-path.md).
_alike_chunks: BoundedCache[SameLayout] = BoundedCache(64)


def _alike_flat_bytes(chunks: Sequence[object]) -> bool:
    """Whether `chunks` (a non-empty sequence) are plain contiguous flat uint8 tensors, all of the
    first one's size and device: one C++ check of them all (`SameLayout`), kept per (count, size,
    device). False says only that they are not all alike."""
    first = chunks[0]
    if type(first) is not torch.Tensor or first.dtype is not torch.uint8 or first.stride() != (1,):
        return False
    key = (len(chunks), first.numel(), first.device)
    same = _alike_chunks.get(key)
    if same is None:
        same = _alike_chunks.put(key, SameLayout(first, key[0]))
    return same(chunks)


def chunk_buffers(chunks: Sequence[torch.Tensor], *, mapped: bool = True) -> ChunkBuffers:
    """Check flat uint8 chunk buffers once: contiguous, one placement (one device, or pinned host).

    `mapped=False`: host chunks that kernels will not reach (they are copied, e.g. through
    staging) need not be pinned, and are not marked `mapped_host`.

    A request has tens of chunks, checked on every call: chunks of one size are compared
    with the first in one C++ call (`SameLayout`); others have each property read for all
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
    if _alike_flat_bytes(chunks) and (not mapped_host or all(map(Tensor.is_pinned, chunks))):
        addresses = np.fromiter(map(Tensor.data_ptr, chunks), dtype=np.int64, count=count)
        size = first.numel()
        return ChunkBuffers(chunks, addresses, np.full(count, size, dtype=np.int64), size, mapped_host,
                            _address_gcd(addresses))
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
    non_negative_int("chunk_bytes", chunk_bytes)
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
    regions: ChunkRegions
    starts: np.ndarray  # int64 [chunks, planes]
    counts: np.ndarray  # int64 [chunks, planes]
    slots_needed: int  # the slot tensor must hold at least this many entries
    max_region_bytes: int  # the most bytes one (chunk, layer, plane) region moves

    @property
    def num_chunks(self) -> int:
        return len(self.starts)


def chunk_rows(group: PagedGroup, regions: ChunkRegions, starts: np.ndarray, counts: np.ndarray) -> ChunkRows:
    """Check per-chunk rows of a multi-chunk launch against `group` and `layout`; raise TransferError naming them."""
    if not isinstance(group, PagedGroup):
        raise TransferError(f"group is a {type(group).__name__}; allowed: PagedGroup")
    _check_regions(group, (), regions)
    starts = np.array(starts, dtype=np.int64)  # copies: the caller's arrays may change, these may not
    counts = np.array(counts, dtype=np.int64)
    if starts.ndim != 2 or starts.shape != counts.shape or starts.shape[1] != group.plane_count:
        raise TransferError(
            f"starts {starts.shape} / counts {counts.shape}: allowed: (chunks, planes) with planes = "
            f"{group.plane_count}"
        )
    if (starts < 0).any() or (counts < 0).any():
        raise TransferError("starts and counts must be >= 0")
    region_rows = np.asarray(regions.region_rows, dtype=np.int64)
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
    return ChunkRows(group, regions, starts, counts, slots_needed, max_region_bytes)


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
    rows_per_id: int = 1  # > 1: `slots` holds block ids of this many slots each (see `PlaneSlots`)

    @property
    def regions(self) -> ChunkRegions:
        return self.rows.regions

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
    rows_per_id: int = 1,
) -> ResolvedChunkBatch:
    """Check a multi-chunk launch of `rows.group` against the contract; raise TransferError naming the bad input.

    `chunks`: `chunk_buffers` of the chunks (checked once for every group of a call), or
    the flat uint8 tensors themselves; on the group's device or, with CUDA caches, in
    pinned host memory the kernel reaches through unified addressing. One slot tensor
    serves every plane and chunk (`rows.starts` index into its rows); `rows_per_id` > 1:
    it holds block ids (see `PlaneSlots`). Per call only scalars are compared: `rows`
    was checked when it was made.
    """
    return resolve_chunk_batches(slots, chunks, ((rows, chunk_offset),), store=store, rows_per_id=rows_per_id)[0]


def resolve_chunk_batches(
    slots: torch.Tensor,
    chunks: ChunkBuffers | Sequence[torch.Tensor],
    parts: Sequence[tuple[ChunkRows, int]],
    *,
    store: bool,
    rows_per_id: int = 1,
) -> list[ResolvedChunkBatch]:
    """`resolve_chunk_batch` for the layer groups of one call, each (rows, chunk offset) of `parts`
    over the same slots and chunks: what they share (the slot tensor, the chunks' placement and
    count) is checked once, then each group's needs (its device, slots and bytes) are compared."""
    if not isinstance(store, bool):
        raise TransferError(f"store={store!r} is not allowed; allowed: True (paged -> chunk) or False")
    if not isinstance(chunks, ChunkBuffers):
        chunks = chunk_buffers(chunks)
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous():
        raise TransferError(f"slots={getattr(slots, 'shape', slots)!r}: allowed: a contiguous 1-D int64 tensor")
    positive_int("rows_per_id", rows_per_id)
    slot_rows = slots.numel() * rows_per_id
    if rows_per_id > 1 and len(chunks) and slot_rows >= INT32_LIMIT:
        raise TransferError(f"{slots.numel()} block ids of {rows_per_id} rows; allowed: fewer than 2**31 rows in all")
    resolved = []
    checked_group = None  # the groups of a call share a device: it is compared once
    for rows, chunk_offset in parts:
        if not isinstance(rows, ChunkRows):
            raise TransferError(f"rows is a {type(rows).__name__}; allowed: ChunkRows (see chunk_rows)")
        group = rows.group
        if checked_group is None or (group is not checked_group and group.device != checked_group.device):
            _check_placement(group, slots, chunks)
            checked_group = group
        if len(chunks) != rows.num_chunks:
            raise TransferError(
                f"{len(chunks)} chunks but rows for {rows.num_chunks} chunks (chunks, planes) = {rows.starts.shape}; "
                "they must match"
            )
        non_negative_int("chunk_offset", chunk_offset)
        if len(chunks):
            if rows.slots_needed > slot_rows:
                beyond = rows.starts + rows.counts > slot_rows
                chunk, plane = np.argwhere(beyond)[0]
                raise TransferError(
                    f"chunk {chunk} plane {plane}: start={rows.starts[chunk, plane]} + count="
                    f"{rows.counts[chunk, plane]} exceeds the {slot_rows} slots"
                )
            if chunks.min_bytes < chunk_offset + rows.regions.total_bytes:
                raise TransferError(
                    f"a chunk holds {chunks.min_bytes} bytes but chunk_offset={chunk_offset} + the group's "
                    f"{rows.regions.total_bytes} bytes do not fit"
                )
        resolved.append(ResolvedChunkBatch(group=group, slots=slots, buffers=chunks, rows=rows,
                                           chunk_offset=chunk_offset, store=store, rows_per_id=rows_per_id))
    return resolved


def _check_placement(group: PagedGroup, slots: torch.Tensor, chunks: ChunkBuffers) -> None:
    """The slots on `group`'s device, the chunks there too or in host memory its kernels reach."""
    if not group.on_group_device(slots):
        raise TransferError(f"slots are on {slots.device} but the caches are on {group.device}")
    if not len(chunks):
        return
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
