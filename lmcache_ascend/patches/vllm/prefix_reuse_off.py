"""Record where vLLM's CPU platform forces its own prefix caching off.

``CpuPlatform.check_and_update_config`` turns prefix caching off for MLA models
("forcing chunked prefill and prefix caching to be disabled") because its MLA
computation over a cached prefix is not supported. The wrapper runs it with
prefix caching asked for, so the platform's own decision shows whatever the user
asked; it restores the user's value (off where the platform turned it off), and
where the platform turned it off it records that on the KV-transfer config
(`lmcache_ascend.multigroup.reuse_verdict.record_vllm_reuse_off`), which travels
with the config to the scheduler, where LMCache's lookup then supplies nothing.
Without a KV-transfer config nothing is asked or recorded.
"""

from __future__ import annotations

from lmcache_ascend.compat.signatures import parameter
from lmcache_ascend.patches import Patch, PatchKind

_REASON = "vLLM's CPU platform does not support its MLA computation over a cached prefix"


def check_and_update_config_wrapper(wrapped, instance, args, kwargs):
    vllm_config = parameter(wrapped, "vllm_config").read(args, kwargs)
    cache_config = getattr(vllm_config, "cache_config", None)
    if cache_config is None or getattr(vllm_config, "kv_transfer_config", None) is None:
        return wrapped(*args, **kwargs)
    from lmcache_ascend.multigroup.reuse_verdict import record_vllm_reuse_off

    asked = cache_config.enable_prefix_caching
    cache_config.enable_prefix_caching = True
    forced_off = False
    try:
        result = wrapped(*args, **kwargs)
        forced_off = cache_config.enable_prefix_caching is False
    finally:
        cache_config.enable_prefix_caching = False if forced_off else asked
    if forced_off:
        record_vllm_reuse_off(vllm_config, _REASON)
    return result


PATCH = Patch(
    name="vllm-prefix-reuse-off-reason",
    target="vllm.platforms.cpu",
    attributes=("CpuPlatform.check_and_update_config",),
    kind=PatchKind.WRAP,
    requires={"vllm": ">=0.18.0"},
    wrappers={"CpuPlatform.check_and_update_config": check_and_update_config_wrapper},
    summary="records on the KV-transfer config where vLLM's CPU platform forces its own prefix caching off (MLA)",
    why="vLLM's CPU MLA path over a cached prefix gives other tokens than a cold prefill, so vLLM turns its own "
    "reuse off; LMCache supplied prefixes there with nothing guarding",
    mirrors="vllm.platforms.cpu.CpuPlatform.check_and_update_config (MLA on a non-GPU platform)",
    delete_when="vLLM's CPU platform keeps prefix caching on for MLA",
    tested_fingerprints={"CpuPlatform.check_and_update_config": ("078708824be6", "5a25b15e39ea", "71aba091ac07", "1b7d84fd8bc6")},
)
