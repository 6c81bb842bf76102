"""What the scheduler hands the worker per request and step: block ids, not slots.

The scheduler side makes one `StepBlockIds` per request and step and
attaches it to LMCache's ``ReqMeta`` (`attachments.STEP_BLOCK_IDS`). It is absent
for single-group models, whose ``ReqMeta.slot_mapping`` stays exactly what
upstream LMCache computes. vLLM pickles the metadata to the workers every step,
so it carries the block ids of the transferred groups packed in ONE bytes object
of int64s (a few hundred ids, where the slots were a tensor of one entry per row
per group) plus scalars, among them a 64-bit digest of the group geometry in place
of the groups: the scheduler and the workers build the same groups from vLLM's
KV-cache config, and each reader passes its own (checked against the digest with
one comparison). The worker turns the ids into slots on its device, once per
request and step (`lmcache_ascend.kv_worker.device_slots.DeviceSlots.from_block_ids`).

Slot semantics (paged row index inside the group's KV tensor, as in vLLM's
own slot mappings): group g maps the request's first ``num_tokens`` tokens to
``ceil(num_tokens / compress_ratio[g])`` rows (one slot mapping per compress
ratio where the group's layers compress at several: the block ids are shared,
each ratio has its own ``rows_per_block``); row r lives in block
``block_ids[g][r // rows_per_block]`` at offset ``r % rows_per_block``, and
its slot is ``block_id * rows_per_block + offset``. ``-1`` means "do not move
this row": rows on vLLM's null block (id 0) always; on load also rows vLLM
already holds (`cached_row_count`). A chunk moves only the rows
`chunk_row_window` gives it (a sliding-window group: the paged blocks holding
the last ``sliding_window`` tokens of the chunk).

A leaf module (numpy and the standard library only): vLLM's scheduler process imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np

from lmcache_ascend.multigroup.specs import KVGroupSpec, KVGroups, chunk_row_window
from lmcache_ascend.multigroup.tracker import BLOCK_ID_DTYPE, NULL_BLOCK_ID, GroupBlockTracker, unpack_block_ids

__all__ = ["GeometryMismatchError", "GroupGeometry", "StepBlockIds", "step_block_ids"]


class GeometryMismatchError(ValueError):
    """A step's block ids were made for other KV-cache groups than the worker's."""


class GroupGeometry(Protocol):
    """The caller's KV-cache groups, as `StepBlockIds` reads them: `KVGroups` on the
    scheduler, the worker's ``kv_worker.ChunkPlanner``."""

    @property
    def groups(self) -> Sequence[KVGroupSpec] | Mapping[int, KVGroupSpec]: ...  # indexed by group index

    @property
    def transferred_group_indices(self) -> tuple[int, ...]: ...

    @property
    def geometry_digest(self) -> int: ...


