"""Which freed KV-cache blocks are reused first.

vLLM allocates from the front of its free queue and evicts cached blocks
only when it reuses them. Blocks freed without a prefix-cache hash
("scratch") hold nothing worth keeping, so they go to the front; cached
blocks go to the back, where they survive a burst of scratch allocations
(vLLM 0.23: ``free_blocks(..., prepend=True)`` for the uncached part).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, TypeVar

Block = TypeVar("Block")


@dataclass
class FreeSplit(Generic[Block]):
    """Blocks in the order they are freed, split by destination."""

    to_front: list[Block] = field(default_factory=list)  # uncached: reuse first
    to_back: list[Block] = field(default_factory=list)  # cached: reuse last


def split_for_free(blocks_in_free_order: Iterable[Block], is_cached: Callable[[Block], bool]) -> FreeSplit[Block]:
    """Partition `blocks_in_free_order`, keeping the relative order of each part."""
    split: FreeSplit[Block] = FreeSplit()
    for block in blocks_in_free_order:
        (split.to_back if is_cached(block) else split.to_front).append(block)
    return split


def free_scratch_first(block_pool, blocks_in_free_order: Iterable[Block]) -> None:
    """Free `blocks_in_free_order` into vLLM's `block_pool`: cached ones to the back of the
    free queue, then scratch ones to the front (``free_blocks(..., prepend=True)``)."""
    split = split_for_free(blocks_in_free_order, _is_cached)
    block_pool.free_blocks(split.to_back)
    block_pool.free_blocks(split.to_front, prepend=True)


def _is_cached(block) -> bool:
    return block.block_hash is not None
