"""Backport ``BlockPool.free_blocks(..., prepend=)`` to vLLM releases without it.

What: ``free_blocks`` takes ``prepend``; with ``prepend=True`` the blocks that
become free go to the FRONT of the free queue (reused first) instead of the
back. The default (``False``) is the original behaviour, untouched.
Why: callers free uncached scratch blocks with ``prepend=True`` and cached
blocks normally, so scratch churn does not evict prefix-cache entries.
Mirrors: vLLM 0.23 ``BlockPool.free_blocks(ordered_blocks, prepend=False)``.
Delete when: the oldest supported vLLM is >= 0.23.
Comes after `vllm-free-queue-prepend` (``prepend_n``).
"""

from __future__ import annotations

import inspect

from lmcache_ascend.compat.signatures import accepts_keyword
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard


def _orders_frees_upstream(module) -> bool | None:
    """vLLM 0.23 lets callers pass ``prepend=``; vLLM 0.33 has ``free_blocks`` put
    uncached blocks first by itself (``prepend_n``). Either way upstream has it."""
    free_blocks = module.BlockPool.free_blocks
    if accepts_keyword(free_blocks, "prepend"):
        return True
    try:
        source = inspect.getsource(free_blocks)
    except (OSError, TypeError):
        return None
    return "prepend_n(" in source


def _build(ctx: PatchContext) -> dict[str, object]:
    original_free_blocks = ctx.original_function("BlockPool.free_blocks")

    def free_blocks(self, ordered_blocks, prepend: bool = False) -> None:
        if not prepend:
            original_free_blocks(self, ordered_blocks)
            return
        blocks = list(ordered_blocks)
        # The original appends the blocks that reach ref_cnt 0; move exactly
        # those to the front, in the same order.
        original_free_blocks(self, blocks)
        queue = self.free_block_queue
        now_free = [block for block in blocks if block.ref_cnt == 0 and not block.is_null]
        for block in now_free:
            queue.remove(block)
        queue.prepend_n(now_free)

    return {"BlockPool.free_blocks": free_blocks}


PATCH = Patch(
    name="vllm-block-pool-free-prepend",
    target="vllm.v1.core.block_pool",
    attributes=("BlockPool.free_blocks",),
    kind=PatchKind.WRAP,
    after=("vllm-free-queue-prepend",),
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=_orders_frees_upstream,
        fixed_if_source_contains=("free_block_queue.prepend_n(",),
        unfixed_if_source_contains=("def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:",),
    ),
    build=_build,
    summary="BlockPool.free_blocks(..., prepend=True) puts newly free blocks at the front of the free queue",
    why="uncached scratch blocks are reused first, cached blocks last, so the prefix cache survives",
    mirrors="vLLM 0.23 BlockPool.free_blocks(prepend=) (sliding-window prefix-cache retention work)",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (stack A; B skips).
    tested_fingerprints={
        "BlockPool.free_blocks": ("d8825b31501c",),
    },
)
