"""Backport ``FreeKVCacheBlockQueue.prepend_n`` to vLLM releases without it.

Adds ``prepend_n(blocks)``, which links `blocks` (in order) at the front
of vLLM's free-block queue, the end that allocation takes from first.
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def prepend_n(self, blocks: list) -> None:
    """Put `blocks` at the front of the free queue, keeping their order."""
    if not blocks:
        return
    head = self.fake_free_list_head
    old_first = head.next_free_block
    if old_first is None:
        raise RuntimeError("the free queue's head sentinel lost its successor")
    previous = head
    for block in blocks:
        block.prev_free_block = previous
        previous.next_free_block = block
        previous = block
    previous.next_free_block = old_first
    old_first.prev_free_block = previous
    self.num_free_blocks += len(blocks)


PATCH = Patch(
    name="vllm-free-queue-prepend",
    target="vllm.v1.core.kv_cache_utils",
    attributes=("FreeKVCacheBlockQueue.prepend_n",),
    kind=PatchKind.ADD,
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=lambda module: hasattr(module.FreeKVCacheBlockQueue, "prepend_n"),
        fixed_if_source_contains=("def prepend_n(",),
        unfixed_if_source_contains=("class FreeKVCacheBlockQueue",),
    ),
    build=lambda ctx: {"FreeKVCacheBlockQueue.prepend_n": prepend_n},
    summary="adds FreeKVCacheBlockQueue.prepend_n (freed blocks to the front of the free queue)",
    why="scratch blocks must be reused before cached ones so prefix-cache entries survive",
    mirrors="vLLM 0.23 FreeKVCacheBlockQueue.prepend_n (sliding-window prefix-cache retention work)",
    delete_when="the oldest supported vLLM is >= 0.23",
)
