"""Per-request block IDs of every KV-cache group.

LMCache's ``RequestTracker`` keeps ``block_ids[0]`` only; this tracker keeps
one int64 array per group and follows vLLM's scheduler outputs: a new request
brings its full block table, a running request appends the newly allocated
blocks of each group, and a request resumed after preemption brings a fresh
table, which becomes a new tracker. Block id 0 is vLLM's null block (a hole,
e.g. a sliding-window block that fell out of the window); it is kept in place so
that block positions stay aligned with token positions.
"""

from __future__ import annotations

import sys
from array import array
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
# How a tracker holds a group's ids: machine int64, which is BLOCK_ID_DTYPE on little-endian hosts.
_TYPECODE = "q"
_NATIVE_IS_WIRE = sys.byteorder == "little" and array(_TYPECODE).itemsize == BLOCK_ID_DTYPE.itemsize


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
    """Block IDs per KV-cache group of one request, in order.

    Each group's ids are an ``array('q')``, not a list: a list keeps every id's int object alive
    (vLLM's scheduler hands out new ones every step), and a server's running requests hold
    thousands each with small-block groups, which spreads the scheduler's own objects over more
    memory and makes its per-request loop measurably slower. The arrays are held in a tuple
    (`block_ids_by_group`), whose items sit in the tuple object itself: a decode step that
    appends a block follows one pointer less than through a list.
    """

    __slots__ = ("block_ids_by_group",)

    def __init__(self, block_ids_by_group: Sequence[Sequence[int]]) -> None:
        self.block_ids_by_group: tuple[array, ...] = tuple(array(_TYPECODE, ids) for ids in block_ids_by_group)

    def packed_block_ids(self, groups: tuple[int, ...], counts: tuple[int, ...]) -> bytes:
        """The first ``counts[i]`` block ids of group ``groups[i]``, for each i in order, packed
        one after the other as `BLOCK_ID_DTYPE` (`unpack_block_ids` reads them): one copy of the
        arrays' bytes. Each count must be at most the group's tracked blocks."""
        tables = self.block_ids_by_group
        parts = []
        for group, count in zip(groups, counts):
            table = tables[group]
            if count > len(table):
                raise ValueError(
                    f"counts {counts} of groups {groups} exceed the tracked blocks {self.num_blocks_by_group()}; "
                    "each count may be at most its group's tracked blocks"
                )
            parts.append(memoryview(table)[:count])
        if _NATIVE_IS_WIRE:
            return b"".join(parts)
        return b"".join(np.asarray(part, dtype=np.int64).astype(BLOCK_ID_DTYPE).tobytes() for part in parts)

    @classmethod
    def for_new_request(
        cls, block_ids: Sequence[Sequence[int] | None] | None, num_groups: int
    ) -> "GroupBlockTracker":
        return cls(normalize_group_block_ids(block_ids, num_groups, "new request block_ids"))

    @property
    def num_groups(self) -> int:
        return len(self.block_ids_by_group)

    def block_id_lists(self) -> list[list[int]]:
        """Each group's block ids as a list of ints."""
        return [table.tolist() for table in self.block_ids_by_group]

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
            if array(_TYPECODE, table[: len(tracked)]) != tracked:
                raise ValueError(
                    f"KV-cache group {group}: the block table {list(table)[:8]}... does not start with "
                    f"the {len(tracked)} tracked blocks {tracked[:8].tolist()}...; blocks are only appended"
                )
            tracked.extend(table[len(tracked) :])

    def num_blocks_by_group(self) -> tuple[int, ...]:
        return tuple(map(len, self.block_ids_by_group))

    def __repr__(self) -> str:
        return f"GroupBlockTracker(blocks per group={list(self.num_blocks_by_group())})"
