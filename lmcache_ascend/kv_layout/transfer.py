"""Move chunks between vLLM's paged caches (every layer group) and their flat buffers.

Glue between the chunk plan and the kernels. A request's slot mappings are made
on the device once, from the block ids the scheduler shipped (`DeviceSlots`:
every scheduler group's slots in one tensor, the cached prefix of a load already
masked); a chunk then only picks rows of it
(`chunk_row_window`: compressed groups ``ceil(tokens / ratio)`` rows,
sliding-window groups only their tail). `ChunkMover.move` moves one chunk with
one launch per layer group; `ChunkMover.move_batch` moves many full chunks of every
layer group with one launch (Triton; the torch reference counts one per layer group).

Pure logic: torch, numpy and lmcache_ascend only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence, Union

import numpy as np
import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.kernels import (
    ChunkBuffers,
    ChunkRows,
    PagedGroup,
    PagedPlane,
    PlaneSlots,
    align_up,
    chunk_buffers,
    chunk_rows,
    pool_chunk_buffers,
    resolve_chunk_batch,
    transfer_chunk_batches,
    transfer_group,
)
from lmcache_ascend.kv_layout.chunk_plan import ChunkPlanner
from lmcache_ascend.kv_layout.formats import LayoutError
from lmcache_ascend.multigroup.slots import StepBlockIds
from lmcache_ascend.multigroup.specs import KVGroupSpec, cached_row_count, chunk_row_window
from lmcache_ascend.multigroup.tracker import NULL_BLOCK_ID

__all__ = ["STAGING_BYTES", "ChunkMover", "DeviceSlots", "staging_waves"]

# Host chunks reach a device's caches through a device staging buffer, in waves whose
# copies run beside the next wave's kernels. (Kernels reading CUDA pinned memory in
# place measured slower than staging on H100 in every case of docs/design-decisions.md,
# and staging serves every device.)
# Device staging for host chunks: at most this many bytes (at least one chunk).
STAGING_BYTES = 256 * 2**20
_STAGING_ALIGNMENT = 256
# Chunks in the first staging wave; each later wave doubles, up to half the staging buffer.
# The copies are the bottleneck and the kernels take microseconds per chunk, so the first
# wave is not the smallest: a store's first copies wait for its launches whatever its size,
# and then outlast the host's issue of the next wave; a load's first two waves are queued
# at once and keep the copy engine busy while the host resolves the slots and launches the
# first wave (H100: with 2 chunks first, the copy engine waited for the host 150-500 us).
FIRST_WAVE_CHUNKS = 4
# Bound of each cache of per-request-shape values (chunk rows by chunk bounds and slot layout):
# see docs/hot-path.md.
_MAX_CACHED_ROWS = 64


def staging_waves(chunks: int, capacity: int, first: int = FIRST_WAVE_CHUNKS) -> list[tuple[int, int]]:
    """[begin, end) chunk ranges of the staging waves: `first` chunks, then doubling, at most `capacity` each."""
    if capacity < 1 or first < 1:
        raise LayoutError(f"capacity={capacity} and first={first} must be >= 1")
    waves = []
    begin, size = 0, min(first, capacity)
    while begin < chunks:
        end = min(begin + size, chunks)
        waves.append((begin, end))
        begin, size = end, min(2 * size, capacity)
    return waves


def _device_module(device: torch.device):
    """torch.cuda / torch.npu for a device with streams and events; None for the CPU."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "Stream") else None


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(host)
    if device.type == "cuda":
        # Through pinned memory the copy does not hold the host up; the caching host
        # allocator keeps the pinned block until the copy has run.
        return tensor.pin_memory().to(device, non_blocking=True)
    if device.type != "cpu":
        return tensor.to(device)
    return tensor


