"""Per-group slot mappings: what the scheduler hands the worker for one request.

The scheduler side (issue 3) builds one `GroupSlotMappings` per request and
step and attaches it to LMCache's ``ReqMeta`` as the attribute named by
`REQ_META_ATTRIBUTE` (``req_meta.ascend_group_slots``); read it with
`group_slots_of`. It is absent (None) for single-group models, whose
``ReqMeta.slot_mapping`` stays exactly what upstream LMCache computes.

Slot semantics (paged row index inside the group's KV tensor, as in vLLM's
own slot mappings): group g maps the request's first ``num_tokens`` tokens to
``ceil(num_tokens / compress_ratio[g])`` rows; row r lives in block
``block_ids[g][r // rows_per_block]`` at offset ``r % rows_per_block``, and
its slot is ``block_id * rows_per_block + offset``. ``-1`` means "do not move
this row": rows on vLLM's null block (id 0) always; on load also rows vLLM
already holds (its prefix cache); on store also rows of a sliding-window group
outside the paged blocks that hold the last ``sliding_window`` tokens of their
LMCache chunk (vLLM frees those blocks, and reuse only needs the window's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmcache_ascend.multigroup.attachments import GROUP_SLOTS
from lmcache_ascend.multigroup.slicing import primary_group_index
from lmcache_ascend.multigroup.specs import KVGroupSpec, MultiGroupLayout, cached_row_count, chunk_row_window
from lmcache_ascend.multigroup.tracker import NULL_BLOCK_ID, GroupBlockTracker

__all__ = [
    "REQ_META_ATTRIBUTE",
    "GroupSlotMappings",
    "SlotRowCache",
    "build_group_slot_mappings",
    "cached_slot_mapping_for_group",
    "group_slots_of",
    "raw_slot_mapping_for_group",
]

# Attribute of LMCache's ReqMeta (lmcache.integration.vllm.vllm_v1_adapter)
# that carries the GroupSlotMappings of a multi-group request.
REQ_META_ATTRIBUTE = GROUP_SLOTS.name


@dataclass(frozen=True)
class GroupSlotMappings:
    """Slot mappings of every KV-cache group of one request for one step.

    ``slot_mappings[g]`` is a CPU int64 tensor of ``groups[g].num_rows(num_tokens)``
    slots with -1 only on null blocks, or None for a group LMCache skips
    (state groups). Use `store_slot_mapping` / `load_slot_mapping` to get the
    direction-specific masks. ``primary_group`` is the transferred group that
    covers the most tokens (``argmax len(block_ids[g]) * block_size[g]``); chunk
    hashing and token masks follow it. ``num_tokens`` equals
    ``len(req_meta.token_ids)``; ``chunk_size`` is LMCache's chunk size and
    ``vllm_cached_tokens`` the prefix vLLM already holds (0 if no load).
    """

    groups: tuple[KVGroupSpec, ...]
    slot_mappings: tuple[torch.Tensor | None, ...]
    primary_group: int
    num_tokens: int
    chunk_size: int
    vllm_cached_tokens: int = 0

    @property
    def transferred_groups(self) -> tuple[int, ...]:
        return tuple(index for index, slots in enumerate(self.slot_mappings) if slots is not None)

    def transferred_slot_mappings(self) -> dict[int, torch.Tensor]:
        """Group -> slots of every transferred group, unmasked (a chunk picks its rows by
        `chunk_row_window`; a load masks the cached prefix by `cached_row_count`)."""
        return {index: slots for index, slots in enumerate(self.slot_mappings) if slots is not None}

    def store_slot_mapping(self, group_index: int) -> torch.Tensor | None:
        """Slots to copy paged -> LMCache for `group_index` (None: group skipped)."""
        slots = self.slot_mappings[group_index]
        group = self.groups[group_index]
        if slots is None or group.sliding_window is None:
            return slots
        keep = _rows_in_chunk_windows(group, len(slots), self.chunk_size)
        return torch.where(torch.from_numpy(keep), slots, torch.full_like(slots, -1))

    def store_hole_chunks(self) -> tuple[int, ...]:
        """LMCache chunks (index = first token // chunk_size) that a store cannot fill.

        A row that should be stored (inside the window, for sliding-window
        groups) but sits on vLLM's null block has no data in vLLM; storing its
        chunk would persist whatever the buffer held. Callers must not persist
        these chunks (or must store them without the hole group).
        """
        holes: set[int] = set()
        for group_index, slots in enumerate(self.slot_mappings):
            if slots is None:
                continue
            group = self.groups[group_index]
            wanted = np.ones(len(slots), dtype=bool)
            if group.sliding_window is not None:
                wanted = _rows_in_chunk_windows(group, len(slots), self.chunk_size)
            hole_rows = np.nonzero(wanted & (slots.numpy() < 0))[0]
            holes.update((hole_rows * group.compress_ratio // self.chunk_size).tolist())
        return tuple(sorted(holes))

    def first_storable_token(self) -> int:
        """Where a store may start so that no chunk with an unfillable row is persisted.

        LMCache's store mask can only skip a leading run of tokens, so every chunk up
        to the last hole chunk is left out: better recomputed later than loaded stale.
        """
        holes = self.store_hole_chunks()
        return min(self.num_tokens, (holes[-1] + 1) * self.chunk_size) if holes else 0

    def load_slot_mapping(self, group_index: int) -> torch.Tensor | None:
        """Slots to copy LMCache -> paged for `group_index` (None: group skipped)."""
        slots = self.slot_mappings[group_index]
        if slots is None:
            return None
        cached_rows = cached_row_count(self.groups[group_index], self.vllm_cached_tokens, len(slots))
        if cached_rows == 0:
            return slots
        masked = slots.clone()
        masked[:cached_rows] = -1
        return masked


def _rows_in_chunk_windows(group: KVGroupSpec, num_rows: int, chunk_size: int) -> np.ndarray:
    """Which of a sliding-window group's `num_rows` rows its chunks keep (`chunk_row_window`)."""
    rows = np.arange(num_rows, dtype=np.int64)
    chunk_rows = chunk_size // group.compress_ratio
    chunk_first = rows // chunk_rows * chunk_rows
    chunk_end = np.minimum(chunk_first + chunk_rows, num_rows)
    first, _ = chunk_row_window(group, chunk_first * group.compress_ratio, chunk_end * group.compress_ratio)
    return rows >= first


_OFFSETS: dict[int, np.ndarray] = {}


def _offsets(rows_per_block: int) -> np.ndarray:
    offsets = _OFFSETS.get(rows_per_block)
    if offsets is None:
        offsets = _OFFSETS[rows_per_block] = np.arange(rows_per_block, dtype=np.int64)
    return offsets


def raw_slot_mapping_for_group(group: KVGroupSpec, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Slots of the first `num_tokens` tokens of `group`; -1 on null blocks."""
    num_rows = group.num_rows(num_tokens)
    rows_per_block = group.rows_per_block
    num_blocks = -(-num_rows // rows_per_block)
    if num_blocks > len(block_ids):
        raise ValueError(
            f"KV-cache group {group.group_index} ({group.spec_class_name}): {num_tokens} tokens need "
            f"{num_blocks} blocks of {group.block_size} tokens but only {len(block_ids)} are tracked"
        )
    if num_blocks == 0:
        return torch.empty(0, dtype=torch.long)
    ids = np.asarray(block_ids[:num_blocks], dtype=np.int64)
    if rows_per_block == 1:
        slots = ids.copy()
    else:
        slots = (ids[:, None] * rows_per_block + _offsets(rows_per_block)).reshape(-1)
    if NULL_BLOCK_ID in block_ids[:num_blocks]:
        slots.reshape(num_blocks, rows_per_block)[ids == NULL_BLOCK_ID] = -1
    return torch.from_numpy(slots[:num_rows])


class SlotRowCache:
    """Slot rows of a group's tracked blocks, grown as blocks are appended.

    Keeps the per-step cost of building slot mappings proportional to the new
    blocks (plus one memcpy of the rows handed out), instead of converting the
    whole block table every step.
    """

    __slots__ = ("rows_per_block", "num_blocks", "rows")

    def __init__(self, rows_per_block: int) -> None:
        self.rows_per_block = rows_per_block
        self.num_blocks = 0
        self.rows = np.empty(0, dtype=np.int64)

    def extend(self, block_ids: list[int]) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        if self.rows_per_block == 1:
            new_rows = ids.copy()
        else:
            new_rows = (ids[:, None] * self.rows_per_block + _offsets(self.rows_per_block)).reshape(-1)
        null = ids == NULL_BLOCK_ID
        if null.any():
            new_rows.reshape(len(ids), self.rows_per_block)[null] = -1
        used = self.num_blocks * self.rows_per_block
        if used + len(new_rows) > len(self.rows):
            grown = np.empty(max(2 * len(self.rows), used + len(new_rows)), dtype=np.int64)
            grown[:used] = self.rows[:used]
            self.rows = grown
        self.rows[used : used + len(new_rows)] = new_rows
        self.num_blocks += len(ids)


def cached_slot_mapping_for_group(group: KVGroupSpec, tracker: GroupBlockTracker, num_tokens: int) -> torch.Tensor:
    """Same result as `raw_slot_mapping_for_group`, reusing the tracker's row cache."""
    block_ids = tracker.block_ids_by_group[group.group_index]
    num_rows = group.num_rows(num_tokens)
    num_blocks = -(-num_rows // group.rows_per_block)
    if num_blocks > len(block_ids):
        return raw_slot_mapping_for_group(group, block_ids, num_tokens)  # raises, naming the group
    cache = tracker.slot_row_caches[group.group_index]
    if not isinstance(cache, SlotRowCache) or cache.rows_per_block != group.rows_per_block:
        cache = tracker.slot_row_caches[group.group_index] = SlotRowCache(group.rows_per_block)
    if cache.num_blocks < num_blocks:
        cache.extend(block_ids[cache.num_blocks : num_blocks])
    # A copy: the metadata is pickled to the workers, and a view would drag
    # (and later see writes to) the whole cache buffer.
    return torch.from_numpy(cache.rows[:num_rows].copy())


def build_group_slot_mappings(
    layout: MultiGroupLayout,
    tracker: GroupBlockTracker,
    num_tokens: int,
    chunk_size: int,
    vllm_cached_tokens: int = 0,
) -> GroupSlotMappings:
    """The `GroupSlotMappings` of a request whose first `num_tokens` tokens move."""
    if tracker.num_groups != layout.num_groups:
        raise ValueError(
            f"tracker has {tracker.num_groups} KV-cache groups, the model layout has {layout.num_groups}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be a positive integer (LMCache chunk_size)")
    slot_mappings: list[torch.Tensor | None] = []
    for group, keep in zip(layout.groups, layout.transferred):
        slot_mappings.append(cached_slot_mapping_for_group(group, tracker, num_tokens) if keep else None)
    primary = primary_group_index(
        tracker.num_blocks_by_group(), layout.block_sizes, layout.transferred_group_indices
    )
    return GroupSlotMappings(
        groups=layout.groups,
        slot_mappings=tuple(slot_mappings),
        primary_group=primary,
        num_tokens=num_tokens,
        chunk_size=chunk_size,
        vllm_cached_tokens=vllm_cached_tokens,
    )


def group_slots_of(req_meta: Any) -> GroupSlotMappings | None:
    """The GroupSlotMappings attached to an LMCache ReqMeta, or None (single group)."""
    return GROUP_SLOTS.get(req_meta)
