"""Per-group block arithmetic: slice rule and prefix bound.

Under vLLM's hybrid manager ``cache_config.block_size`` (the "vLLM block
size") is the GCD of the group block sizes, e.g. 4 for DeepSeek-V4 on CUDA
with groups of 256/64/64/4/8 tokens. A range counted in vLLM blocks maps onto
group g's block table by dividing (group blocks are larger) or multiplying
(group blocks are smaller) with the size ratio; this is the rule of vLLM
#42437. The prefix every group can serve is the minimum over ALL expected
groups, where a group with no blocks yet counts 0 (the review bug of #42437:
leaving missing groups out over-reports the prefix).
"""

from __future__ import annotations

from typing import Mapping

__all__ = [
    "group_block_range",
    "prefix_bound_in_vllm_blocks",
]


def _check_ratio(group_block_size: int, vllm_block_size: int) -> None:
    if group_block_size <= 0 or vllm_block_size <= 0:
        raise ValueError(
            f"block sizes must be positive; got group_block_size={group_block_size}, "
            f"vllm_block_size={vllm_block_size}"
        )
    larger, smaller = max(group_block_size, vllm_block_size), min(group_block_size, vllm_block_size)
    if larger % smaller:
        raise ValueError(
            f"group_block_size={group_block_size} and vllm_block_size={vllm_block_size} "
            "must divide one another (vLLM uses their GCD as its block size)"
        )


def group_block_range(
    start_vllm_block: int, end_vllm_block: int, group_block_size: int, vllm_block_size: int
) -> tuple[int, int]:
    """[start, end) in group blocks for [start, end) in vLLM blocks."""
    _check_ratio(group_block_size, vllm_block_size)
    if not 0 <= start_vllm_block <= end_vllm_block:
        raise ValueError(
            f"vLLM block range [{start_vllm_block}, {end_vllm_block}) is not allowed; "
            "need 0 <= start <= end"
        )
    if group_block_size >= vllm_block_size:
        ratio = group_block_size // vllm_block_size
        return start_vllm_block // ratio, end_vllm_block // ratio
    ratio = vllm_block_size // group_block_size
    return start_vllm_block * ratio, end_vllm_block * ratio


def prefix_bound_in_vllm_blocks(
    num_blocks_by_group: Mapping[int, int],
    block_size_by_group: Mapping[int, int],
    vllm_block_size: int,
) -> int:
    """Whole vLLM blocks that every expected group covers.

    Every group in `block_size_by_group` is expected; one absent from
    `num_blocks_by_group` counts as 0 blocks, so it bounds the prefix to 0.
    """
    if not block_size_by_group:
        raise ValueError("block_size_by_group is empty; at least one KV-cache group is expected")
    unknown = set(num_blocks_by_group) - set(block_size_by_group)
    if unknown:
        raise ValueError(f"blocks reported for unknown groups {sorted(unknown)}")
    bound = None
    for group, size in block_size_by_group.items():
        _check_ratio(size, vllm_block_size)
        covered = num_blocks_by_group.get(group, 0) * size // vllm_block_size
        bound = covered if bound is None else min(bound, covered)
    return bound
