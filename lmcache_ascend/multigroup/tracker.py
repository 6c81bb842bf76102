"""Per-request block IDs of every KV-cache group.

LMCache's ``RequestTracker`` keeps ``block_ids[0]`` only; this tracker keeps
one list per group and follows vLLM's scheduler outputs: a new request brings
its full block table, a running request appends the newly allocated blocks of
each group, and a request resumed after preemption brings a fresh table that
replaces the old one. Block id 0 is vLLM's null block (a hole, e.g. a
sliding-window block that fell out of the window); it is kept in place so that
block positions stay aligned with token positions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["NULL_BLOCK_ID", "GroupBlockTracker", "normalize_group_block_ids"]

# vLLM's BlockPool reserves block 0 as the null block.
NULL_BLOCK_ID = 0


def normalize_group_block_ids(
    block_ids: Sequence[Sequence[int] | None] | None, num_groups: int, what: str
) -> tuple[Sequence[int], ...]:
    """vLLM's per-group block ids as a tuple of `num_groups` sequences.

    None (nothing new) and per-group None become empty; a flat list of ints
    (vLLM < 0.9, single group) is accepted only when there is one group.
    """
    if block_ids is None or len(block_ids) == 0:
        return ((),) * num_groups
    first = block_ids[0]
    if isinstance(first, int):
        if num_groups != 1:
            raise ValueError(
                f"{what}: got a flat list of {len(block_ids)} block ids but the model has "
                f"{num_groups} KV-cache groups; expected one list per group"
            )
        return (block_ids,)  # type: ignore[return-value]
    if len(block_ids) != num_groups:
        raise ValueError(
            f"{what}: got block ids for {len(block_ids)} KV-cache groups, expected {num_groups}"
        )
    groups = tuple(block_ids)
    # Runs on every scheduler step of every request: the common case (no
    # group is None) returns the tuple as is, after identity tests only.
    for ids in groups:
        if ids is None:
            return tuple(() if ids is None else ids for ids in groups)
    return groups


class GroupBlockTracker:
    """Block IDs per KV-cache group of one request (list per group, in order)."""

    __slots__ = ("block_ids_by_group", "_id_arrays", "_id_array_counts")

    def __init__(self, block_ids_by_group: list[list[int]]) -> None:
        self.block_ids_by_group = block_ids_by_group
        self._drop_id_arrays()

    def _drop_id_arrays(self) -> None:
        # Per group, an int64 copy of the first `_id_array_counts[g]` block ids, grown as
        # blocks are appended (a step then converts only its new blocks); valid while
        # blocks are only appended, dropped when the table is replaced.
        self._id_arrays = [np.empty(0, dtype=np.int64) for _ in self.block_ids_by_group]
        self._id_array_counts = [0] * len(self.block_ids_by_group)

    def block_id_array(self, group: int, count: int) -> np.ndarray:
        """The first `count` block ids of `group` as int64 (a view: copy before keeping it)."""
        ids = self.block_ids_by_group[group]
        if count > len(ids):
            raise ValueError(f"KV-cache group {group}: {count} blocks asked, {len(ids)} tracked")
        held = self._id_array_counts[group]
        if held < count:
            array = self._id_arrays[group]
            if count > len(array):
                grown = np.empty(max(count, 2 * len(array)), dtype=np.int64)
                grown[:held] = array[:held]
                self._id_arrays[group] = array = grown
            array[held:count] = ids[held:count]
            self._id_array_counts[group] = count
        return self._id_arrays[group][:count]

    @classmethod
    def for_new_request(
        cls, block_ids: Sequence[Sequence[int] | None] | None, num_groups: int
    ) -> "GroupBlockTracker":
        groups = normalize_group_block_ids(block_ids, num_groups, "new request block_ids")
        return cls([list(ids) for ids in groups])

    @property
    def num_groups(self) -> int:
        return len(self.block_ids_by_group)

    def append_new_blocks(self, new_block_ids: Sequence[Sequence[int] | None] | None) -> None:
        """A running request was scheduled again: append each group's new blocks."""
        groups = normalize_group_block_ids(new_block_ids, self.num_groups, "new_block_ids")
        for tracked, new in zip(self.block_ids_by_group, groups):
            if new:
                tracked.extend(new)

    def extend_to(self, all_block_ids: Sequence[Sequence[int] | None] | None) -> None:
        """vLLM passed a group's whole table again: append what lies beyond the tracked blocks."""
        groups = normalize_group_block_ids(all_block_ids, self.num_groups, "allocated block_ids")
        for group, (tracked, table) in enumerate(zip(self.block_ids_by_group, groups)):
            if list(table[: len(tracked)]) != tracked:
                raise ValueError(
                    f"KV-cache group {group}: the block table {list(table)[:8]}... does not start with "
                    f"the {len(tracked)} tracked blocks {tracked[:8]}...; blocks are only appended"
                )
            tracked.extend(table[len(tracked) :])

    def reset_after_preemption(self, block_ids: Sequence[Sequence[int] | None] | None) -> None:
        """A preempted request resumed: its old blocks are gone, the new table replaces them."""
        groups = normalize_group_block_ids(block_ids, self.num_groups, "resumed request block_ids")
        self.block_ids_by_group = [list(ids) for ids in groups]
        self._drop_id_arrays()

    def num_blocks_by_group(self) -> tuple[int, ...]:
        return tuple(map(len, self.block_ids_by_group))

    def __repr__(self) -> str:
        return f"GroupBlockTracker(blocks per group={list(self.num_blocks_by_group())})"
