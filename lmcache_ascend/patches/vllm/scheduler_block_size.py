"""Make vLLM's ``Scheduler`` use the LCM of all KV-cache groups' block sizes.

What: after ``Scheduler.__init__``, a model with several KV-cache groups gets
``scheduler.block_size`` = LCM of the groups' block sizes (one group keeps the
engine's value, which includes context parallelism), threaded into
``scheduler.kv_cache_manager``; the engine's value stays the hash block size
(``scheduler.hash_block_size``), as vLLM 0.23 splits them.
Why: vLLM 0.18 passes the smallest group block size; prefix hits of a hybrid
model can only end on LCM boundaries, and the KV-cache managers need that
alignment to keep the right checkpoints.
Mirrors: vLLM 0.23 ``resolve_kv_cache_block_sizes`` + ``Scheduler(block_size=,
hash_block_size=)`` -> ``KVCacheManager(scheduler_block_size=)``.
Delete when: the oldest supported vLLM is >= 0.23.
Needs `vllm-kv-cache-manager-scheduler-block-size`.
"""

from __future__ import annotations

import functools
import inspect

from lmcache_ascend.compat.signatures import accepts_keyword, with_keyword_only
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.patches.vllm.coordinator_scheduler_block_size import thread_scheduler_block_size
from lmcache_ascend.prefix_cache.block_sizes import scheduler_block_size as lcm_scheduler_block_size


def _has_hash_block_size(module) -> bool | None:
    return accepts_keyword(module.Scheduler.__init__, "hash_block_size")


def _build(ctx: PatchContext) -> dict[str, object]:
    original_init = ctx.original_function("Scheduler.__init__")
    original_signature = inspect.signature(original_init)

    def __init__(self, *args, hash_block_size: int | None = None, **kwargs) -> None:
        # vLLM 0.23's callers pass block_size = the scheduler block size they resolved and
        # hash_block_size apart; vLLM 0.18's block_size is the hash block size.
        resolved = None
        if hash_block_size is not None:
            bound = original_signature.bind(self, *args, **kwargs)
            resolved = bound.arguments["block_size"]
            bound.arguments["block_size"] = hash_block_size
            args, kwargs = bound.args[1:], bound.kwargs
        original_init(self, *args, **kwargs)
        groups = self.kv_cache_config.kv_cache_groups if hasattr(self, "kv_cache_config") else None
        if not groups:
            return
        self.hash_block_size = self.block_size
        self.block_size = resolved or lcm_scheduler_block_size(
            [group.kv_cache_spec.block_size for group in groups], single_group_block_size=self.block_size
        )
        manager = self.kv_cache_manager
        if not hasattr(manager, "scheduler_block_size"):
            raise RuntimeError(
                "the KV-cache manager was not patched: apply vllm-kv-cache-manager-scheduler-block-size first"
            )
        thread_scheduler_block_size(manager.coordinator, self.block_size)
        manager.scheduler_block_size = self.block_size

    functools.update_wrapper(__init__, original_init)
    # Callers written for vLLM 0.23 see (and may pass) its keyword.
    __init__.__signature__ = with_keyword_only(original_signature, "hash_block_size", None)
    return {"Scheduler.__init__": __init__}


PATCH = Patch(
    name="vllm-scheduler-lcm-block-size",
    target="vllm.v1.core.sched.scheduler",
    attributes=("Scheduler.__init__",),
    kind=PatchKind.WRAP,
    after=("vllm-kv-cache-manager-scheduler-block-size",),
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=_has_hash_block_size,
        fixed_if_source_contains=("scheduler_block_size=self.block_size",),
        unfixed_if_source_contains=("hash_block_size=self.block_size,",),
    ),
    build=_build,
    summary="the scheduler's block size is the LCM of all KV-cache groups' block sizes, threaded to the KV-cache manager",
    why="vLLM 0.18 schedules a hybrid model at its smallest group block size; hits align to the LCM",
    mirrors="vLLM 0.23 resolve_kv_cache_block_sizes and Scheduler -> KVCacheManager(scheduler_block_size=)",
    delete_when="the oldest supported vLLM is >= 0.23",
    # Fingerprints of the targets as shipped in vLLM 0.18.1 (stack A; B skips).
    tested_fingerprints={
        "Scheduler.__init__": ("d902624eb5d7",),
    },
)
