"""The sliding-window managers' side of the prefix-cache retention backport (vLLM 0.18).

On ``SingleTypeKVCacheManager`` (so every manager class is covered), for
sliding-window managers only: ``cache_blocks`` caches just the blocks that can
serve a hit at an aligned length (the mask is
`lmcache_ascend.prefix_cache.retention`); ``free`` and ``remove_skipped_blocks``
free uncached blocks to the FRONT of the free queue and cached ones to the back
(`lmcache_ascend.prefix_cache.free_order`); ``__init__`` takes
``scheduler_block_size``.  Other managers run the originals.
"""

from __future__ import annotations

from lmcache_ascend.compat.signatures import accepts_keyword, call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard, adds_keywords


def _has_retention(module) -> bool | None:
    return accepts_keyword(module.SingleTypeKVCacheManager.cache_blocks, "retention_interval")


def _is_sliding_window(manager) -> bool:
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    return isinstance(manager, SlidingWindowManager)


@adds_keywords(scheduler_block_size=None)
def init_wrapper(wrapped, instance, args, kwargs):
    scheduler_block_size = kwargs.pop("scheduler_block_size", None)
    wrapped(*args, **kwargs)
    # Hit lengths are multiples of this; the coordinator threads the LCM of
    # all groups in here after construction.
    instance.scheduler_block_size = instance.block_size if scheduler_block_size is None else scheduler_block_size
    instance.use_eagle = getattr(instance, "use_eagle", False)


@adds_keywords(retention_interval=None)
def cache_blocks_wrapper(wrapped, instance, args, kwargs):
    retention_interval = kwargs.pop("retention_interval", None)
    if not _is_sliding_window(instance):
        return wrapped(*args, **kwargs)
    from lmcache_ascend.prefix_cache.retention import cache_sliding_window_blocks

    call = call_arguments(wrapped, args, kwargs).arguments
    cache_sliding_window_blocks(instance, call["request"], call["num_tokens"], retention_interval)
    return None


def free_wrapper(wrapped, instance, args, kwargs):
    if not _is_sliding_window(instance):
        return wrapped(*args, **kwargs)
    from lmcache_ascend.prefix_cache.free_order import free_scratch_first

    request_id = call_arguments(wrapped, args, kwargs).arguments["request_id"]
    request_blocks = instance.req_to_blocks.pop(request_id, [])
    if request_blocks:
        # Tail blocks first, as the original; scratch to the front, cached to the back.
        free_scratch_first(instance.block_pool, reversed(request_blocks))
    instance.num_cached_block.pop(request_id, None)
    return None


def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
    """vLLM 0.18's ``SingleTypeKVCacheManager.remove_skipped_blocks`` (fingerprint
    8a74571ec17e, in tested_fingerprints), whose one ``free_blocks`` call is split:
    scratch blocks to the front of the free queue, cached ones to the back."""
    from lmcache_ascend.prefix_cache.free_order import free_scratch_first

    num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
    if num_skipped_tokens <= 0:
        return
    blocks = self.req_to_blocks[request_id]
    # Tokens may be skipped before their blocks exist (external hits).
    num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
    removed = []
    for index in range(num_skipped_blocks - 1, -1, -1):
        if blocks[index] == self._null_block:
            break  # earlier blocks were nulled by an earlier call
        removed.append(blocks[index])
        blocks[index] = self._null_block
    free_scratch_first(self.block_pool, removed)


PATCH = Patch(
    name="vllm-sliding-window-retention",
    target="vllm.v1.core.single_type_kv_cache_manager",
    attributes=(
        "SingleTypeKVCacheManager.__init__",
        "SingleTypeKVCacheManager.cache_blocks",
        "SingleTypeKVCacheManager.free",
        "SingleTypeKVCacheManager.remove_skipped_blocks",
    ),
    kind=PatchKind.REPLACE,
    wrappers={
        "SingleTypeKVCacheManager.__init__": init_wrapper,
        "SingleTypeKVCacheManager.cache_blocks": cache_blocks_wrapper,
        "SingleTypeKVCacheManager.free": free_wrapper,
    },
    build=lambda ctx: {"SingleTypeKVCacheManager.remove_skipped_blocks": remove_skipped_blocks},
    after=("vllm-block-pool-free-prepend",),
    requires={"vllm": ">=0.18.0"},
    flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",),
    guard=UpstreamGuard(
        probe=_has_retention,
        fixed_if_source_contains=("retention_interval",),
        unfixed_if_source_contains=("def cache_blocks(self, request: Request, num_tokens: int) -> None:",),
    ),
    summary="sliding-window managers cache sparse checkpoints and free scratch blocks first, cached blocks last",
    why="on vLLM 0.18 scratch allocations evict the sliding-window blocks a replay needs (DSv4: ~0% hits)",
    mirrors="vLLM 0.23 SlidingWindowManager.reachable_block_mask/free and the split in remove_skipped_blocks",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (later vLLM has the fix: skipped there).
    tested_fingerprints={
        "SingleTypeKVCacheManager.__init__": ("5611abf9a9cf",),
        "SingleTypeKVCacheManager.cache_blocks": ("30fa7ba1db4a",),
        "SingleTypeKVCacheManager.free": ("c586ee01571f",),
        "SingleTypeKVCacheManager.remove_skipped_blocks": ("8a74571ec17e",),
    },
)
