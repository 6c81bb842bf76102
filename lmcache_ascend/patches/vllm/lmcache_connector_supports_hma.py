"""vLLM's ``LMCacheConnectorV1.__bases__`` gains ``SupportsHMA`` (a base class whose
``request_finished_all_groups`` forwards to the LMCache adapter), and ``__init__``
refuses ``use_native=True`` with more than one KV-cache group: vLLM's bundled
adapter copy keeps group 0 only, the rest would be lost silently."""

from __future__ import annotations

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.patches.hma_bases import supports_hma_bases
from lmcache_ascend.multigroup.hma import declares_supports_hma
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

CLASS_NAME = "LMCacheConnectorV1"


def init_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.multigroup.connector_state import check_native_adapter

    call = call_arguments(wrapped, args, kwargs).arguments
    kv_cache_config = call.get("kv_cache_config")
    transfer_config = getattr(call["vllm_config"], "kv_transfer_config", None)
    if kv_cache_config is not None and transfer_config is not None:
        use_native = bool(transfer_config.get_from_extra_config("use_native", False))
        check_native_adapter(use_native, len(kv_cache_config.kv_cache_groups))
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="vllm-lmcache-connector-supports-hma",
    target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
    attributes=(f"{CLASS_NAME}.__bases__", f"{CLASS_NAME}.__init__"),
    kind=PatchKind.REPLACE,
    build=supports_hma_bases(CLASS_NAME),
    wrappers={f"{CLASS_NAME}.__init__": init_wrapper},
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=lambda module: declares_supports_hma(module, CLASS_NAME),
        fixed_if_source_contains=("SupportsHMA",),
        unfixed_if_source_contains=("class LMCacheConnectorV1(KVConnectorBase_V1):",),
    ),
    summary="vLLM's LMCacheConnectorV1 becomes SupportsHMA with request_finished_all_groups; native adapter refused for multi-group",
    why="vLLM refuses LMCacheConnectorV1 under the hybrid KV cache manager without SupportsHMA",
    mirrors="vLLM #42437 (SupportsHMA for LMCache connectors); LMCache-Ascend #246 review",
    delete_when="vLLM's LMCacheConnectorV1 subclasses SupportsHMA",
    # vLLM 0.18.1 and 0.23.0 have the same constructor.
    tested_fingerprints={f"{CLASS_NAME}.__init__": ("a3267cffa16d",)},
)
