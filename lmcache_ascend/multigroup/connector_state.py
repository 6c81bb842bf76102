"""Connector-level decisions for multi-group mode (pure; no vLLM/LMCache import).

Reads the state-skip flags through the flag table's one resolution
(`lmcache_ascend.flags.flag_value`: environment, then LMCache's config), checks the
settings multi-group mode depends on, and builds the layout once per
connector.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lmcache_ascend.flags import flag_value
from lmcache_ascend.multigroup.specs import KVGroups, kv_groups_from_config
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy, policy_from_values

__all__ = [
    "MultiGroupConfigError",
    "check_chunk_size",
    "check_single_group_chunk_size",
    "check_discard_partial_chunks",
    "check_native_adapter",
    "kv_groups_for_connector",
    "nearest_chunk_sizes",
    "policy_for_config",
]


class MultiGroupConfigError(ValueError):
    """The connector's configuration cannot serve a multi-group model."""


def policy_for_config(lmcache_config: Any) -> StateGroupPolicy:
    return policy_from_values(
        flag_value("LMCACHE_ASCEND_SKIP_STATE_GROUPS", lmcache_config=lmcache_config),
        flag_value("LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST", lmcache_config=lmcache_config),
    )


def check_discard_partial_chunks(kv_groups: KVGroups, discard_partial_chunks: bool) -> None:
    """Multi-group stores need whole chunks: a partial chunk's compressed and
    sliding-window rows are not final until the chunk is complete."""
    if kv_groups.is_multi_group and not discard_partial_chunks:
        raise MultiGroupConfigError(
            f"a model with {kv_groups.num_groups} KV-cache groups needs discard_partial_chunks: "
            "set kv_connector_extra_config 'discard_partial_chunks': true, or leave LMCache's "
            "'save_unfull_chunk' at false (it is true now)"
        )


def check_native_adapter(use_native: bool, group_count: int) -> None:
    """vLLM's bundled ("native") copy of the LMCache adapter keeps only group 0's
    blocks: with more groups it would store and load a fraction of the KV and say
    nothing, so it is refused before any engine starts."""
    if use_native and group_count > 1:
        raise MultiGroupConfigError(
            f"kv_connector_extra_config use_native=True selects vLLM's bundled LMCache adapter, "
            f"which keeps only KV-cache group 0, but this model has {group_count} KV-cache groups; "
            "remove use_native (LMCache's own adapter, patched by lmcache-ascend, handles every group)"
        )


def _chunk_fits_blocks(chunk_size: int, block_size: int, compress_ratio: int) -> bool:
    """Every chunk is whole blocks of the group, or (compressed groups only) lies inside one block.

    Only whole blocks round-trip exactly in every attention backend: some do not keep
    a block's tokens as separate rows (vLLM's CPU backend writes a block's K transposed,
    token by token across the block), so part of a block is not part of its tokens.
    A compressed group's paged rows are this project's own layout, one row per
    compress_ratio tokens, and may hold several chunks in one block.
    """
    if chunk_size % compress_ratio:
        return False
    return chunk_size % block_size == 0 or (compress_ratio > 1 and block_size % chunk_size == 0)


def _chunk_size_fits(chunk_size: int, blocks: Sequence[tuple[int, int]]) -> bool:
    return all(_chunk_fits_blocks(chunk_size, size, ratio) for size, ratio in blocks)


def nearest_chunk_sizes(chunk_size: int, blocks: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The allowed chunk sizes nearest to `chunk_size` for `blocks` ((block_size, compress_ratio) per
    moved group): the largest below it and the smallest above it.

    Any multiple of every block size is allowed, so the search upwards ends within one
    least common multiple (run once, at connector start).
    """
    step = math.lcm(*(size for size, _ in blocks))
    below = next((size for size in range(chunk_size - 1, 0, -1) if _chunk_size_fits(size, blocks)), None)
    above = next(size for size in range(chunk_size + 1, chunk_size + step + 1) if _chunk_size_fits(size, blocks))
    return tuple(size for size in (below, above) if size is not None)


def _refuse_chunk_size(chunk_size: int, groups: Sequence[tuple[str, int, int]]) -> None:
    blocks = [(size, ratio) for _, size, ratio in groups]
    if _chunk_size_fits(chunk_size, blocks):
        return
    described = ", ".join(f"{size} ({label})" for label, size, _ in groups)
    nearest = " or ".join(str(size) for size in nearest_chunk_sizes(chunk_size, blocks))
    raise MultiGroupConfigError(
        f"LMCache chunk_size={chunk_size} does not fit the KV-cache block sizes {described}: every chunk "
        "must be whole blocks of each moved group (only a compressed group may hold several chunks in one "
        "block), or a load would write part of a block, which not every attention backend stores as whole "
        f"tokens, and the engine would not get its KV back exactly; set chunk_size to {nearest}"
    )


def check_chunk_size(kv_groups: KVGroups, chunk_size: int) -> None:
    """Every compressed row sits inside one LMCache chunk, and every chunk is whole blocks of every moved
    group (of its rows at each compress ratio, where its layers compress at several)."""
    for group, keep in zip(kv_groups.groups, kv_groups.transferred):
        for ratio in group.ratios if keep else ():
            if chunk_size % ratio:
                raise MultiGroupConfigError(
                    f"LMCache chunk_size={chunk_size} is not a multiple of compress_ratio="
                    f"{ratio} of KV-cache group {group.group_index} "
                    f"({group.spec_class_name}); choose a chunk_size divisible by every compress ratio"
                )
    moved = [kv_groups.groups[index] for index in kv_groups.transferred_group_indices]
    _refuse_chunk_size(
        chunk_size,
        [(f"group {group.group_index} {group.spec_class_name}", group.block_size, ratio)
         for group in moved for ratio in group.ratios],
    )


def check_single_group_chunk_size(vllm_block_size: int, chunk_size: int) -> None:
    """The one-group path (no KV-cache config, or vLLM's hybrid manager off): the same rule."""
    _refuse_chunk_size(chunk_size, [("vLLM block_size", vllm_block_size, 1)])


def kv_groups_for_connector(kv_cache_config: Any, vllm_block_size: int, lmcache_config: Any) -> KVGroups | None:
    """The connector's layout, or None when vLLM gave no KVCacheConfig (legacy single group)."""
    if kv_cache_config is None:
        return None
    return kv_groups_from_config(kv_cache_config, vllm_block_size, policy_for_config(lmcache_config))
