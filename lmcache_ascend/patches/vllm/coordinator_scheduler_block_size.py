"""Backport the scheduler block size and retention interval to vLLM's KV-cache coordinator.

What:
- ``KVCacheCoordinator.__init__`` takes ``scheduler_block_size`` (default: the
  LCM of all groups' block sizes, the group's own block size for a single
  group), hands it to every single-type manager, and reads and validates
  ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` once (``auto`` = upstream's unset);
- ``KVCacheCoordinator.cache_blocks`` caches a hybrid model's blocks only up to
  the last scheduler-block boundary (hits can't end elsewhere) and passes the
  retention interval to the sliding-window managers;
- ``get_kv_cache_coordinator`` takes ``scheduler_block_size`` and threads it in.
Why: vLLM 0.18 aligns hybrid hits to the LCM inside ``find_longest_cache_hit``
only; the managers never learn it, so they can neither thin their checkpoints
nor honour a retention interval.
Mirrors: vLLM 0.23 ``KVCacheCoordinator(scheduler_block_size=...)``,
``_validate_prefix_cache_retention_interval`` and
``HybridKVCacheCoordinator.cache_blocks``.
Delete when: the oldest supported vLLM is >= 0.23.
Needs `vllm-sliding-window-retention` (managers accepting ``retention_interval``).
"""

from __future__ import annotations


from lmcache_ascend.flags import flag_value
from lmcache_ascend.compat.signatures import accepts_keyword
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.prefix_cache.block_sizes import scheduler_block_size as lcm_scheduler_block_size
from lmcache_ascend.prefix_cache.retention import (
    FLAG_NAME as RETENTION_FLAG,
    retention_interval_from_flag,
    validate_retention_interval,
)


def _has_scheduler_block_size(module) -> bool | None:
    return accepts_keyword(module.KVCacheCoordinator.__init__, "scheduler_block_size")


def default_scheduler_block_size(coordinator) -> int:
    """LCM of the group block sizes; a single group keeps its manager's (dcp/pcp-scaled) size."""
    groups = coordinator.kv_cache_config.kv_cache_groups
    managers = coordinator.single_type_managers
    single = managers[0].block_size if len(managers) == 1 else None
    return lcm_scheduler_block_size([group.kv_cache_spec.block_size for group in groups], single)


def thread_scheduler_block_size(coordinator, scheduler_block_size: int) -> None:
    """Give `coordinator` and its managers `scheduler_block_size`, checking it fits every group."""
    bad = [manager.block_size for manager in coordinator.single_type_managers if scheduler_block_size % manager.block_size]
    if scheduler_block_size < 1 or bad:
        raise ValueError(
            f"scheduler_block_size={scheduler_block_size} must be a positive multiple of every group's "
            f"block size; not a multiple of {bad}"
        )
    coordinator.scheduler_block_size = scheduler_block_size
    if hasattr(coordinator, "lcm_block_size"):
        # vLLM 0.18's hybrid coordinator aligns hits to its own LCM: keep the two equal.
        coordinator.lcm_block_size = scheduler_block_size
    for manager in coordinator.single_type_managers:
        manager.scheduler_block_size = scheduler_block_size
    validate_retention_interval(
        coordinator.retention_interval, scheduler_block_size, _has_sliding_window_group(coordinator)
    )


def _has_sliding_window_group(coordinator) -> bool:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return any(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in coordinator.kv_cache_config.kv_cache_groups)


def _build(ctx: PatchContext) -> dict[str, object]:
    from vllm.v1.core import single_type_kv_cache_manager as managers_module

    sliding_window_manager = managers_module.SlidingWindowManager
    hybrid_coordinator = ctx.module.HybridKVCacheCoordinator
    original_init = ctx.original_function("KVCacheCoordinator.__init__")
    original_factory = ctx.original_function("get_kv_cache_coordinator")

    def __init__(self, *args, scheduler_block_size: int | None = None, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        # Read once per coordinator, like upstream's envs lookup.
        self.retention_interval = retention_interval_from_flag(flag_value(RETENTION_FLAG))
        for manager in self.single_type_managers:
            manager.use_eagle = bool(getattr(self, "use_eagle", False))
        thread_scheduler_block_size(
            self, default_scheduler_block_size(self) if scheduler_block_size is None else scheduler_block_size
        )

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        num_tokens = num_computed_tokens
        if isinstance(self, hybrid_coordinator):
            # Hits end on scheduler-block boundaries only; caching past the last
            # one would keep blocks no hit can use.
            num_tokens = num_computed_tokens // self.scheduler_block_size * self.scheduler_block_size
        for manager in self.single_type_managers:
            if isinstance(manager, sliding_window_manager):
                manager.cache_blocks(request, num_tokens, retention_interval=self.retention_interval)
            else:
                manager.cache_blocks(request, num_tokens)

    def get_kv_cache_coordinator(*args, scheduler_block_size: int | None = None, **kwargs):
        coordinator = original_factory(*args, **kwargs)
        if scheduler_block_size is not None:
            thread_scheduler_block_size(coordinator, scheduler_block_size)
        return coordinator

    return {
        "KVCacheCoordinator.__init__": __init__,
        "KVCacheCoordinator.cache_blocks": cache_blocks,
        "get_kv_cache_coordinator": get_kv_cache_coordinator,
    }


PATCH = Patch(
    name="vllm-coordinator-scheduler-block-size",
    target="vllm.v1.core.kv_cache_coordinator",
    attributes=("KVCacheCoordinator.__init__", "KVCacheCoordinator.cache_blocks", "get_kv_cache_coordinator"),
    kind=PatchKind.WRAP,
    after=("vllm-sliding-window-retention",),
    requires={"vllm": ">=0.18.0"},
    flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",),
    guard=UpstreamGuard(
        probe=_has_scheduler_block_size,
        fixed_if_source_contains=("scheduler_block_size",),
        unfixed_if_source_contains=("self.lcm_block_size = lcm(",),
    ),
    build=_build,
    summary="coordinator takes scheduler_block_size (LCM of groups), threads it to managers, applies the retention interval",
    why="vLLM 0.18's managers never learn the hit alignment, so they cannot keep sparse checkpoints",
    mirrors="vLLM 0.23 KVCacheCoordinator(scheduler_block_size=), retention validation, hybrid cache_blocks alignment",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (stack A; B skips).
    tested_fingerprints={
        "KVCacheCoordinator.__init__": ("658fa28fab8c",),
        "KVCacheCoordinator.cache_blocks": ("30b0d15e0b53",),
        "get_kv_cache_coordinator": ("239b7f630035",),
    },
)
