"""``LMCacheConnectorV1Dynamic.__bases__`` gains vLLM's ``SupportsHMA`` through a small
base class whose ``request_finished_all_groups`` forwards to the adapter's
``request_finished`` (`lmcache_ascend.multigroup.hma`)."""

from __future__ import annotations

from lmcache_ascend.patches.hma_bases import supports_hma_bases
from lmcache_ascend.multigroup.hma import declares_supports_hma
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

CLASS_NAME = "LMCacheConnectorV1Dynamic"


PATCH = Patch(
    name="lmcache-connector-supports-hma",
    target="lmcache.integration.vllm.lmcache_connector_v1",
    attributes=(f"{CLASS_NAME}.__bases__",),
    kind=PatchKind.REPLACE,
    build=supports_hma_bases(CLASS_NAME),
    requires={"lmcache": ">=0.4.5,<0.6", "vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=lambda module: declares_supports_hma(module, CLASS_NAME),
        fixed_if_source_contains=("SupportsHMA",),
        unfixed_if_source_contains=("class LMCacheConnectorV1Dynamic(KVConnectorBase_V1):",),
    ),
    summary="LMCacheConnectorV1Dynamic becomes SupportsHMA with request_finished_all_groups",
    why="vLLM refuses (or disables the hybrid manager for) connectors that are not SupportsHMA",
    mirrors="LMCache-Ascend #246 connector entry with SupportsHMA; vLLM #42437 SupportsHMA for LMCache",
    delete_when="LMCache's LMCacheConnectorV1Dynamic subclasses SupportsHMA",
)
