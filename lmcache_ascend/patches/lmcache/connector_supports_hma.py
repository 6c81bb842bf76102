"""Make LMCache's in-process connector ``LMCacheConnectorV1Dynamic`` a ``SupportsHMA``.

What: adds vLLM's ``SupportsHMA`` (through a small base class implementing
``request_finished_all_groups``, forwarding to the adapter's
``request_finished``) to ``LMCacheConnectorV1Dynamic.__bases__``.
Why: without it vLLM refuses the connector when the hybrid KV cache manager is
on (or turns the manager off), so hybrid models cannot use LMCache in process.
Mirrors: LMCache-Ascend #246 (``LMCacheAscendConnectorV1Dynamic(...,
SupportsHMA)``) and vLLM #42437 (SupportsHMA for the MP connector).
Delete when: LMCache's ``LMCacheConnectorV1Dynamic`` subclasses ``SupportsHMA``.
"""

from __future__ import annotations

from lmcache_ascend.multigroup.hma import declares_supports_hma
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

__all__ = ["PATCH", "declares_supports_hma", "supports_hma_bases_build"]

CLASS_NAME = "LMCacheConnectorV1Dynamic"


def supports_hma_bases_build(ctx: PatchContext, class_name: str) -> dict[str, object]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from lmcache_ascend.multigroup.hma import hma_mixin

    connector = getattr(ctx.module, class_name)
    # The framework clears SupportsHMA's cached issubclass answers on apply and revert.
    return {f"{class_name}.__bases__": connector.__bases__ + (hma_mixin(SupportsHMA),)}


PATCH = Patch(
    name="lmcache-connector-supports-hma",
    target="lmcache.integration.vllm.lmcache_connector_v1",
    attributes=(f"{CLASS_NAME}.__bases__",),
    kind=PatchKind.REPLACE,
    requires={"lmcache": ">=0.4.5,<0.6", "vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=lambda module: declares_supports_hma(module, CLASS_NAME),
        fixed_if_source_contains=("SupportsHMA",),
        unfixed_if_source_contains=("class LMCacheConnectorV1Dynamic(KVConnectorBase_V1):",),
    ),
    build=lambda ctx: supports_hma_bases_build(ctx, CLASS_NAME),
    summary="LMCacheConnectorV1Dynamic becomes SupportsHMA with request_finished_all_groups",
    why="vLLM refuses (or disables the hybrid manager for) connectors that are not SupportsHMA",
    mirrors="LMCache-Ascend #246 connector entry with SupportsHMA; vLLM #42437 SupportsHMA for LMCache",
    delete_when="LMCache's LMCacheConnectorV1Dynamic subclasses SupportsHMA",
)
