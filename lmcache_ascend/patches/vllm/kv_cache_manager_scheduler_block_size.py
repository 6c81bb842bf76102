"""The KV-cache manager side of the scheduler-block-size backport (vLLM 0.18).

``KVCacheManager.__init__`` accepts ``scheduler_block_size`` (default: the
coordinator's own) and threads it into the coordinator and its single-type
managers (`lmcache_ascend.prefix_cache.scheduler_threading`); it also keeps it
as ``self.scheduler_block_size``.
"""

from __future__ import annotations

from lmcache_ascend.compat.signatures import accepts_keyword
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard, adds_keywords


def _has_scheduler_block_size(module) -> bool | None:
    return accepts_keyword(module.KVCacheManager.__init__, "scheduler_block_size")


@adds_keywords(scheduler_block_size=None)
def init_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.prefix_cache.scheduler_threading import thread_scheduler_block_size

    scheduler_block_size = kwargs.pop("scheduler_block_size", None)
    wrapped(*args, **kwargs)
    if not hasattr(instance.coordinator, "retention_interval"):
        raise RuntimeError(
            "the KV-cache coordinator was not patched: apply vllm-coordinator-scheduler-block-size first"
        )
    if scheduler_block_size is not None:
        thread_scheduler_block_size(instance.coordinator, scheduler_block_size)
    instance.scheduler_block_size = instance.coordinator.scheduler_block_size


PATCH = Patch(
    name="vllm-kv-cache-manager-scheduler-block-size",
    target="vllm.v1.core.kv_cache_manager",
    attributes=("KVCacheManager.__init__",),
    kind=PatchKind.WRAP,
    wrappers={"KVCacheManager.__init__": init_wrapper},
    after=("vllm-coordinator-scheduler-block-size",),
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=_has_scheduler_block_size,
        fixed_if_source_contains=("scheduler_block_size",),
        unfixed_if_source_contains=("hash_block_size=hash_block_size,",),
    ),
    summary="KVCacheManager(scheduler_block_size=) threads the scheduler's block size into the coordinator",
    why="vLLM 0.18 cannot hand the hit alignment from the scheduler to the KV-cache managers",
    mirrors="vLLM 0.23 KVCacheManager(scheduler_block_size=)",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (later vLLM has the fix: skipped there).
    tested_fingerprints={
        "KVCacheManager.__init__": ("e3bf7cf6f4ee",),
    },
)
