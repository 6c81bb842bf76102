"""Move one chunk between vLLM's paged caches (every layer group) and its flat buffer.

Glue between the chunk plan and the kernels: per layer group one
`transfer_group` call (one launch on Triton), each plane addressed by the slot
mapping of its scheduler group, restricted to the rows the chunk owns
(`row_window`: compressed groups ``ceil(tokens / ratio)`` rows, sliding-window
groups only their tail).

Pure logic: torch and lmcache_ascend only.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lmcache_ascend.kernels import PagedGroup, PagedPlane, PlaneSlots, transfer_group
from lmcache_ascend.kv_layout.chunk_plan import ChunkLayout, row_window
from lmcache_ascend.kv_layout.formats import LayoutError

__all__ = ["ChunkMover"]


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

    def slots_for_chunk(
        self,
        slot_mappings: Mapping[int, torch.Tensor],
        start: int,
        end: int,
        skip_tokens_before: int = 0,
    ) -> tuple[tuple[PlaneSlots, ...], ...]:
        """Per layer group, per plane: the slot window of tokens [start, end).

        Rows lying wholly before token `skip_tokens_before` get slot -1 (left
        alone): on load they are already in vLLM's cache, and rewriting blocks
        vLLM may be reading races with it.
        """
        plan = self.layout.plan(end - start)
        per_group = []
        for group, region in zip(self.layout.layer_groups, plan.regions):
            per_plane = []
            for plane, identity in enumerate(group.planes):
                scheduler_group = identity.scheduler_group
                slots = slot_mappings.get(scheduler_group)
                if slots is None:
                    raise LayoutError(
                        f"no slot mapping for scheduler group {scheduler_group} (layer group {group.index}); "
                        f"got slot mappings for groups {sorted(slot_mappings)}"
                    )
                window = row_window(self.layout.geometry_by_group[scheduler_group], start, end)
                available = int(slots.numel()) - window.first
                if available < window.count:
                    raise LayoutError(
                        f"slot mapping of scheduler group {scheduler_group} has {slots.numel()} entries; tokens "
                        f"[{start}, {end}) need rows [{window.first}, {window.first + window.count})"
                    )
                ratio = self.layout.geometry_by_group[scheduler_group].compress_ratio
                skipped_rows = min(max(skip_tokens_before // ratio - window.first, 0), window.count)
                if skipped_rows:
                    masked = slots[window.first : window.first + window.count].clone()
                    masked[:skipped_rows] = -1
                    per_plane.append(PlaneSlots(masked, 0, window.count, region_rows=region.plane_rows[plane]))
                else:
                    per_plane.append(
                        PlaneSlots(slots, window.first, window.count, region_rows=region.plane_rows[plane])
                    )
            per_group.append(tuple(per_plane))
        return tuple(per_group)

    def move(
        self,
        chunk: torch.Tensor,
        start: int,
        end: int,
        slot_mappings: Mapping[int, torch.Tensor],
        *,
        store: bool,
        skip_tokens_before: int = 0,
    ) -> int:
        """Store (paged -> chunk) or load tokens [start, end) for every layer group; returns launches."""
        plan = self.layout.plan(end - start)
        if chunk.numel() * chunk.element_size() < plan.total_bytes:
            raise LayoutError(
                f"chunk buffer of {chunk.numel() * chunk.element_size()} bytes is smaller than the "
                f"{plan.total_bytes} bytes a {end - start}-token chunk needs"
            )
        launches = 0
        for paged_group, region, slots in zip(
            self.paged_groups, plan.regions, self.slots_for_chunk(slot_mappings, start, end, skip_tokens_before)
        ):
            if all(plane_slots.count == 0 for plane_slots in slots):
                continue
            transfer_group(
                paged_group, slots, chunk, store=store, chunk_offset=region.byte_offset, backend=self.backend
            )
            launches += 1
        return launches
