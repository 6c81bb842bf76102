"""The CPU slot builder the scheduler ran before issue 13 (slots built per step, shipped as tensors).

Kept out of the package: the tests compare the worker's device resolution
(`DeviceSlots.from_block_ids`) with it element by element, e2e tests hand its
slots to the connector explicitly (``slot_mappings_by_group``), and
``scripts/_bench_request.py`` times the old per-chunk path with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmcache_ascend.multigroup.specs import KVGroupSpec, KVGroups, cached_row_count, chunk_row_window
from lmcache_ascend.multigroup.tracker import NULL_BLOCK_ID, GroupBlockTracker


def raw_slot_mapping_for_group(group: KVGroupSpec, block_ids, num_tokens: int) -> torch.Tensor:
    """Slots of the first `num_tokens` tokens of `group`; -1 on null blocks."""
    num_rows = group.num_rows(num_tokens)
    rows_per_block = group.rows_per_block
    num_blocks = -(-num_rows // rows_per_block)
    if num_blocks > len(block_ids):
        raise ValueError(f"group {group.group_index}: {num_blocks} blocks needed, {len(block_ids)} given")
    if num_blocks == 0:
        return torch.empty(0, dtype=torch.long)
    ids = np.asarray(list(block_ids[:num_blocks]), dtype=np.int64)
    slots = (ids[:, None] * rows_per_block + np.arange(rows_per_block, dtype=np.int64)).reshape(-1)
    slots.reshape(num_blocks, rows_per_block)[ids == NULL_BLOCK_ID] = -1
    return torch.from_numpy(slots[:num_rows].copy())


def rows_in_chunk_windows(group: KVGroupSpec, num_rows: int, chunk_size: int) -> np.ndarray:
    """Which of a sliding-window group's `num_rows` rows its chunks keep (`chunk_row_window`)."""
    rows = np.arange(num_rows, dtype=np.int64)
    chunk_rows = chunk_size // group.compress_ratio
    chunk_first = rows // chunk_rows * chunk_rows
    chunk_end = np.minimum(chunk_first + chunk_rows, num_rows)
    first, _ = chunk_row_window(group, chunk_first * group.compress_ratio, chunk_end * group.compress_ratio)
    return rows >= first


@dataclass(frozen=True)
class GroupSlotMappings:
    """Slot mappings of every KV-cache group of one request for one step (None: group skipped)."""

    groups: tuple[KVGroupSpec, ...]
    slot_mappings: tuple[torch.Tensor | None, ...]
    num_tokens: int
    chunk_size: int
    vllm_cached_tokens: int = 0

    @property
    def transferred_groups(self) -> tuple[int, ...]:
        return tuple(index for index, slots in enumerate(self.slot_mappings) if slots is not None)

    def transferred_slot_mappings(self) -> dict[int, torch.Tensor]:
        return {index: slots for index, slots in enumerate(self.slot_mappings) if slots is not None}

    def store_slot_mapping(self, group_index: int) -> torch.Tensor | None:
        slots = self.slot_mappings[group_index]
        group = self.groups[group_index]
        if slots is None or group.sliding_window is None:
            return slots
        keep = rows_in_chunk_windows(group, len(slots), self.chunk_size)
        return torch.where(torch.from_numpy(keep), slots, torch.full_like(slots, -1))

    def load_slot_mapping(self, group_index: int) -> torch.Tensor | None:
        slots = self.slot_mappings[group_index]
        if slots is None:
            return None
        masked = slots.clone()
        masked[: cached_row_count(self.groups[group_index], self.vllm_cached_tokens, len(slots))] = -1
        return masked


def build_group_slot_mappings(
    kv_groups: KVGroups, tracker: GroupBlockTracker, num_tokens: int, chunk_size: int, vllm_cached_tokens: int = 0
) -> GroupSlotMappings:
    slot_mappings = tuple(
        raw_slot_mapping_for_group(group, tracker.block_ids_by_group[group.group_index], num_tokens)
        if group.transferred
        else None
        for group in kv_groups.groups
    )
    return GroupSlotMappings(kv_groups.groups, slot_mappings, num_tokens, chunk_size, vllm_cached_tokens)
