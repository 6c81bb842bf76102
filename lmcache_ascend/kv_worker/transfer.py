"""Move chunks between vLLM's paged caches (every layer group) and their flat buffers (`ChunkMover`).

Between the chunk plan and the kernels. A request's slots are made on the device
once (`device_slots.DeviceSlots`); a chunk then only picks rows of it
(`chunk_row_window`: compressed groups ``ceil(tokens / ratio)`` rows,
sliding-window groups only their tail). `ChunkMover.move` moves one chunk with
one launch per layer group; `ChunkMover.move_batch` moves many full chunks of every
layer group with one launch (Triton; the torch reference counts one per layer group);
`ChunkMover.move_chunks` takes host chunks through its `staging.Stager`.

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
    chunk_buffers,
    chunk_rows,
    resolve_chunk_batches,
    transfer_chunk_batches,
    transfer_group,
)
from lmcache_ascend.kv_worker.chunk_plan import ChunkPlanner
from lmcache_ascend.kv_worker.device_slots import DeviceSlots
from lmcache_ascend.kv_worker.errors import KVCacheShapeError
from lmcache_ascend.kv_worker.staging import Stager
from lmcache_ascend.multigroup.specs import chunk_row_window

__all__ = ["ChunkMover", "SlotsSource"]

# What `ChunkMover.move_chunks` takes as a call's slots: made already, group (or (group, compress
# ratio)) -> slot mapping (uploaded there), or a function giving either (called once, when the slots are first needed).
SlotsSource = Union[DeviceSlots, Mapping[int, object], Callable[[], Union[DeviceSlots, Mapping[int, object]]]]

# Bound of each cache of per-request-shape values (chunk rows by chunk bounds and slot layout):
# see docs/hot-path.md.
_MAX_CACHED_ROWS = 64


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
        # Per slot mapping (scheduler group at a compress ratio), the rows every one of its caches
        # has, and per scheduler group the blocks all of them have: ids and slots beyond them are
        # refused before anything moves (`DeviceSlots`).
        rows: dict[tuple[int, int], int] = {}
        for group in planner.layer_groups:
            for planes in group.plane_geometries:
                for plane in planes:
                    key = planner.row_key(plane)
                    rows[key] = min(rows.get(key, plane.num_rows), plane.num_rows)
        self.slot_rows: dict[tuple[int, int], int] = rows
        blocks: dict[int, int] = {}
        for key, count in rows.items():
            count //= planner.row_geometry(key).rows_per_block
            blocks[key[0]] = min(blocks.get(key[0], count), count)
        self.block_counts: dict[int, int] = blocks
        # Host chunks reach the caches through its device staging buffer.
        self.stager = Stager(self.device, planner.full_plan.total_bytes, _MAX_CACHED_ROWS)
        self._windows: BoundedCache[tuple] = BoundedCache(_MAX_CACHED_ROWS)
        self._rows: BoundedCache[tuple] = BoundedCache(_MAX_CACHED_ROWS)

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
        for (scheduler_group, ratio), needed in rows_needed.items():
            length = slots.lengths.get((scheduler_group, ratio))
            if length is None:
                raise KVCacheShapeError(
                    f"no slot mapping for scheduler group {scheduler_group} at compress ratio {ratio}; got slot "
                    f"mappings for (group, ratio) {sorted(slots.offsets)}"
                )
            if needed > length:
                raise KVCacheShapeError(
                    f"slot mapping of scheduler group {scheduler_group} has {length} entries at compress ratio "
                    f"{ratio}; tokens [{starts.min()}, {ends.max()}) need {needed} rows"
                )
        return [
            (firsts + np.asarray([slots.offsets[k] for k in plane_keys], dtype=np.int64)[None, :], counts)
            for plane_keys, firsts, counts in per_layer_group
        ]

    def _row_windows(self, starts: np.ndarray, ends: np.ndarray):
        windows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        rows_needed: dict[tuple[int, int], int] = {}
        for key in self.planner.row_keys_in_use():
            first, count = chunk_row_window(self.planner.row_geometry(key), starts, ends)
            windows[key] = (first, count)
            rows_needed[key] = int((first + count).max()) if len(first) else 0
        per_layer_group = []
        for group in self.planner.layer_groups:
            plane_keys = tuple(self.planner.row_key(identity) for identity in group.planes)
            firsts = np.stack([windows[k][0] for k in plane_keys], axis=1)
            counts = np.stack([windows[k][1] for k in plane_keys], axis=1)
            per_layer_group.append((plane_keys, firsts, counts))
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
        """(device staging buffer, bytes per chunk in it) for up to `chunks` full chunks (`Stager.buffer`)."""
        return self.stager.buffer(chunks)

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
        return self.stager.move(list(chunks), list(starts), lambda: self._resolved_slots(slots),
                                self.move_batch, store=store)

    def _resolved_slots(self, slots: SlotsSource) -> DeviceSlots:
        return self._device_slots(slots() if callable(slots) else slots)
