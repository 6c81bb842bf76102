"""Backport vLLM 0.23's sliding-window prefix-cache retention to older vLLM.

What (on ``SingleTypeKVCacheManager``, so every manager class is covered):
- ``cache_blocks(request, num_tokens, retention_interval=None)``: sliding-window
  managers cache only the blocks that can serve a hit at an aligned length
  (checkpoints every scheduler block size, or every ``retention_interval``
  tokens plus the prompt's replay boundary); other managers cache densely as
  before;
- ``free``: sliding-window managers free uncached blocks to the FRONT of the
  free queue and cached blocks to the back;
- ``remove_skipped_blocks``: blocks that leave the window are split the same
  way (scratch first, cached last);
- ``__init__`` takes ``scheduler_block_size`` (default: the group's block size),
  the alignment the checkpoints follow.
Why: on vLLM 0.18 a DeepSeek-V4 replay keeps every sliding-window block and
appends all of them to the back of the free queue, where scratch allocations
of the next requests evict exactly the blocks a replay needs (~0% hits).
Mirrors: vLLM 0.23 ``SingleTypeKVCacheManager.cache_blocks(retention_interval=)``,
``SlidingWindowManager.reachable_block_mask`` / ``free`` and the split in
``remove_skipped_blocks``. The mask logic lives in
`lmcache_ascend.prefix_cache.retention`.
Delete when: the oldest supported vLLM is >= 0.23.
Comes after `vllm-block-pool-free-prepend`.
"""

from __future__ import annotations


from lmcache_ascend.compat.signatures import accepts_keyword
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.prefix_cache.free_order import split_for_free
from lmcache_ascend.prefix_cache.retention import SlidingWindowCheckpoints


def _has_retention(module) -> bool | None:
    return accepts_keyword(module.SingleTypeKVCacheManager.cache_blocks, "retention_interval")


def _is_cached(block) -> bool:
    return block.block_hash is not None


def _build(ctx: PatchContext) -> dict[str, object]:
    sliding_window_manager = ctx.module.SlidingWindowManager
    original_init = ctx.original_function("SingleTypeKVCacheManager.__init__")
    original_cache_blocks = ctx.original_function("SingleTypeKVCacheManager.cache_blocks")
    original_free = ctx.original_function("SingleTypeKVCacheManager.free")

    def __init__(self, *args, scheduler_block_size: int | None = None, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        # Hit lengths are multiples of this; the coordinator threads the LCM of
        # all groups in here after construction.
        self.scheduler_block_size = self.block_size if scheduler_block_size is None else scheduler_block_size
        self.use_eagle = getattr(self, "use_eagle", False)

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None) -> None:
        if not isinstance(self, sliding_window_manager):
            original_cache_blocks(self, request, num_tokens)
            return
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        checkpoints = SlidingWindowCheckpoints(
            block_size=self.block_size,
            sliding_window=self.sliding_window,
            alignment_tokens=getattr(self, "scheduler_block_size", self.block_size),
            use_eagle=getattr(self, "use_eagle", False),
            retention_interval=retention_interval,
        )
        mask = checkpoints.block_mask(num_cached_blocks, num_full_blocks, request.num_prompt_tokens)
        blocks = self.req_to_blocks[request_id]
        if mask is not None:
            # BlockPool.cache_full_blocks skips null blocks: hand it a view in
            # which the blocks that can never serve a hit are null, so they stay
            # uncached scratch (and are reused first when freed).
            blocks = list(blocks[:num_full_blocks])
            for offset, keep in enumerate(mask):
                if not keep:
                    blocks[num_cached_blocks + offset] = self._null_block
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=blocks,
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        if not isinstance(self, sliding_window_manager):
            original_free(self, request_id)
            return
        request_blocks = self.req_to_blocks.pop(request_id, [])
        if request_blocks:
            # Tail blocks first, as the original; scratch to the front, cached to the back.
            split = split_for_free(reversed(request_blocks), _is_cached)
            self.block_pool.free_blocks(split.to_back)
            self.block_pool.free_blocks(split.to_front, prepend=True)
        self.num_cached_block.pop(request_id, None)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
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
        split = split_for_free(removed, _is_cached)
        self.block_pool.free_blocks(split.to_back)
        self.block_pool.free_blocks(split.to_front, prepend=True)

    return {
        "SingleTypeKVCacheManager.__init__": __init__,
        "SingleTypeKVCacheManager.cache_blocks": cache_blocks,
        "SingleTypeKVCacheManager.free": free,
        "SingleTypeKVCacheManager.remove_skipped_blocks": remove_skipped_blocks,
    }


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
    after=("vllm-block-pool-free-prepend",),
    requires={"vllm": ">=0.18.0"},
    flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",),
    guard=UpstreamGuard(
        probe=_has_retention,
        fixed_if_source_contains=("retention_interval",),
        unfixed_if_source_contains=("def cache_blocks(self, request: Request, num_tokens: int) -> None:",),
    ),
    build=_build,
    summary="sliding-window managers cache sparse checkpoints and free scratch blocks first, cached blocks last",
    why="on vLLM 0.18 scratch allocations evict the sliding-window blocks a replay needs (DSv4: ~0% hits)",
    mirrors="vLLM 0.23 SlidingWindowManager.reachable_block_mask/free and the split in remove_skipped_blocks",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (stack A; B skips).
    tested_fingerprints={
        "SingleTypeKVCacheManager.__init__": ("5611abf9a9cf",),
        "SingleTypeKVCacheManager.cache_blocks": ("30fa7ba1db4a",),
        "SingleTypeKVCacheManager.free": ("c586ee01571f",),
        "SingleTypeKVCacheManager.remove_skipped_blocks": ("8a74571ec17e",),
    },
)
