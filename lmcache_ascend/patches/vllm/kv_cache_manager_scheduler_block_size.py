"""Let vLLM's ``KVCacheManager`` take ``scheduler_block_size`` and pass it to its coordinator.

What: ``KVCacheManager.__init__`` accepts ``scheduler_block_size`` (default: the
coordinator's own, the LCM of the groups' block sizes) and threads it into
the coordinator and its single-type managers; it also keeps it as
``self.scheduler_block_size``.
Why: the scheduler decides the alignment of prefix hits; vLLM 0.18's manager
has no way to hand it down, so the sliding-window checkpoints cannot follow it.
Mirrors: vLLM 0.23 ``KVCacheManager(..., scheduler_block_size=...)``.
Delete when: the oldest supported vLLM is >= 0.23.
Needs `vllm-coordinator-scheduler-block-size`.
"""

from __future__ import annotations


from lmcache_ascend.compat.signatures import accepts_keyword
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.patches.vllm.coordinator_scheduler_block_size import thread_scheduler_block_size


def _has_scheduler_block_size(module) -> bool | None:
    return accepts_keyword(module.KVCacheManager.__init__, "scheduler_block_size")


def _build(ctx: PatchContext) -> dict[str, object]:
    original_init = ctx.original_function("KVCacheManager.__init__")

    def __init__(self, *args, scheduler_block_size: int | None = None, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        if not hasattr(self.coordinator, "retention_interval"):
            raise RuntimeError(
                "the KV-cache coordinator was not patched: apply vllm-coordinator-scheduler-block-size first"
            )
        if scheduler_block_size is not None:
            thread_scheduler_block_size(self.coordinator, scheduler_block_size)
        self.scheduler_block_size = self.coordinator.scheduler_block_size

    return {"KVCacheManager.__init__": __init__}


PATCH = Patch(
    name="vllm-kv-cache-manager-scheduler-block-size",
    target="vllm.v1.core.kv_cache_manager",
    attributes=("KVCacheManager.__init__",),
    kind=PatchKind.WRAP,
    after=("vllm-coordinator-scheduler-block-size",),
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=_has_scheduler_block_size,
        fixed_if_source_contains=("scheduler_block_size",),
        unfixed_if_source_contains=("hash_block_size=hash_block_size,",),
    ),
    build=_build,
    summary="KVCacheManager(scheduler_block_size=) threads the scheduler's block size into the coordinator",
    why="vLLM 0.18 cannot hand the hit alignment from the scheduler to the KV-cache managers",
    mirrors="vLLM 0.23 KVCacheManager(scheduler_block_size=)",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (stack A; B skips).
    tested_fingerprints={
        "KVCacheManager.__init__": ("e3bf7cf6f4ee",),
    },
)