def _expand_block_ids(block_ids: np.ndarray, groups: Sequence[tuple[int, int, int, int, int, int]], out: np.ndarray) -> None:
    """Write every group's slots into `out` from `block_ids` (int64 numpy arrays).

    Per group (first output row, rows, first block, blocks, rows per block, cached rows): -1
    over vLLM's cached prefix; from the first block past it, its whole blocks broadcast
    against the row offsets of a block straight into `out`, ``block_id * rows_per_block +
    offset``, and the rows of a last, partly used block; -1 for every row of vLLM's null block.
    """
    for first_row, num_rows, first_block, num_blocks, rows_per_block, cached_rows in groups:
        ids = block_ids[first_block : first_block + num_blocks]
        whole = num_rows // rows_per_block
        computed = min(cached_rows // rows_per_block, whole)  # blocks wholly cached are not computed
        rows = out[first_row + computed * rows_per_block : first_row + whole * rows_per_block].reshape(
            whole - computed, rows_per_block
        )
        np.add(ids[computed:whole, None] * rows_per_block, np.arange(rows_per_block, dtype=np.int64), out=rows)
        null = ids[computed:whole] == NULL_BLOCK_ID
        if np.count_nonzero(null):
            rows[null] = -1
        rest = num_rows - whole * rows_per_block
        if rest:
            last = int(ids[whole])
            out[first_row + whole * rows_per_block : first_row + num_rows] = (
                -1 if last == NULL_BLOCK_ID else last * rows_per_block + np.arange(rest, dtype=np.int64)
            )
        if cached_rows:
            out[first_row : first_row + cached_rows] = -1


@dataclass(frozen=True)
class _ExpansionPlan:
    """Where one request's slots go in its share of the expansion (see `_expand_block_ids`)."""

    groups: list  # per group: (first row, rows, first block, blocks, rows per block, cached rows)
    offsets: dict
    lengths: dict
    rows: int


def _expansion_plan(step: StepBlockIds, groups: Mapping[int, KVGroupSpec], cached_tokens: int) -> _ExpansionPlan:
    """Check `step`'s groups against the registered `groups` and lay its rows out, group after group."""
    plan = []
    offsets: dict[int, int] = {}
    lengths: dict[int, int] = {}
    rows_total = 0
    blocks_total = 0
    for group, count in step.group_block_counts().items():
        spec = groups.get(group)
        if spec is None:
            raise LayoutError(
                f"block ids were given for scheduler group {group}, which is not among the registered "
                f"groups {sorted(groups)}"
            )
        shipped = step.groups[group]
        if (spec.block_size, spec.compress_ratio, spec.sliding_window) != (
            shipped.block_size, shipped.compress_ratio, shipped.sliding_window
        ):
            raise LayoutError(
                f"scheduler group {group}: the scheduler's block ids are for {shipped} but the registered "
                f"caches have {spec}; block size, compress ratio and sliding window must agree"
            )
        num_rows = spec.num_rows(step.num_tokens)
        plan.append((rows_total, num_rows, blocks_total, count, spec.rows_per_block,
                     cached_row_count(spec, cached_tokens, num_rows)))
        offsets[group], lengths[group] = rows_total, num_rows
        rows_total += num_rows
        blocks_total += count
    return _ExpansionPlan(plan, offsets, lengths, rows_total)


def _request_name(key: Hashable) -> str:
    request = key[0] if isinstance(key, tuple) and key else key
    return "a request" if request is None else f"request {request!r}"


def _check_block_ids(key: Hashable, block_ids: np.ndarray, plan: _ExpansionPlan, block_counts: Mapping[int, int],
                     fewest: int) -> None:
    """Refuse a block id outside its group's cache (negative, past the end, or wrapping in the
    slot arithmetic) before any row is resolved.

    One min and one max over the request's ids; the groups are only looked at one by one when
    those leave the range every group's cache has (`fewest` blocks).
    """
    if not len(block_ids):
        return
    if block_ids.min() >= 0 and block_ids.max() < fewest:
        return
    for group, (_, _, first_block, count, _, _) in zip(plan.offsets, plan.groups):
        limit = block_counts.get(group)
        if limit is None:
            continue
        ids = block_ids[first_block : first_block + count]
        bad = np.flatnonzero((ids < 0) | (ids >= limit))
        if len(bad):
            raise LayoutError(
                f"{_request_name(key)}, KV-cache group {group}: block id {int(ids[bad[0]])} (position {int(bad[0])} "
                f"of its {count}) is not a block of this worker's cache, which has {limit} blocks "
                f"(allowed ids 0..{limit - 1}); nothing was moved"
            )


def _check_slots(request: object, group: int, slots: np.ndarray, rows: int | None) -> None:
    """Refuse a slot outside the group's cache rows (-1 means "skip") before anything moves."""
    if rows is None or not len(slots):
        return
    low, high = int(slots.min()), int(slots.max())
    if low >= -1 and high < rows:
        return
    position = int(np.flatnonzero((slots < -1) | (slots >= rows))[0])
    raise LayoutError(
        f"{_request_name(request)}, KV-cache group {group}: slot {int(slots[position])} (position {position}) "
        f"is not a row of this worker's cache, which has {rows} rows (allowed: -1 to skip, 0..{rows - 1}); "
        "nothing was moved"
    )


@dataclass(frozen=True)
class DeviceSlots:
    """The slot mappings of one request (or one call) on the caches' device, in ONE int64 tensor.

    Scheduler group g's slots are ``slots[offsets[g] : offsets[g] + lengths[g]]``.
    Made by `DeviceSlots.from_block_ids` (a request's block ids, expanded on the
    host) or `DeviceSlots.upload` (slot mappings given whole): one host-to-device copy.
    """

    slots: torch.Tensor
    offsets: Mapping[int, int]
    lengths: Mapping[int, int]

    @classmethod
    def from_block_ids(
        cls,
        step: StepBlockIds,
        groups: Mapping[int, KVGroupSpec],
        device: torch.device,
        cached_tokens: int = 0,
        block_counts: Mapping[int, int] | None = None,
        request: Hashable = None,
    ) -> "DeviceSlots":
        """The slots of every transferred group of `step`, on `device`, from its block ids.

        Row r of group g has slot ``block_id * rows_per_block + r % rows_per_block`` with
        ``block_id = ids_g[r // rows_per_block]``; -1 on vLLM's null block and on the rows
        of vLLM's cached prefix (`cached_row_count` of `cached_tokens`; 0 for a store).
        `groups` are the registered groups: each transferred group must be among them
        with the geometry the scheduler used. `block_counts` (group -> blocks of the worker's
        cache): an id outside them is refused, naming `request`, before anything moves.
        """
        return cls.for_requests({request: (step, cached_tokens)}, groups, device, block_counts)[request]

    @classmethod
    def for_requests(
        cls,
        requests: Mapping[Hashable, tuple[StepBlockIds, int]],
        groups: Mapping[int, KVGroupSpec],
        device: torch.device,
        block_counts: Mapping[int, int] | None = None,
    ) -> dict[Hashable, "DeviceSlots"]:
        """`from_block_ids` of many (block ids, cached tokens) at once: key -> its `DeviceSlots`.

        Every request is expanded on the host group by group (`_expand_block_ids`, a few
        numpy ops per group) into ONE array, copied to `device` at once; each request's
        slots are a view of it (one entry at least: an empty tensor may have no address
        for the kernels to anchor on). On an H100 the same expansion as torch ops on the
        device took 0.7-2.2 ms of launches per request, several times the copy of its
        result (scripts/bench_slot_resolution.py --device cuda, docs/design-decisions.md).
        `block_counts`: see `from_block_ids`; every request is checked before any is expanded.
        """
        if not requests:
            return {}
        plans = {key: _expansion_plan(step, groups, cached_tokens) for key, (step, cached_tokens) in requests.items()}
        if block_counts:
            fewest = min(block_counts.values())
            for key, plan in plans.items():
                _check_block_ids(key, requests[key][0].block_ids, plan, block_counts, fewest)
        bounds, cursor = {}, 0
        for key, plan in plans.items():
            bounds[key] = (cursor, cursor + max(plan.rows, 1))
            cursor = bounds[key][1]
        host = np.full(cursor, -1, dtype=np.int64)
        for key, plan in plans.items():
            begin = bounds[key][0]
            _expand_block_ids(requests[key][0].block_ids, plan.groups,
                              host[begin : begin + plan.rows])
        joined = _to_device(host, device)
        return {key: cls(joined[slice(*bounds[key])], plan.offsets, plan.lengths) for key, plan in plans.items()}

    @classmethod
    def upload(
        cls,
        slot_mappings: Mapping[int, object],
        groups: Mapping[int, KVGroupSpec],
        device: torch.device,
        cached_tokens: int = 0,
        slot_rows: Mapping[int, int] | None = None,
        request: Hashable = None,
    ) -> "DeviceSlots":
        """Concatenate `slot_mappings` (group -> 1-D ints), mask the rows of vLLM's cached
        prefix (`cached_row_count`; 0 for a store) and copy them to `device` at once.

        `slot_rows` (group -> rows of the worker's cache): a slot outside them (or below -1)
        is refused, naming `request` and the group, before anything moves."""
        parts = []
        offsets: dict[int, int] = {}
        lengths: dict[int, int] = {}
        cursor = 0
        for group, slots in slot_mappings.items():
            if slots is None:
                continue
            group = int(group)
            spec = groups.get(group)
            if spec is None:
                raise LayoutError(
                    f"a slot mapping was given for scheduler group {group}, which is not among the registered "
                    f"groups {sorted(groups)}"
                )
            host = slots.detach().cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots)
            if host.ndim != 1:
                raise LayoutError(f"slot mapping of scheduler group {group} has shape {host.shape}; allowed: 1-D")
            host = host.astype(np.int64, copy=True)
            if slot_rows is not None:
                _check_slots(request, group, host, slot_rows.get(group))
            masked = cached_row_count(spec, cached_tokens, len(host))
            host[:masked] = -1
            parts.append(host)
            offsets[group], lengths[group] = cursor, len(host)
            cursor += len(host)
        joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        # One entry at least: an empty tensor may have no address for the kernels to anchor on.
        if not len(joined):
            joined = np.full(1, -1, dtype=np.int64)
        return cls(_to_device(joined, device), offsets, lengths)


