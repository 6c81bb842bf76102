"""Every KV-cache group in vLLM's builtin LMCache multi-process (MP) connector.

On ``LMCacheMPConnector`` (vLLM 0.18) and the fallback
``LMCacheMPConnectorUpstream`` (vLLM >= 0.19, chosen by ``LMCACHE_USE_UPSTREAM_MP``
or when LMCache ships no MP connector): ``SupportsHMA`` with
``request_finished_all_groups``; block ids tracked per KV-cache group;
store/retrieve planned against the coarse prefix bound of all groups (a group
without blocks counts 0); each group's slice by the divide-or-multiply rule;
``LoadStoreOp.block_ids`` as ``list[list[int]]`` indexed by group, or the flat
list of a single-group model for a server of the old format, and a
multi-group request to such a server refused with both versions named
(`lmcache_ascend.connector.mp_scheduler`, `lmcache_ascend.multigroup.mp_wire`).
"""

from __future__ import annotations

from lmcache_ascend.multigroup.hma import declares_supports_hma
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"


def _attributes(connector: str) -> tuple[str, ...]:
    return (
        f"{connector}.__bases__",
        f"{connector}.update_state_after_alloc",
        f"{connector}._process_cached_requests",
        "LMCacheMPRequestMetadata.GetStoreMetadata",
        "LMCacheMPRequestMetadata.GetRetrieveMetadata",
        "reformat_block_ids",
    )


def _builder(connector: str):
    def build(ctx: PatchContext) -> dict[str, object]:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

        from lmcache_ascend.connector.mp_scheduler import build_mp_connector_values

        return build_mp_connector_values(ctx, connector, SupportsHMA)

    return build


# Source fingerprints per attribute (after the connector class name): vLLM 0.18.1 / 0.23.0 / 0.32-0.33.
_TESTED = {
    "update_state_after_alloc": ("759598a09560", "c99f8e76e1c2"),
    "_process_cached_requests": ("737dec7a24fb", "dfeaa1ccb892"),
    "LMCacheMPRequestMetadata.GetStoreMetadata": ("d9f9c865d976", "285a18eb8050", "137891bb452c"),
    "LMCacheMPRequestMetadata.GetRetrieveMetadata": ("6252e044351f", "df4d181bf2a8", "c7e6c6d84ab9"),
    "reformat_block_ids": ("a3739d9ab3de",),
}


def _patch(name: str, connector: str, vllm_range: str) -> Patch:
    return Patch(
        name=name,
        target=TARGET,
        attributes=_attributes(connector),
        kind=PatchKind.REPLACE,
        requires={"vllm": vllm_range},
        guard=UpstreamGuard(
            probe=lambda module: declares_supports_hma(module, connector),
            fixed_if_source_contains=("SupportsHMA",),
            unfixed_if_source_contains=(f"class {connector}(KVConnectorBase_V1):",),
        ),
        build=_builder(connector),
        summary=f"vLLM's builtin {connector} tracks, slices and sends block ids per KV-cache group (SupportsHMA)",
        why="the builtin MP connector keeps one flat block list and refuses hybrid models",
        mirrors="vLLM #42437 (LMCacheMPConnector SupportsHMA, per-gid slicing) and its review; LMCache #3261",
        delete_when=f"vLLM's {connector} subclasses SupportsHMA",
        tested_fingerprints={
            (path if "." in path or path == "reformat_block_ids" else f"{connector}.{path}"): prints
            for path, prints in _TESTED.items()
        },
    )


PATCHES = (
    _patch("vllm-lmcache-mp-connector-multigroup", "LMCacheMPConnector", ">=0.18.0,<0.19"),
    _patch("vllm-lmcache-mp-upstream-multigroup", "LMCacheMPConnectorUpstream", ">=0.19"),
)
