"""Block sizes that prefix caching aligns to.

- The scheduler block size of a model with several KV-cache groups is the
  least common multiple of the groups' block sizes: a prefix hit must end on
  a block boundary of every group (vLLM 0.23 computes it once and threads it
  Scheduler -> KVCacheManager -> coordinator -> managers).
- DeepSeek-V4 on vllm-ascend stores compressed KV (compress ratio 128) in
  blocks of ``storage_block_size`` compressed rows; one such block covers
  ``storage_block_size * compress_ratio`` prompt tokens, which is the block
  size prefix matching must use for that group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

COMPRESSED_BLOCK_SIZE_FLAG = "VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE"
ALLOWED_COMPRESSED_BLOCK_SIZES = (32, 64, 128)
LEGACY_COMPRESSED_BLOCK_SIZE = 128
# The only compress ratio whose block size the flag may change; every other ratio keeps 128.
CONFIGURABLE_COMPRESS_RATIO = 128


def scheduler_block_size(group_block_sizes: Iterable[int], single_group_block_size: int | None = None) -> int:
    """LCM of every group's block size; a single group keeps ``single_group_block_size``.

    ``single_group_block_size`` is what the engine passes for a one-group
    model (``cache_config.block_size * dcp * pcp``), so context parallelism
    keeps its scaled block size there, as upstream does.
    """
    sizes = list(group_block_sizes)
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"group block sizes {sizes} must all be positive integers; got {size!r}")
    if not sizes:
        if single_group_block_size is None:
            raise ValueError("scheduler_block_size needs at least one group block size")
        return single_group_block_size
    if len(sizes) == 1 and single_group_block_size is not None:
        return single_group_block_size
    return math.lcm(*sizes)


def compressed_kv_block_size(compress_ratio: int, configured: int) -> int:
    """Block size (compressed rows) for a DeepSeek-V4 compressed KV cache.

    ``configured`` is the validated flag value; it only applies where the
    compress ratio is 128, every other ratio keeps the legacy 128.
    """
    if configured not in ALLOWED_COMPRESSED_BLOCK_SIZES:
        raise ValueError(
            f"{COMPRESSED_BLOCK_SIZE_FLAG}={configured!r} is not allowed; allowed: "
            + " | ".join(str(size) for size in ALLOWED_COMPRESSED_BLOCK_SIZES)
        )
    if compress_ratio != CONFIGURABLE_COMPRESS_RATIO:
        return LEGACY_COMPRESSED_BLOCK_SIZE
    return configured


def with_compressed_block_size(spec: object, configured: int) -> object:
    """`spec` with the configured compressed block size; the same object when nothing changes
    (the default 128, a compress ratio other than 128, or a spec already at that size)."""
    if spec is None or configured == LEGACY_COMPRESSED_BLOCK_SIZE:
        return spec
    compress_ratio = getattr(spec, "compress_ratio", 1)
    block_size = compressed_kv_block_size(compress_ratio, configured)
    if compress_ratio != 128 or block_size == spec.block_size:
        return spec
    return dataclasses.replace(spec, block_size=block_size)


def unpack_uniform_spec(spec: object) -> object:
    """The member spec behind a ``UniformTypeKVCacheSpecs`` (else `spec` itself).

    A uniform-type bundle carries no ``compress_ratio`` / ``storage_block_size``
    of its own; reading them off the bundle silently yields the defaults and a
    wrong LCM (the review bug of vllm-ascend #10193). All members share one
    type and block size, so the first one speaks for the bundle.
    """
    members = getattr(spec, "kv_cache_specs", None)
    if isinstance(members, dict):
        if not members:
            raise ValueError(f"{type(spec).__name__} has no member specs to take the block size from")
        return next(iter(members.values()))
    return spec


def prefix_block_size(spec: object) -> int:
    """Tokens covered by one block of `spec`, for prefix matching."""
    member = unpack_uniform_spec(spec)
    compress_ratio = max(int(getattr(member, "compress_ratio", 1) or 1), 1)
    storage_block_size = getattr(member, "storage_block_size", None)
    if compress_ratio > 1 and storage_block_size is not None:
        return int(storage_block_size) * compress_ratio
    return int(getattr(member, "block_size"))


def aggregated_page_size_bytes(page_sizes_by_group: Iterable[int]) -> int:
    """Bytes of one block across all groups that share a block id.

    With smaller compressed blocks the groups' page sizes differ, so the
    first group no longer speaks for the others: the memory one block costs is
    the sum over the groups.
    """
    sizes = list(page_sizes_by_group)
    if not sizes or any(size < 0 for size in sizes):
        raise ValueError(f"page sizes by group {sizes} must be a non-empty list of sizes >= 0")
    return sum(sizes)


def spec_with_flag_block_size(wrapped, instance, args, kwargs):
    """Wrapper of vllm-ascend's DeepSeek-V4 ``get_kv_cache_spec`` methods: the spec they
    return, with the block size ``VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE`` sets."""
    from lmcache_ascend.flags import flag_value

    return with_compressed_block_size(wrapped(*args, **kwargs), flag_value(COMPRESSED_BLOCK_SIZE_FLAG))
