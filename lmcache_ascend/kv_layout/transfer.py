"""Move chunks between vLLM's paged caches (every layer group) and their flat buffers.

Glue between the chunk plan and the kernels. A request's slot mappings are put
on the device once (`DeviceSlots`: every scheduler group's slots in one tensor,
the cached prefix of a load already masked); a chunk then only picks rows of it
(`chunk_row_window`: compressed groups ``ceil(tokens / ratio)`` rows,
sliding-window groups only their tail). `ChunkMover.move` moves one chunk with
one launch per layer group; `ChunkMover.move_batch` moves many full chunks with
one launch per layer group for all of them.

Pure logic: torch, numpy and lmcache_ascend only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from lmcache_ascend.kernels import (
    PagedGroup,
    PagedPlane,
    PlaneSlots,
    resolve_chunk_batch,
    transfer_chunk_batch,
    transfer_group,
)
from lmcache_ascend.kv_layout.chunk_plan import ChunkLayout
from lmcache_ascend.kv_layout.formats import LayoutError
from lmcache_ascend.multigroup.specs import KVGroupSpec, cached_row_count, chunk_row_window

__all__ = ["ChunkMover", "DeviceSlots"]


@dataclass(frozen=True)
class DeviceSlots:
    """The slot mappings of one request (or one call) on the caches' device, in ONE int64 tensor.

    Scheduler group g's slots are ``slots[offsets[g] : offsets[g] + lengths[g]]``.
    Made by `DeviceSlots.upload`: one host-to-device copy.
    """

    slots: torch.Tensor
    offsets: Mapping[int, int]
    lengths: Mapping[int, int]

    @classmethod
    def upload(
        cls,
        slot_mappings: Mapping[int, object],
        groups: Mapping[int, KVGroupSpec],
        device: torch.device,
        cached_tokens: int = 0,
    ) -> "DeviceSlots":
        """Concatenate `slot_mappings` (group -> 1-D ints), mask the rows of vLLM's cached
        prefix (`cached_row_count`; 0 for a store) and copy them to `device` at once."""
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
            masked = cached_row_count(spec, cached_tokens, len(host))
            host[:masked] = -1
            parts.append(host)
            offsets[group], lengths[group] = cursor, len(host)
            cursor += len(host)
        joined = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        # One entry at least: an empty tensor may have no address for the kernels to anchor on.
        if not len(joined):
            joined = np.full(1, -1, dtype=np.int64)
        tensor = torch.from_numpy(joined)
        if device.type != "cpu":
            tensor = tensor.to(device)
        return cls(tensor, offsets, lengths)


class ChunkMover:
    """Stores / loads chunks of one registered set of KV caches."""

    def __init__(self, layout: ChunkLayout, backend: str | None = None):
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

    @property
    def device(self) -> torch.device:
        return self.paged_groups[0].device

    def upload(self, slot_mappings: Mapping[int, object], cached_tokens: int = 0) -> DeviceSlots:
        """`DeviceSlots` of these slot mappings on the caches' device."""
        return DeviceSlots.upload(slot_mappings, self.layout.geometry_by_group, self.device, cached_tokens)

    def plane_rows(self, slots: DeviceSlots, starts: np.ndarray, ends: np.ndarray):
        """Per layer group, (first slot index, row count) arrays [chunks, planes] of the chunks [starts, ends).

        The first slot index points into `slots.slots`: the group's offset plus the
        chunk's row window (`chunk_row_window`), worked out for all chunks at once.
        """
        windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for scheduler_group in self.layout.scheduler_groups_in_use():
            offset = slots.offsets.get(scheduler_group)
            if offset is None:
                raise LayoutError(
                    f"no slot mapping for scheduler group {scheduler_group}; got slot mappings for groups "
                    f"{sorted(slots.offsets)}"
                )
            first, count = chunk_row_window(self.layout.geometry_by_group[scheduler_group], starts, ends)
            length = slots.lengths[scheduler_group]
            short = first + count > length
            if short.any():
                index = int(np.argmax(short))
                raise LayoutError(
                    f"slot mapping of scheduler group {scheduler_group} has {length} entries; tokens "
                    f"[{starts[index]}, {ends[index]}) need rows [{first[index]}, {first[index] + count[index]})"
                )
            windows[scheduler_group] = (first + offset, count)
        per_group = []
        for group in self.layout.layer_groups:
            firsts = np.stack([windows[identity.scheduler_group][0] for identity in group.planes], axis=1)
            counts = np.stack([windows[identity.scheduler_group][1] for identity in group.planes], axis=1)
            per_group.append((firsts, counts))
        return per_group

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

    def move_batch(
        self,
        chunks: Sequence[torch.Tensor],
        starts: Sequence[int],
        slots: DeviceSlots | Mapping[int, object],
        *,
        store: bool,
    ) -> int:
        """Move full chunks (each `chunk_size` tokens from its start), one launch per layer group; returns launches.

        `chunks` are flat uint8 buffers on the caches' device (or CUDA pinned host memory).
        """
        if not chunks:
            return 0
        slots = self._device_slots(slots)
        size = self.layout.chunk_size
        plan = self.layout.full_plan
        starts_array = np.asarray(starts, dtype=np.int64)
        rows = self.plane_rows(slots, starts_array, starts_array + size)
        launches = 0
        for paged_group, region, (firsts, counts) in zip(self.paged_groups, plan.regions, rows):
            if not counts.any():
                continue
            batch = resolve_chunk_batch(
                paged_group, slots.slots, chunks, firsts, counts, store=store, layout=region.layout,
                chunk_offset=region.byte_offset,
            )
            transfer_chunk_batch(batch, backend=self.backend)
            launches += 1
        return launches
