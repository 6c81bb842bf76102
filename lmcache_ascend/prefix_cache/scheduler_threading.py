"""Threading the scheduler block size through a KV-cache coordinator and its managers.

vLLM 0.23 hands ``scheduler_block_size`` (the LCM of the groups' block sizes)
from the scheduler to the KV-cache manager, the coordinator and every
single-type manager; the vLLM 0.18 backports (`patches/vllm/`) do it with
these functions, on the duck-typed objects (no vLLM import here).
"""

from __future__ import annotations

from lmcache_ascend.prefix_cache.block_sizes import scheduler_block_size as lcm_scheduler_block_size
from lmcache_ascend.prefix_cache.retention import validate_retention_interval

__all__ = ["SLIDING_WINDOW_ATTRIBUTE", "default_scheduler_block_size", "thread_scheduler_block_size"]

# Set on a coordinator when it is built (from its specs' types): whether any group is
# a sliding-window one, which decides what retention intervals are valid.
SLIDING_WINDOW_ATTRIBUTE = "ascend_has_sliding_window_group"


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
        coordinator.retention_interval, scheduler_block_size, getattr(coordinator, SLIDING_WINDOW_ATTRIBUTE)
    )
