"""Move chunks between vLLM's paged caches (every layer group) and their flat buffers (`ChunkMover`).

Between the chunk plan and the kernels. A request's slots are made on the device
once (`device_slots.DeviceSlots`); a chunk then only picks rows of it
(`chunk_row_window`: compressed groups ``ceil(tokens / ratio)`` rows,
sliding-window groups only their tail). `ChunkMover.move` moves one chunk with
one launch per layer group; `ChunkMover.move_batch` moves many full chunks of every
layer group with one launch (Triton; the torch reference counts one per layer group).

Pure logic: torch, numpy and lmcache_ascend only.
"""

from __future__ import annotations

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
    resolve_chunk_batches,
    transfer_chunk_batches,
    transfer_group,
)
from lmcache_ascend.kv_worker.chunk_plan import ChunkPlanner
from lmcache_ascend.kv_worker.device_slots import DeviceSlots
from lmcache_ascend.kv_worker.formats import KVCacheShapeError
from lmcache_ascend.kv_worker.staging import STAGING_BYTES, STAGING_ALIGNMENT, StagedWaves, staging_waves
from lmcache_ascend.multigroup.specs import chunk_row_window

__all__ = ["ChunkMover", "SlotsSource"]

# What `ChunkMover.move_chunks` takes as a call's slots: made already, group -> slot mapping
# (uploaded there), or a function giving either (called once, when the slots are first needed).
SlotsSource = Union[DeviceSlots, Mapping[int, object], Callable[[], Union[DeviceSlots, Mapping[int, object]]]]

# Bound of each cache of per-request-shape values (chunk rows by chunk bounds and slot layout):
# see docs/hot-path.md.
_MAX_CACHED_ROWS = 64


def _device_module(device: torch.device):
    """torch.cuda / torch.npu for a device with streams and events; None for the CPU."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "Stream") else None


class ChunkMover:
    """Stores / loads chunks of one registered set of KV caches."""

    def __init__(self, planner: ChunkPlanner, backend: str | None = None):
        self.planner = planner
        self.backend = backend
        # Built once: the kernels validate and cache each tensor's geometry here.
        # Planes come in the kernels' block form already (see `PlaneGeometry.kernel_block_rows`).
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
            for group in planner.layer_groups
        )
        # Per scheduler group, the rows and blocks every one of its caches has: ids and slots
        # beyond them are refused before anything moves (`DeviceSlots`).
        rows: dict[int, int] = {}
        for group in planner.layer_groups:
            for planes in group.plane_geometries:
                for plane in planes:
                    rows[plane.scheduler_group] = min(rows.get(plane.scheduler_group, plane.num_rows), plane.num_rows)
        self.slot_rows: dict[int, int] = rows
        self.block_counts: dict[int, int] = {
            g: count // planner.geometry_by_group[g].rows_per_block for g, count in rows.items()
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
            slot_mappings, self.planner.geometry_by_group, self.device, cached_tokens, self.slot_rows, request
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
                raise KVCacheShapeError(
                    f"no slot mapping for scheduler group {scheduler_group}; got slot mappings for groups "
                    f"{sorted(slots.offsets)}"
                )
            if needed > length:
                raise KVCacheShapeError(
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
        for scheduler_group in self.planner.scheduler_groups_in_use():
            first, count = chunk_row_window(self.planner.geometry_by_group[scheduler_group], starts, ends)
            windows[scheduler_group] = (first, count)
            rows_needed[scheduler_group] = int((first + count).max()) if len(first) else 0
        per_layer_group = []
        for group in self.planner.layer_groups:
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
        plan = self.planner.plan(end - start)
        if chunk.numel() * chunk.element_size() < plan.total_bytes:
            raise KVCacheShapeError(
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
                regions=region.regions,
            )
            launches += 1
        return launches

    def batch_rows(self, slots: DeviceSlots, starts: Sequence[int]) -> tuple[tuple[ChunkRows, int], ...]:
        """Per layer group that moves a row: (the `ChunkRows` of the full chunks starting at `starts`, the
        group's byte offset in a chunk), as `resolve_chunk_batches` takes them; checked once and remembered
        for the chunk starts and slot layout of recent calls (requests of one length share them)."""
        key = (tuple(starts), tuple(slots.offsets.items()), tuple(slots.lengths.items()))
        return self._rows.get_or_build(key, lambda: self._batch_rows(slots, np.asarray(key[0], dtype=np.int64)))

    def _batch_rows(self, slots: DeviceSlots, starts: np.ndarray) -> tuple[tuple[ChunkRows, int], ...]:
        rows = self.plane_rows(slots, starts, starts + self.planner.chunk_size)
        return tuple(
            (chunk_rows(paged_group, region.regions, firsts, counts), region.byte_offset)
            for paged_group, region, (firsts, counts) in zip(self.paged_groups, self.planner.full_plan.regions, rows)
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
        batches = resolve_chunk_batches(slots.slots, buffers, self.batch_rows(slots, starts), store=store)
        return transfer_chunk_batches(batches, backend=self.backend)

    def staging_buffer(self, chunks: int) -> tuple[torch.Tensor, int]:
        """(device staging buffer, bytes per chunk in it) for up to `chunks` full chunks (fewer where
        `STAGING_BYTES` is reached; one at least). Allocated once, grown on demand."""
        stride = align_up(self.planner.full_plan.total_bytes, STAGING_ALIGNMENT)
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
        half_bytes = (staging.numel() // halves) // STAGING_ALIGNMENT * STAGING_ALIGNMENT
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
        chunks are checked (`StagedWaves.check`): the copy engine starts that much earlier. A later
        chunk that fails its check raises with the first wave's copies queued; only checked chunks
        are ever written, and a failed store is not kept by LMCache.
        """
        module = self._stream_module
        staging, stride, halves, half_bytes, waves = self._staging_shapes.get_or_build(
            (len(chunks), STAGING_BYTES), lambda: self._staging_shape(len(chunks)))
        staged = StagedWaves(chunks, starts, self.planner.full_plan.total_bytes, stride, store, staging,
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

    def _staged_store(self, staged: "StagedWaves", slots: DeviceSlots, module, compute, copy) -> int:
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

    def _staged_load(self, staged: "StagedWaves", slots: SlotsSource, module, compute, copy) -> int:
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