# What `ChunkMover.move_chunks` takes as a call's slots: made already, group -> slot mapping
# (uploaded there), or a function giving either (called once, when the slots are first needed).
SlotsSource = Union[DeviceSlots, Mapping[int, object], Callable[[], Union[DeviceSlots, Mapping[int, object]]]]


class ChunkMover:
    """Stores / loads chunks of one registered set of KV caches."""

    def __init__(self, layout: ChunkPlanner, backend: str | None = None):
        self.layout = layout
        self.backend = backend
        # Built once: the kernels validate and cache each tensor's geometry here.
        # Planes come in the kernels' block form already (see `PlaneLayout.kernel_block_rows`).
        self.paged_groups = tuple(
            PagedGroup(
                tuple(
                    PagedPlane(
                        tuple(member_rows[plane] for member_rows in group.paged_rows),
                        block_size=identity.kernel_block_rows,
                        row_bytes=identity.row_bytes,
                        name=f"group{group.index}.plane{plane}",
                    )
                    for plane, identity in enumerate(group.planes)
                )
            )
            for group in layout.layer_groups
        )
        # Per scheduler group, the rows and blocks every one of its caches has: ids and slots
        # beyond them are refused before anything moves (`DeviceSlots`).
        rows: dict[int, int] = {}
        for group in layout.layer_groups:
            for planes in group.plane_layouts:
                for plane in planes:
                    rows[plane.scheduler_group] = min(rows.get(plane.scheduler_group, plane.num_rows), plane.num_rows)
        self.slot_rows: dict[int, int] = rows
        self.block_counts: dict[int, int] = {
            g: count // layout.geometry_by_group[g].rows_per_block for g, count in rows.items()
        }
        self._staging: torch.Tensor | None = None
        # Per (chunks, STAGING_BYTES) of a staged call: (buffer, chunk stride, halves, half bytes, waves);
        # emptied with the buffer.
        self._staging_shapes: BoundedCache[tuple] = BoundedCache(_MAX_CACHED_ROWS)
        self._stream_module = _device_module(self.device)
        self._copy_stream = None
        self._staging_released = None  # an event after the last staged call's work on the buffer
        self._windows: BoundedCache[tuple] = BoundedCache(_MAX_CACHED_ROWS)
        self._rows: BoundedCache[tuple] = BoundedCache(_MAX_CACHED_ROWS)
        # The staging buffer's chunks at a wave's offsets (`pool_chunk_buffers`), by offsets: requests of
        # one shape whose host chunks lie alike (one allocation) use the same few; emptied with the buffer.
        self._staged_chunks: BoundedCache[ChunkBuffers] = BoundedCache(_MAX_CACHED_ROWS)

    @property
    def device(self) -> torch.device:
        return self.paged_groups[0].device

    def upload(self, slot_mappings: Mapping[int, object], cached_tokens: int = 0, request: Hashable = None) -> DeviceSlots:
        """`DeviceSlots` of these slot mappings on the caches' device (slots outside the caches refused)."""
        return DeviceSlots.upload(
            slot_mappings, self.layout.geometry_by_group, self.device, cached_tokens, self.slot_rows, request
        )

    def plane_rows(self, slots: DeviceSlots, starts: np.ndarray, ends: np.ndarray):
        """Per layer group, (first slot index, row count) arrays [chunks, planes] of the chunks [starts, ends).

        The first slot index points into `slots.slots`: the group's offset plus the
        chunk's row window (`chunk_row_window`). The windows depend on the chunk
        bounds alone: worked out for all chunks at once, and remembered for the
        bounds of recent calls (requests of one length share them).
        """
        key = (starts.tobytes(), ends.tobytes())
        per_layer_group, rows_needed = self._windows.get_or_build(key, lambda: self._row_windows(starts, ends))
        for scheduler_group, needed in rows_needed.items():
            length = slots.lengths.get(scheduler_group)
            if length is None:
                raise LayoutError(
                    f"no slot mapping for scheduler group {scheduler_group}; got slot mappings for groups "
                    f"{sorted(slots.offsets)}"
                )
            if needed > length:
                raise LayoutError(
                    f"slot mapping of scheduler group {scheduler_group} has {length} entries; tokens "
                    f"[{starts.min()}, {ends.max()}) need {needed} rows"
                )
        return [
            (firsts + np.asarray([slots.offsets[g] for g in plane_groups], dtype=np.int64)[None, :], counts)
            for plane_groups, firsts, counts in per_layer_group
        ]

    def _row_windows(self, starts: np.ndarray, ends: np.ndarray):
        windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        rows_needed: dict[int, int] = {}
        for scheduler_group in self.layout.scheduler_groups_in_use():
            first, count = chunk_row_window(self.layout.geometry_by_group[scheduler_group], starts, ends)
            windows[scheduler_group] = (first, count)
            rows_needed[scheduler_group] = int((first + count).max()) if len(first) else 0
        per_layer_group = []
        for group in self.layout.layer_groups:
            plane_groups = tuple(identity.scheduler_group for identity in group.planes)
            firsts = np.stack([windows[g][0] for g in plane_groups], axis=1)
            counts = np.stack([windows[g][1] for g in plane_groups], axis=1)
            per_layer_group.append((plane_groups, firsts, counts))
        return per_layer_group, rows_needed

    def _device_slots(self, slots: DeviceSlots | Mapping[int, object]) -> DeviceSlots:
        return slots if isinstance(slots, DeviceSlots) else self.upload(slots)

    def move(
        self, chunk: torch.Tensor, start: int, end: int, slots: DeviceSlots | Mapping[int, object], *, store: bool
    ) -> int:
        """Store (paged -> chunk) or load tokens [start, end) for every layer group; returns launches.

        `slots`: `DeviceSlots`, or group -> slot mapping (uploaded here, for one-off calls).
        """
        slots = self._device_slots(slots)
        plan = self.layout.plan(end - start)
        if chunk.numel() * chunk.element_size() < plan.total_bytes:
            raise LayoutError(
                f"chunk buffer of {chunk.numel() * chunk.element_size()} bytes is smaller than the "
                f"{plan.total_bytes} bytes a {end - start}-token chunk needs"
            )
        launches = 0
        rows = self.plane_rows(slots, np.array([start], dtype=np.int64), np.array([end], dtype=np.int64))
        for paged_group, region, (firsts, counts) in zip(self.paged_groups, plan.regions, rows):
            if not counts.any():
                continue
            plane_slots = tuple(
                PlaneSlots(slots.slots, int(first), int(count), region_rows=region_rows)
                for first, count, region_rows in zip(firsts[0], counts[0], region.plane_rows)
            )
            transfer_group(
                paged_group, plane_slots, chunk, store=store, chunk_offset=region.byte_offset, backend=self.backend,
                layout=region.layout,
            )
            launches += 1
        return launches

    def batch_rows(self, slots: DeviceSlots, starts: Sequence[int]) -> tuple[tuple[PagedGroup, int, ChunkRows], ...]:
        """Per layer group that moves a row: (paged group, its byte offset in a chunk, the `ChunkRows` of the
        full chunks starting at `starts`), checked once and remembered for the chunk starts and slot layout
        of recent calls (requests of one length share them)."""
        key = (tuple(starts), tuple(slots.offsets.items()), tuple(slots.lengths.items()))
        return self._rows.get_or_build(key, lambda: self._batch_rows(slots, np.asarray(key[0], dtype=np.int64)))

    def _batch_rows(self, slots: DeviceSlots, starts: np.ndarray) -> tuple[tuple[PagedGroup, int, ChunkRows], ...]:
        rows = self.plane_rows(slots, starts, starts + self.layout.chunk_size)
        return tuple(
            (paged_group, region.byte_offset, chunk_rows(paged_group, region.layout, firsts, counts))
            for paged_group, region, (firsts, counts) in zip(self.paged_groups, self.layout.full_plan.regions, rows)
            if counts.any()
        )

    def move_batch(
        self,
        chunks: Sequence[torch.Tensor] | ChunkBuffers,
        starts: Sequence[int],
        slots: DeviceSlots | Mapping[int, object],
        *,
        store: bool,
    ) -> int:
        """Move full chunks (each `chunk_size` tokens from its start) of every layer group in one launch (Triton;
        the reference counts one per layer group); returns launches.

        `chunks` are flat uint8 buffers on the caches' device (or CUDA pinned host memory), or
        `ChunkBuffers` already checked. Per call: the chunks are checked once for every layer
        group; rows, tables and launch constants are looked up.
        """
        if not len(chunks):
            return 0
        slots = self._device_slots(slots)
        buffers = chunks if isinstance(chunks, ChunkBuffers) else chunk_buffers(chunks)
        batches = [
            resolve_chunk_batch(slots.slots, buffers, rows, store=store, chunk_offset=byte_offset)
            for _, byte_offset, rows in self.batch_rows(slots, starts)
        ]
        return transfer_chunk_batches(batches, backend=self.backend)

    def staging_buffer(self, chunks: int) -> tuple[torch.Tensor, int]:
        """(device staging buffer, bytes per chunk in it) for up to `chunks` full chunks (fewer where
        `STAGING_BYTES` is reached; one at least). Allocated once, grown on demand."""
        stride = align_up(self.layout.full_plan.total_bytes, _STAGING_ALIGNMENT)
        wanted = stride * max(1, min(chunks, STAGING_BYTES // stride))
        if self._staging is None or self._staging.numel() < wanted:
            self._staging = None  # the old buffer goes first: both may not fit
            self._staged_chunks.clear()
            self._staging_shapes.clear()
            self._staging = torch.empty(wanted, dtype=torch.uint8, device=self.device)
        return self._staging, stride

    def _staging_shape(self, chunks: int) -> tuple:
        """(buffer, chunk stride, halves, half bytes, waves) of a staged call of `chunks` full chunks."""
        staging, stride = self.staging_buffer(chunks)
        halves = 2 if self._stream_module is not None and staging.numel() >= 2 * stride else 1
        half_bytes = (staging.numel() // halves) // _STAGING_ALIGNMENT * _STAGING_ALIGNMENT
        return staging, stride, halves, half_bytes, staging_waves(chunks, max(1, half_bytes // stride))

    def reachable(self, chunks: Sequence[torch.Tensor]) -> bool:
        """Whether the kernels can address every chunk where it lies (else they are staged)."""
        device = self.device
        return device.type == "cpu" or all(chunk.device == device for chunk in chunks)

    def move_chunks(
        self,
        chunks: Sequence[torch.Tensor],
        starts: Sequence[int],
        slots: SlotsSource,
        *,
        store: bool,
    ) -> int:
        """`move_batch` for full chunks wherever they lie: on the caches' device directly, else
        through the staging buffer. Issues work only: the caller synchronizes.

        `slots` may also be a function giving them: it is called once, after every chunk is
        checked and, on a staged load, after the first waves' copies are queued (the copy
        engine starts while the host resolves the slots).

        Through staging a store copies whole chunks back, so bytes no row fills (region
        padding, skipped rows) are unspecified there, as the per-chunk staging always had it;
        chunks with skipped rows are never persisted (see `StepBlockIds.store_hole_chunks`).
        """
        if not len(chunks):
            return 0
        if chunks[0].is_cuda or self.reachable(chunks):
            # (chunks on the device: `chunk_buffers` checks that they all are, and on which one)
            buffers = chunk_buffers(chunks)
            return self.move_batch(buffers, starts, self._resolved_slots(slots), store=store)
        return self._move_staged(list(chunks), list(starts), slots, store=store)

    def _resolved_slots(self, slots: SlotsSource) -> DeviceSlots:
        return self._device_slots(slots() if callable(slots) else slots)

    def _move_staged(self, chunks: list[torch.Tensor], starts: list[int], slots: SlotsSource, *, store: bool) -> int:
        """Host chunks through the staging buffer in waves (`staging_waves`: a small first wave, then
        doubling), alternating between the buffer's halves, copies on a copy stream. A store's copies of
        wave k follow its kernels, which run beside wave k - 1's copies; a load's copies run one wave
        ahead: wave k + 1's copies are queued before wave k's launches (and the first waves' before the
        slots are resolved), so the copy engine does not wait for the host. Chunks lying back to back
        in one host allocation are copied as one span (on a store only where every byte of the span is
        the chunks' own).

        The first wave's host chunks are checked on their own and its work issued before the other
        chunks are checked (`_StagedWaves.check`): the copy engine starts that much earlier. A later
        chunk that fails its check raises with the first wave's copies queued; only checked chunks
        are ever written, and a failed store is not kept by LMCache.
        """
        module = self._stream_module
        staging, stride, halves, half_bytes, waves = self._staging_shapes.get_or_build(
            (len(chunks), STAGING_BYTES), lambda: self._staging_shape(len(chunks)))
        staged = _StagedWaves(chunks, starts, self.layout.full_plan.total_bytes, stride, store, staging,
                              self._staged_chunks, halves, half_bytes, waves)
        if module is None:  # no streams: in order on the host
            staged.check(len(chunks))
            resolved = self._resolved_slots(slots)
            launches = 0
            for index in range(len(staged.waves)):
                spans, buffers, wave_starts = staged.plan(index)
                if not store:
                    staged.copy(spans, to_staging=True)
                launches += self.move_batch(buffers, wave_starts, resolved, store=store)
                if store:
                    staged.copy(spans, to_staging=False)
            return launches
        staged.check(staged.waves[0][1])
        if self._copy_stream is None:
            self._copy_stream = module.Stream(device=self.device)
        compute = module.current_stream(self.device)
        copy = self._copy_stream
        if self._staging_released is not None:
            copy.wait_event(self._staging_released)  # the last staged call's kernels are done with the buffer
        try:
            if store:
                return self._staged_store(staged, self._resolved_slots(slots), module, compute, copy)
            return self._staged_load(staged, slots, module, compute, copy)
        finally:  # (also after a failed check: what was queued is ordered before the buffer's next use)
            compute.wait_stream(copy)
            self._staging_released = module.Event()
            self._staging_released.record(compute)

    def _staged_store(self, staged: "_StagedWaves", slots: DeviceSlots, module, compute, copy) -> int:
        """Each wave's launches, then its copies out once its kernels are done; a half is rewritten
        only after its last copies out."""
        released: list = [None] * staged.halves  # per half: the event after which it may be rewritten
        launches = 0
        for index in range(len(staged.waves)):
            spans, buffers, wave_starts = staged.plan(index)
            part = index % staged.halves
            if released[part] is not None:
                compute.wait_event(released[part])
            launches += self.move_batch(buffers, wave_starts, slots, store=True)
            written = module.Event()
            written.record(compute)
            copy.wait_event(written)
            with module.stream(copy):
                staged.copy(spans, to_staging=False)
            released[part] = module.Event()
            released[part].record(copy)
            staged.check(len(staged.chunks))  # (after the first wave's copies: a no-op from then on)
        return launches

    def _staged_load(self, staged: "_StagedWaves", slots: SlotsSource, module, compute, copy) -> int:
        """One wave per half copied in before the slots are resolved; then each wave's launches once its
        copies are in, followed by the copies of the wave that reuses its half once its kernels are done."""
        plans: dict[int, tuple] = {}
        loaded: dict[int, object] = {}
        released: list = [None] * staged.halves  # per half: the event after which it may be rewritten

        def queue_copies(index: int) -> None:
            plans[index] = plan = staged.plan(index)
            part = index % staged.halves
            if released[part] is not None:
                copy.wait_event(released[part])
            with module.stream(copy):
                staged.copy(plan[0], to_staging=True)
            loaded[index] = module.Event()
            loaded[index].record(copy)

        for index in range(min(staged.halves, len(staged.waves))):
            queue_copies(index)
            staged.check(len(staged.chunks))  # (after the first wave's copies: a no-op from then on)
        resolved = self._resolved_slots(slots)
        launches = 0
        for index in range(len(staged.waves)):
            _, buffers, wave_starts = plans.pop(index)
            compute.wait_event(loaded.pop(index))
            launches += self.move_batch(buffers, wave_starts, resolved, store=False)
            released[index % staged.halves] = module.Event()
            released[index % staged.halves].record(compute)
            if index + staged.halves < len(staged.waves):
                queue_copies(index + staged.halves)
        return launches


@dataclass
class _StagedWaves:
    """One staged call's host chunks, staging buffer and waves: what each wave copies where."""

    chunks: list[torch.Tensor]
    starts: list[int]
    total: int  # bytes of a full chunk
    stride: int  # bytes between chunks in the staging buffer
    store: bool
    staging: torch.Tensor
    staged_chunks: BoundedCache[ChunkBuffers]  # the mover's `_staged_chunks`
    halves: int  # wave k uses half k % halves
    half_bytes: int
    waves: list[tuple[int, int]]
    # The addresses of the host chunks [0, checked) (checked by `chunk_buffers`) and their
    # `_joined_neighbours`, as Python lists: a wave's bookkeeping is a few dozen integers, cheaper in
    # Python than in numpy calls, which cost several microseconds each on a host the bus transfer left cold.
    addresses: list[int] = field(default_factory=list)
    joined: list[bool] = field(default_factory=list)
    checked: int = 0

    def check(self, through: int) -> None:
        """Check the host chunks [0, through) unless they are: placement, layout and size (a full chunk)."""
        if through <= self.checked:
            return
        host = chunk_buffers(self.chunks[:through] if through < len(self.chunks) else self.chunks, mapped=False)
        if host.min_bytes < self.total:
            index = int(np.argmin(host.sizes))
            raise LayoutError(f"chunk {index} holds {host.min_bytes} bytes; a full chunk needs {self.total}")
        self.checked, self.addresses = through, host.addresses.tolist()
        self.joined = _joined_neighbours(self.addresses, host.sizes.tolist(), self.total, self.stride, self.store)

    def plan(self, index: int) -> tuple[list[tuple[int, int, int]], ChunkBuffers, list[int]]:
        """Wave `index`'s copies (spans), its chunks in the staging buffer and their starts."""
        begin, end = self.waves[index]
        if end > self.checked:
            raise AssertionError(f"wave {index} ends at chunk {end}, past the {self.checked} checked")
        spans, offsets = _staging_spans(self.addresses, self.joined, begin, end, self.total,
                                        (index % self.halves) * self.half_bytes)
        buffers = self.staged_chunks.get_or_build(
            offsets, lambda: pool_chunk_buffers(self.staging, np.array(offsets, dtype=np.int64), self.total))
        return spans, buffers, self.starts[begin:end]

    def copy(self, spans, *, to_staging: bool) -> None:
        _copy_spans(self.chunks, self.addresses, spans, self.total, self.staging, to_staging=to_staging)


def _joined_neighbours(addresses: list[int], sizes: list[int], total: int, stride: int, store: bool) -> list[bool]:
    """joined[i]: chunk i + 1 starts where one copy of chunk i's span can reach it ([chunks - 1]).

    Chunk i + 1 must begin at most `stride` bytes after chunk i (so a span fits the staging
    waves' byte budget) and not inside chunk i's `total` bytes. A store writes the whole span
    back, so there the bytes between must be chunk i's own (its tensor reaches them); a load
    only reads them into scratch staging. (`_copy_spans` copies a span at once only where it
    lies in one host allocation.)
    """
    return [
        total <= after - before <= stride and (not store or after - before <= size)
        for before, after, size in zip(addresses, addresses[1:], sizes)
    ]


def _staging_spans(addresses: list[int], joined: list[bool], begin: int, end: int, total: int,
                   base: int) -> tuple[list[tuple[int, int, int]], tuple[int, ...]]:
    """The copies of chunks [begin, end): spans (first chunk, last chunk + 1, staging offset) of chunks
    joined back to back, packed from `base` in the staging buffer, and each chunk's staging offset
    (a chunk keeps its distance from its span's first chunk)."""
    spans: list[tuple[int, int, int]] = []
    offsets: list[int] = []
    cursor, first = base, begin
    for stop in range(begin + 1, end + 1):
        if stop < end and joined[stop - 1]:
            continue
        anchor = addresses[first]
        offsets.extend(cursor + address - anchor for address in addresses[first:stop])
        spans.append((first, stop, cursor))
        cursor = align_up(cursor + addresses[stop - 1] - anchor + total, _STAGING_ALIGNMENT)
        first = stop
    return spans, tuple(offsets)


def _copy_spans(chunks: list[torch.Tensor], addresses: list[int], spans, total: int, staging: torch.Tensor, *,
                to_staging: bool) -> None:
    """One copy per span between the host chunks (at `addresses`) and the staging buffer (on the current stream).

    A span is copied at once only where it lies inside its first chunk's allocation (one
    host pool); else chunk by chunk, each to its place in the span's staging range.
    """
    for first, stop, offset in spans:
        chunk = chunks[first]
        size = addresses[stop - 1] - addresses[first] + total
        pieces = None
        if stop - first > 1:
            storage = chunk.untyped_storage()
            if addresses[stop - 1] + total <= storage.data_ptr() + storage.nbytes():
                pieces = ((chunk.as_strided((size,), (1,)), offset, size),)
        if pieces is None:
            pieces = tuple(
                (chunks[index] if chunks[index].numel() == total else chunks[index][:total],
                 offset + addresses[index] - addresses[first], total)
                for index in range(first, stop)
            )
        for span, at, length in pieces:
            staged = staging[at : at + length]
            if to_staging:
                staged.copy_(span, non_blocking=True)
            else:
                span.copy_(staged, non_blocking=True)
