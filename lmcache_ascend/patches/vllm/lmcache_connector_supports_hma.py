"""Make vLLM's in-process LMCache connector ``LMCacheConnectorV1`` a ``SupportsHMA``.

What: adds ``SupportsHMA`` (through a base class implementing
``request_finished_all_groups``, forwarding to the LMCache adapter) to
``LMCacheConnectorV1.__bases__`` in vLLM's ``lmcache_connector`` module, and
makes ``__init__`` refuse ``use_native=True`` with more than one KV-cache group
(vLLM's bundled adapter copy keeps group 0 only: the rest would be lost silently).
Why: ``--kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", ...}'``
with the hybrid KV cache manager is refused otherwise, so hybrid models
(DeepSeek-V4) cannot use LMCache's in-process path from vLLM's entry point.
Mirrors: vLLM #42437 (SupportsHMA for LMCache's MP connector); LMCache-Ascend
#246 review ("add SupportsHMA to the entry connector").
Delete when: vLLM's ``LMCacheConnectorV1`` subclasses ``SupportsHMA``.
"""

from __future__ import annotations

import functools

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.patches.lmcache.connector_supports_hma import declares_supports_hma, supports_hma_bases_build

CLASS_NAME = "LMCacheConnectorV1"


def _build(ctx: PatchContext) -> dict[str, object]:
    from lmcache_ascend.multigroup.connector_state import check_native_adapter

    original_init = ctx.original_function(f"{CLASS_NAME}.__init__")

    @functools.wraps(original_init)
    def __init__(self, vllm_config, role, *args, **kwargs):
        kv_cache_config = kwargs.get("kv_cache_config", args[0] if args else None)
        transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        if kv_cache_config is not None and transfer_config is not None:
            use_native = bool(transfer_config.get_from_extra_config("use_native", False))
            check_native_adapter(use_native, len(kv_cache_config.kv_cache_groups))
        original_init(self, vllm_config, role, *args, **kwargs)

    values = supports_hma_bases_build(ctx, CLASS_NAME)
    values[f"{CLASS_NAME}.__init__"] = __init__
    return values


PATCH = Patch(
    name="vllm-lmcache-connector-supports-hma",
    target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
    attributes=(f"{CLASS_NAME}.__bases__", f"{CLASS_NAME}.__init__"),
    kind=PatchKind.REPLACE,
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        probe=lambda module: declares_supports_hma(module, CLASS_NAME),
        fixed_if_source_contains=("SupportsHMA",),
        unfixed_if_source_contains=("class LMCacheConnectorV1(KVConnectorBase_V1):",),
    ),
    build=_build,
    summary="vLLM's LMCacheConnectorV1 becomes SupportsHMA with request_finished_all_groups; native adapter refused for multi-group",
    why="vLLM refuses LMCacheConnectorV1 under the hybrid KV cache manager without SupportsHMA",
    mirrors="vLLM #42437 (SupportsHMA for LMCache connectors); LMCache-Ascend #246 review",
    delete_when="vLLM's LMCacheConnectorV1 subclasses SupportsHMA",
    # vLLM 0.18.1 and 0.23.0 have the same constructor.
    tested_fingerprints={f"{CLASS_NAME}.__init__": ("a3267cffa16d",)},
)
