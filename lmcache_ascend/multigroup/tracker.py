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

import struct
from typing import Sequence

import numpy as np

__all__ = ["NULL_BLOCK_ID", "GroupBlockTracker", "normalize_group_block_ids"]

# vLLM's BlockPool reserves block 0 as the null block.
NULL_BLOCK_ID = 0

_NO_BLOCK_IDS = np.frombuffer(b"", dtype=np.int64)


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

    __slots__ = ("block_ids_by_group", "_joined", "_joined_groups", "_joined_counts")

    def __init__(self, block_ids_by_group: list[list[int]]) -> None:
        self.block_ids_by_group = block_ids_by_group
        self._forget_joined()

    def _forget_joined(self) -> None:
        # The last `joined_block_ids` answer and what it holds: its groups' first blocks,
        # `_joined_counts` of each, one group after the other. Blocks are only appended
        # (or the table replaced, which forgets it), so the next call converts only the
        # blocks beyond these and copies the rest from it.
        self._joined: np.ndarray = _NO_BLOCK_IDS
        self._joined_groups: tuple[int, ...] = ()
        self._joined_counts: tuple[int, ...] = ()

    def joined_block_ids(self, groups: tuple[int, ...], counts: tuple[int, ...]) -> np.ndarray:
        """The first ``counts[i]`` block ids of group ``groups[i]``, for each i in order, in ONE
        read-only int64 array over a buffer of exactly its bytes (pickled alone; also what the
        next call builds on). Each count must be at most the group's tracked blocks
        (`step_block_ids` checks).

        A scheduler step ships this array, so it runs on every step of every request. Each id
        is converted from vLLM's Python ints once per request, by `struct` (a third of numpy's
        cost per int), and the blocks held by the last answer are copied as bytes: a step is
        one `bytes.join` and one `np.frombuffer` however many groups there are.
        """
        tables = self.block_ids_by_group
        if self._joined_groups == groups:
            held = self._joined_counts
            if held == counts:
                return self._joined
        else:
            held = (0,) * len(groups)
        previous = memoryview(self._joined)
        parts: list = []
        old_cursor = 0
        for group, count, had in zip(groups, counts, held):
            keep = had if had < count else count
            if keep:
                parts.append(previous[old_cursor : old_cursor + keep])
            if count > keep:
                new_ids = tables[group][keep:count]
                parts.append(struct.pack(f"{len(new_ids)}q", *new_ids))
            old_cursor += had
        joined = np.frombuffer(b"".join(parts), dtype=np.int64)
        if len(joined) != sum(counts):
            raise ValueError(
                f"counts {counts} of groups {groups} exceed the tracked blocks {self.num_blocks_by_group()}; "
                "each count may be at most its group's tracked blocks"
            )
        self._joined, self._joined_groups, self._joined_counts = joined, groups, counts
        return joined

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
        self._forget_joined()

    def num_blocks_by_group(self) -> tuple[int, ...]:
        return tuple(map(len, self.block_ids_by_group))

    def __repr__(self) -> str:
        return f"GroupBlockTracker(blocks per group={list(self.num_blocks_by_group())})"
