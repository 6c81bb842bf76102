"""vLLM 0.18's builtin LMCache MP connector hands its worker adapter the per-group registration hints.

For a model of several KV-cache groups, ``register_kv_caches`` attaches to the
worker adapter which KV-cache group each registered layer belongs to and each
group's block size (`lmcache_ascend.multigroup.mp_server.client_hints`); the
adapter (patch ``lmcache-mp-client-wire-format``) registers with them. A
single-group model registers exactly as before.
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"


def _register_kv_caches(wrapped, instance, args, kwargs):
    from lmcache_ascend.compat.signatures import call_arguments
    from lmcache_ascend.compat.versions import installed_version
    from lmcache_ascend.multigroup.attachments import GROUP_HINTS
    from lmcache_ascend.multigroup.mp_server import client_hints, layer_kv_groups

    groups = list(getattr(getattr(instance, "_kv_cache_config", None), "kv_cache_groups", None) or ())
    if len(groups) > 1:
        kv_caches = call_arguments(wrapped, args, kwargs).arguments["kv_caches"]
        client = f"lmcache-ascend {installed_version('lmcache-ascend')} on vLLM {installed_version('vllm')}"
        hints = client_hints(
            layer_kv_groups(list(kv_caches), [group.layer_names for group in groups]),
            [int(group.kv_cache_spec.block_size) for group in groups],
            client,
        )
        GROUP_HINTS.set(instance.worker_adapter, hints)
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="vllm-lmcache-mp-register-group-hints",
    target=TARGET,
    attributes=("LMCacheMPConnector.register_kv_caches",),
    kind=PatchKind.WRAP,
    wrappers={"LMCacheMPConnector.register_kv_caches": _register_kv_caches},
    requires={"vllm": ">=0.18.0,<0.19", "lmcache": ">=0.4.5,<0.5"},
    guard=UpstreamGuard(unfixed_if_source_contains=("self.worker_adapter.register_kv_caches(kv_caches)",)),
    tested_fingerprints={"LMCacheMPConnector.register_kv_caches": ("d6c147ce7465",)},  # vLLM 0.18.1
    summary="vLLM 0.18's LMCacheMPConnector registers a multi-group model's KV caches with per-layer KV-cache group hints",
    why="registered bare, LMCache 0.4.x's server cannot tell which layers belong to which KV-cache group or its block size",
    mirrors="LMCache 0.5.6's LMCacheMPConnector.register_kv_caches (engine group infos); LMCache #3261",
    delete_when="lmcache-ascend no longer supports LMCache 0.4.x",
)
