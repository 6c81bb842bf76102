"""The coordinator side of the scheduler-block-size backport (vLLM 0.18).

``KVCacheCoordinator.__init__`` takes ``scheduler_block_size`` (default: the
LCM of all groups' block sizes, the group's own block size for a single
group), hands it to every single-type manager, and reads and validates
``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` once (``auto`` = upstream's unset);
``cache_blocks`` caches a hybrid model's blocks only up to the last
scheduler-block boundary and passes the retention interval to the
sliding-window managers; ``get_kv_cache_coordinator`` threads the keyword in.
The threading itself is `lmcache_ascend.prefix_cache.scheduler_threading`.
"""

from __future__ import annotations

from lmcache_ascend.compat.signatures import accepts_keyword
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard, adds_keywords


def _has_scheduler_block_size(module) -> bool | None:
    return accepts_keyword(module.KVCacheCoordinator.__init__, "scheduler_block_size")


@adds_keywords(scheduler_block_size=None)
def init_wrapper(wrapped, instance, args, kwargs):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from lmcache_ascend.flags import flag_value
    from lmcache_ascend.prefix_cache.retention import FLAG_NAME, retention_interval_from_flag
    from lmcache_ascend.prefix_cache.scheduler_threading import (
        SLIDING_WINDOW_ATTRIBUTE,
        default_scheduler_block_size,
        thread_scheduler_block_size,
    )

    scheduler_block_size = kwargs.pop("scheduler_block_size", None)
    wrapped(*args, **kwargs)
    # Read once per coordinator, like upstream's envs lookup.
    instance.retention_interval = retention_interval_from_flag(flag_value(FLAG_NAME))
    groups = instance.kv_cache_config.kv_cache_groups
    setattr(instance, SLIDING_WINDOW_ATTRIBUTE, any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in groups))
    for manager in instance.single_type_managers:
        manager.use_eagle = bool(getattr(instance, "use_eagle", False))
    if scheduler_block_size is None:
        scheduler_block_size = default_scheduler_block_size(instance)
    thread_scheduler_block_size(instance, scheduler_block_size)


def cache_blocks(self, request, num_computed_tokens: int) -> None:
    """vLLM 0.23's ``cache_blocks``: aligned for hybrid models, the retention interval to sliding windows.

    A replacement (the original caches every manager densely, which is what it changes).
    """
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    num_tokens = num_computed_tokens
    if isinstance(self, HybridKVCacheCoordinator):
        # Hits end on scheduler-block boundaries only; caching past the last
        # one would keep blocks no hit can use.
        num_tokens = num_computed_tokens // self.scheduler_block_size * self.scheduler_block_size
    for manager in self.single_type_managers:
        if isinstance(manager, SlidingWindowManager):
            manager.cache_blocks(request, num_tokens, retention_interval=self.retention_interval)
        else:
            manager.cache_blocks(request, num_tokens)


@adds_keywords(scheduler_block_size=None)
def factory_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.prefix_cache.scheduler_threading import thread_scheduler_block_size

    scheduler_block_size = kwargs.pop("scheduler_block_size", None)
    coordinator = wrapped(*args, **kwargs)
    if scheduler_block_size is not None:
        thread_scheduler_block_size(coordinator, scheduler_block_size)
    return coordinator


PATCH = Patch(
    name="vllm-coordinator-scheduler-block-size",
    target="vllm.v1.core.kv_cache_coordinator",
    attributes=("KVCacheCoordinator.__init__", "KVCacheCoordinator.cache_blocks", "get_kv_cache_coordinator"),
    kind=PatchKind.WRAP,
    wrappers={"KVCacheCoordinator.__init__": init_wrapper, "get_kv_cache_coordinator": factory_wrapper},
    build=lambda ctx: {"KVCacheCoordinator.cache_blocks": cache_blocks},
    after=("vllm-sliding-window-retention",),
    requires={"vllm": ">=0.18.0"},
    flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",),
    guard=UpstreamGuard(
        probe=_has_scheduler_block_size,
        fixed_if_source_contains=("scheduler_block_size",),
        unfixed_if_source_contains=("self.lcm_block_size = lcm(",),
    ),
    summary="coordinator takes scheduler_block_size (LCM of groups), threads it to managers, applies the retention interval",
    why="vLLM 0.18's managers never learn the hit alignment, so they cannot keep sparse checkpoints",
    mirrors="vLLM 0.23 KVCacheCoordinator(scheduler_block_size=), retention validation, hybrid cache_blocks alignment",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (later vLLM has the fix: skipped there).
    tested_fingerprints={
        "KVCacheCoordinator.__init__": ("658fa28fab8c",),
        "KVCacheCoordinator.cache_blocks": ("30b0d15e0b53",),
        "get_kv_cache_coordinator": ("239b7f630035",),
    },
)
