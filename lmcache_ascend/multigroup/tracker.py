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

__all__ = [
    "BLOCK_ID_DTYPE",
    "NULL_BLOCK_ID",
    "GroupBlockTracker",
    "normalize_group_block_ids",
    "unpack_block_ids",
]

# vLLM's BlockPool reserves block 0 as the null block.
NULL_BLOCK_ID = 0

# Block ids as the scheduler ships them to the workers: little-endian int64, one after the other.
BLOCK_ID_DTYPE = np.dtype("<i8")
_ID_BYTES = BLOCK_ID_DTYPE.itemsize
_PACK_FORMAT = "<%dq"  # struct's spelling of BLOCK_ID_DTYPE, for a count of ids


def unpack_block_ids(packed: bytes) -> np.ndarray:
    """`GroupBlockTracker.packed_block_ids` as a read-only int64 array over `packed` (no copy)."""
    return np.frombuffer(packed, dtype=BLOCK_ID_DTYPE)


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

    __slots__ = ("block_ids_by_group", "_packed", "_packed_groups", "_packed_counts")

    def __init__(self, block_ids_by_group: list[list[int]]) -> None:
        self.block_ids_by_group = block_ids_by_group
        self._forget_packed()

    def _forget_packed(self) -> None:
        # The last `packed_block_ids` answer and what it holds: its groups' first blocks,
        # `_packed_counts` of each, one group after the other. Blocks are only appended
        # (or the table replaced, which forgets it), so the next call packs only the
        # blocks beyond these and copies the rest from it.
        self._packed: bytes = b""
        self._packed_groups: tuple[int, ...] = ()
        self._packed_counts: tuple[int, ...] = ()

    def packed_block_ids(self, groups: tuple[int, ...], counts: tuple[int, ...]) -> bytes:
        """The first ``counts[i]`` block ids of group ``groups[i]``, for each i in order, packed
        one after the other as `BLOCK_ID_DTYPE` (`unpack_block_ids` reads them). Each count must
        be at most the group's tracked blocks (`step_block_ids` checks).

        A scheduler step ships these bytes, so this runs on every step of every request, in
        vLLM's scheduler process; bytes cost it nothing to pickle and no numpy call to make.
        Each id is packed from vLLM's Python ints once per request, all of a call's new ids by
        one `struct.pack` (a third of numpy's cost per int); the ids the last answer held are
        copied from it as bytes, all in one `bytes.join`.
        """
        tables = self.block_ids_by_group
        if self._packed_groups == groups:
            held = self._packed_counts
            if held == counts:
                return self._packed
        else:
            held = (0,) * len(groups)
        new_ids: list[int] = []
        for group, count, had in zip(groups, counts, held):
            if count > had:
                new_ids += tables[group][had:count]
        new = memoryview(struct.pack(_PACK_FORMAT % len(new_ids), *new_ids))
        previous = memoryview(self._packed)
        parts: list[memoryview] = []
        old_cursor = new_cursor = 0  # in bytes
        for count, had in zip(counts, held):
            keep = had if had < count else count
            if keep:
                parts.append(previous[old_cursor : old_cursor + keep * _ID_BYTES])
            if count > keep:
                end = new_cursor + (count - keep) * _ID_BYTES
                parts.append(new[new_cursor:end])
                new_cursor = end
            old_cursor += had * _ID_BYTES
        packed = b"".join(parts)
        if new_cursor != len(new) or len(packed) != sum(counts) * _ID_BYTES:
            raise ValueError(
                f"counts {counts} of groups {groups} exceed the tracked blocks {self.num_blocks_by_group()}; "
                "each count may be at most its group's tracked blocks"
            )
        self._packed, self._packed_groups, self._packed_counts = packed, groups, counts
        return packed

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
        tables = self.block_ids_by_group
        for tracked, new in zip(tables, normalize_group_block_ids(new_block_ids, len(tables), "new_block_ids")):
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
        self._forget_packed()

    def num_blocks_by_group(self) -> tuple[int, ...]:
        return tuple(map(len, self.block_ids_by_group))

    def __repr__(self) -> str:
        return f"GroupBlockTracker(blocks per group={list(self.num_blocks_by_group())})"
