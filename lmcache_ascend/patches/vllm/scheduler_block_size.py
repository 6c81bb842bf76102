"""The scheduler side of the scheduler-block-size backport (vLLM 0.18).

After ``Scheduler.__init__``, a model with several KV-cache groups gets
``scheduler.block_size`` = LCM of the groups' block sizes (one group keeps the
engine's value, which includes context parallelism), threaded into
``scheduler.kv_cache_manager``; the engine's value stays the hash block size
(``scheduler.hash_block_size``), as vLLM 0.23 splits them.  Callers written
for vLLM 0.23 may pass ``hash_block_size=`` and their resolved ``block_size``.
"""

from __future__ import annotations

from lmcache_ascend.compat.signatures import accepts_keyword
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard, adds_keywords


def _has_hash_block_size(module) -> bool | None:
    return accepts_keyword(module.Scheduler.__init__, "hash_block_size")


@adds_keywords(hash_block_size=None)
def init_wrapper(wrapped, instance, args, kwargs):
    import inspect

    from lmcache_ascend.prefix_cache.block_sizes import scheduler_block_size as lcm_scheduler_block_size
    from lmcache_ascend.prefix_cache.scheduler_threading import thread_scheduler_block_size

    hash_block_size = kwargs.pop("hash_block_size", None)
    resolved = None
    if hash_block_size is not None:
        # vLLM 0.23's callers pass block_size = the scheduler block size they resolved and
        # hash_block_size apart; vLLM 0.18's block_size is the hash block size.
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        resolved = bound.arguments["block_size"]
        bound.arguments["block_size"] = hash_block_size
        args, kwargs = bound.args, bound.kwargs
    wrapped(*args, **kwargs)
    groups = instance.kv_cache_config.kv_cache_groups if hasattr(instance, "kv_cache_config") else None
    if not groups:
        return
    instance.hash_block_size = instance.block_size
    instance.block_size = resolved or lcm_scheduler_block_size(
        [group.kv_cache_spec.block_size for group in groups], single_group_block_size=instance.block_size
    )
    manager = instance.kv_cache_manager
    if not hasattr(manager, "scheduler_block_size"):
        raise RuntimeError(
            "the KV-cache manager was not patched: apply vllm-kv-cache-manager-scheduler-block-size first"
        )
    thread_scheduler_block_size(manager.coordinator, instance.block_size)
    manager.scheduler_block_size = instance.block_size


PATCH = Patch(
    name="vllm-scheduler-lcm-block-size",
    target="vllm.v1.core.sched.scheduler",
    attributes=("Scheduler.__init__",),
    kind=PatchKind.WRAP,
    wrappers={"Scheduler.__init__": init_wrapper},
    after=("vllm-kv-cache-manager-scheduler-block-size",),
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=_has_hash_block_size,
        fixed_if_source_contains=("scheduler_block_size=self.block_size",),
        unfixed_if_source_contains=("hash_block_size=self.block_size,",),
    ),
    summary="the scheduler's block size is the LCM of all KV-cache groups' block sizes, threaded to the KV-cache manager",
    why="vLLM 0.18 schedules a hybrid model at its smallest group block size; hits align to the LCM",
    mirrors="vLLM 0.23 resolve_kv_cache_block_sizes and Scheduler -> KVCacheManager(scheduler_block_size=)",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (later vLLM has the fix: skipped there).
    tested_fingerprints={
        "Scheduler.__init__": ("d902624eb5d7",),
    },
)