@dataclass(frozen=True)
class StepBlockIds:
    """Block ids of every transferred KV-cache group of one request for one step.

    ``geometry_digest`` names the groups the ids were made for (`specs.geometry_digest` of
    the scheduler's groups); the groups themselves are not shipped: each reader passes its
    own, whose digest must be the same (`check_geometry`). ``packed_block_ids`` holds,
    for each transferred group in group order, the ``num_blocks(num_tokens)`` blocks that the
    first ``num_tokens`` tokens' rows occupy, as `GroupBlockTracker.packed_block_ids` packs
    them (`block_ids` reads them, `group_block_ids` splits them, `group_block_counts` counts
    them). ``num_tokens`` equals ``len(req_meta.token_ids)``; ``chunk_size`` is LMCache's
    chunk size and ``vllm_cached_tokens`` the prefix vLLM already holds (0 if no load).
    """

    geometry_digest: int
    packed_block_ids: bytes
    num_tokens: int
    chunk_size: int
    vllm_cached_tokens: int = 0

    @property
    def block_ids(self) -> np.ndarray:
        """The ids of `packed_block_ids`, read-only, without a copy."""
        return unpack_block_ids(self.packed_block_ids)

    def check_geometry(self, kv_groups: GroupGeometry) -> None:
        """Refuse a reader whose KV-cache groups are not those the ids were made for (one comparison)."""
        if kv_groups.geometry_digest != self.geometry_digest:
            raise GeometryMismatchError(
                f"the step's block ids were made for KV-cache group geometry {self.geometry_digest:016x} "
                f"(scheduler) but this side's is {kv_groups.geometry_digest:016x} (worker): the KV-cache group "
                "geometry (tokens per block, sliding windows and their compress ratios, which groups move) differs between "
                "scheduler and worker; both must build their groups from the same vLLM KV-cache config"
            )

    def transferred_groups(self, kv_groups: GroupGeometry) -> tuple[int, ...]:
        """The groups whose ids are shipped, in order (`kv_groups`' transferred groups, checked)."""
        self.check_geometry(kv_groups)
        return kv_groups.transferred_group_indices

    def group_block_counts(self, kv_groups: GroupGeometry) -> dict[int, int]:
        """Transferred group -> how many of the ids are its blocks, in order; checks the geometry and the
        total length (without reading the ids)."""
        self.check_geometry(kv_groups)
        groups, num_tokens = kv_groups.groups, self.num_tokens
        counts = {index: groups[index].num_blocks(num_tokens) for index in kv_groups.transferred_group_indices}
        if len(self.packed_block_ids) != sum(counts.values()) * BLOCK_ID_DTYPE.itemsize:
            shipped = len(self.packed_block_ids) / BLOCK_ID_DTYPE.itemsize
            raise ValueError(
                f"StepBlockIds carries {shipped:g} block ids; its {len(counts)} transferred groups need "
                f"{sum(counts.values())} for {self.num_tokens} tokens"
            )
        return counts

    def group_block_ids(self, kv_groups: GroupGeometry) -> dict[int, np.ndarray]:
        """Transferred group -> its blocks (views of `block_ids`); checks the geometry and the total length."""
        counts = self.group_block_counts(kv_groups)
        block_ids = self.block_ids
        out: dict[int, np.ndarray] = {}
        cursor = 0
        for group, count in counts.items():
            out[group] = block_ids[cursor : cursor + count]
            cursor += count
        return out

    def store_hole_chunks(self, kv_groups: GroupGeometry) -> tuple[int, ...]:
        """LMCache chunks (index = first token // chunk_size) that a store cannot fill.

        A row that a chunk stores (its `chunk_row_window`) but that sits on vLLM's
        null block has no data in vLLM; storing its chunk would persist whatever
        the buffer held. Callers must not persist these chunks.
        """
        num_chunks = -(-self.num_tokens // self.chunk_size)
        block_ids = self.group_block_ids(kv_groups)
        if num_chunks == 0:
            return ()
        starts = np.arange(num_chunks, dtype=np.int64) * self.chunk_size
        ends = np.minimum(starts + self.chunk_size, self.num_tokens)
        holes = np.zeros(num_chunks, dtype=bool)
        for group_index, ids in block_ids.items():
            null = ids == NULL_BLOCK_ID
            if not null.any():
                continue
            # Null blocks before each block index: a chunk has a hole when its rows'
            # blocks [first // rpb, ceil((first + count) / rpb)) include one (at any of
            # the group's compress ratios: its layers share the block ids).
            nulls_before = np.concatenate(([0], np.cumsum(null)))
            spec = kv_groups.groups[group_index]
            for group in (spec.at_ratio(ratio) for ratio in spec.ratios):
                first, count = chunk_row_window(group, starts, ends)
                first_block = first // group.rows_per_block
                end_block = -(-(first + count) // group.rows_per_block)
                holes |= (count > 0) & (nulls_before[end_block] > nulls_before[first_block])
        return tuple(np.flatnonzero(holes).tolist())

    def first_storable_token(self, kv_groups: GroupGeometry) -> int:
        """Where a store may start so that no chunk with an unfillable row is persisted.

        LMCache's store mask can only skip a leading run of tokens, so every chunk up
        to the last hole chunk is left out: better recomputed later than loaded stale.
        """
        holes = self.store_hole_chunks(kv_groups)
        return min(self.num_tokens, (holes[-1] + 1) * self.chunk_size) if holes else 0


def step_block_ids(
    kv_groups: KVGroups,
    tracker: GroupBlockTracker,
    num_tokens: int,
    chunk_size: int,
    vllm_cached_tokens: int = 0,
) -> StepBlockIds:
    """The `StepBlockIds` of a request whose first `num_tokens` tokens move."""
    if tracker.num_groups != kv_groups.num_groups:
        raise ValueError(
            f"tracker has {tracker.num_groups} KV-cache groups, the model has {kv_groups.num_groups}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be a positive integer (LMCache chunk_size)")
    indices = kv_groups.transferred_group_indices
    counts = []
    for index in indices:
        group = kv_groups.groups[index]
        needed = group.num_blocks(num_tokens)
        tracked = len(tracker.block_ids_by_group[index])
        if needed > tracked:
            raise ValueError(
                f"KV-cache group {index} ({group.spec_class_name}): {num_tokens} tokens need {needed} blocks "
                f"of {group.block_size} tokens but only {tracked} are tracked"
            )
        counts.append(needed)
    return StepBlockIds(
        geometry_digest=kv_groups.geometry_digest,
        packed_block_ids=tracker.packed_block_ids(indices, tuple(counts)),
        num_tokens=num_tokens,
        chunk_size=chunk_size,
        vllm_cached_tokens=vllm_cached_tokens,
    )
