"""Backport ``BlockPool.free_blocks(..., prepend=)`` to vLLM releases without it.

``free_blocks`` takes ``prepend``; with ``prepend=True`` the blocks that
become free go to the FRONT of the free queue (reused first) instead of the
back. The default (``False``) is the original behaviour, untouched.
"""

from __future__ import annotations

import inspect

from lmcache_ascend.compat.signatures import accepts_keyword, call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard, adds_keywords


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


@adds_keywords(prepend=False)
def free_blocks_wrapper(wrapped, instance, args, kwargs):
    if not kwargs.pop("prepend", False):
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs)
    blocks = call.arguments["ordered_blocks"] = list(call.arguments["ordered_blocks"])
    # The original appends the blocks that reach ref_cnt 0; move exactly
    # those to the front, in the same order.
    wrapped(*call.args, **call.kwargs)
    queue = instance.free_block_queue
    now_free = [block for block in blocks if block.ref_cnt == 0 and not block.is_null]
    for block in now_free:
        queue.remove(block)
    queue.prepend_n(now_free)
    return None


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
    wrappers={"BlockPool.free_blocks": free_blocks_wrapper},
    summary="BlockPool.free_blocks(..., prepend=True) puts newly free blocks at the front of the free queue",
    why="uncached scratch blocks are reused first, cached blocks last, so the prefix cache survives",
    mirrors="vLLM 0.23 BlockPool.free_blocks(prepend=) (sliding-window prefix-cache retention work)",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (later vLLM has the fix: skipped there).
    tested_fingerprints={
        "BlockPool.free_blocks": ("d8825b31501c",),
    },
)
