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
(`lmcache_ascend.multigroup.mp_wire`). The wrappers built here keep every group's
block table beside upstream's flat list (`GroupBlockTracker` on the request
tracker), run upstream's planning over the prefix all groups cover and replace the
single list in its ``LoadStoreOp``; upstream's own logic (chunking, APC overlap,
state machine, lock release) runs unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER, MP_GROUP_STATE
from lmcache_ascend.multigroup.hma import declares_supports_hma
from lmcache_ascend.multigroup.mp_wire import (
    FLAT,
    NEGOTIATED,
    block_ids_wire_format,
    encode_block_ids,
    group_block_slices,
    tracked_prefix_bound,
)
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"


@dataclass(frozen=True)
class MPGroupState:
    """What one connector knows about its groups and its server's wire format."""

    block_sizes: tuple[int, ...]
    vllm_block_size: int
    wire_format: str
    versions: tuple[tuple[str, str | None], ...]


def mp_group_state(kv_cache_config: Any, vllm_block_size: int, load_store_op_cls: type) -> MPGroupState:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    sizes = tuple(int(group.kv_cache_spec.block_size) for group in groups) or (int(vllm_block_size),)
    op_module = load_store_op_cls.__module__
    if op_module.startswith("lmcache."):
        server = f"LMCache {installed_version('lmcache')} ({op_module})"
    else:
        server = f"vLLM {installed_version('vllm')} bundled adapter ({op_module})"
    versions = (("connector", f"lmcache-ascend on vLLM {installed_version('vllm')}"), ("server protocol", server))
    wire_format = block_ids_wire_format(load_store_op_cls)
    if wire_format == FLAT and op_module.startswith("lmcache."):
        # LMCache 0.4.x's worker adapter: it learns its server's format at registration and
        # encodes per-group ids for it (patch lmcache-mp-client-wire-format).
        wire_format = NEGOTIATED
    return MPGroupState(sizes, int(vllm_block_size), wire_format, versions)


def _flat_group_ids(block_ids: Any) -> list[int]:
    """Upstream's ``reformat_block_ids`` without the one-group refusal: group 0 (telemetry only)."""
    if not block_ids:
        return []
    return list(block_ids[0])


def _planned(original, tracker: Any, blocks_in_chunk: int, vllm_block_size: int, bound: int):
    """Run upstream's planner with the tracker's flat list standing for `bound` vLLM blocks."""
    saved = tracker.allocated_block_ids
    tracker.allocated_block_ids = list(range(bound))
    try:
        return original(tracker, blocks_in_chunk, vllm_block_size)
    finally:
        tracker.allocated_block_ids = saved


def _with_group_slices(meta: Any, tracker: Any, state: MPGroupState) -> Any:
    if meta is None:
        return None
    op = meta.op
    size = state.vllm_block_size
    slices = group_block_slices(
        BLOCK_TRACKER.get(tracker).block_ids_by_group, state.block_sizes, size, op.start // size, op.end // size
    )
    op.block_ids = encode_block_ids(slices, state.wire_format, dict(state.versions))
    return meta


def _per_group_planner(original):
    """Upstream's store or retrieve planner over the prefix all groups cover, then per-group slices."""

    @functools.wraps(original)
    def planner(tracker, blocks_in_chunk, vllm_block_size):
        state = MP_GROUP_STATE.get(tracker)
        if state is None:  # a tracker our allocation hook never saw: upstream as it was
            return original(tracker, blocks_in_chunk, vllm_block_size)
        groups = BLOCK_TRACKER.get(tracker)
        bound = tracked_prefix_bound(groups.block_ids_by_group, state.block_sizes, vllm_block_size)
        meta = _planned(original, tracker, blocks_in_chunk, vllm_block_size, bound)
        return _with_group_slices(meta, tracker, state)

    return planner


def _mp_connector_values(ctx: Any, connector_name: str, supports_hma: type) -> dict[str, object]:
    """The patched attributes: connector bases and hooks, planners, ``reformat_block_ids``."""
    from lmcache_ascend.multigroup.hma import hma_mixin
    from lmcache_ascend.multigroup.tracker import GroupBlockTracker  # numpy: at build time, not with the declaration

    module = ctx.module
    connector = getattr(module, connector_name)
    store_original = ctx.original_function("LMCacheMPRequestMetadata.GetStoreMetadata")
    retrieve_original = ctx.original_function("LMCacheMPRequestMetadata.GetRetrieveMetadata")
    after_alloc_original = ctx.original_function(f"{connector_name}.update_state_after_alloc")
    cached_original = ctx.original_function(f"{connector_name}._process_cached_requests")

    def state_of(connector_self: Any) -> MPGroupState:
        state = MP_GROUP_STATE.get(connector_self)
        if state is None:
            state = mp_group_state(
                getattr(connector_self, "_kv_cache_config", None), connector_self.vllm_block_size, module.LoadStoreOp
            )
            MP_GROUP_STATE.set(connector_self, state)
        return state

    @functools.wraps(after_alloc_original)
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        state = state_of(self)
        tracker = self._get_request_tracker(request.request_id)
        table = blocks.get_block_ids()
        groups = BLOCK_TRACKER.get(tracker)
        if groups is None:
            BLOCK_TRACKER.set(tracker, GroupBlockTracker.for_new_request(table, len(state.block_sizes)))
            MP_GROUP_STATE.set(tracker, state)
        else:
            groups.extend_to(table)
        return after_alloc_original(self, request, blocks, num_external_tokens)

    @functools.wraps(cached_original)
    def _process_cached_requests(self, scheduler_output, metadata):
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        for idx, request_id in enumerate(cached.req_ids):
            tracker = self._get_request_tracker(request_id)
            groups = BLOCK_TRACKER.get(tracker)
            if groups is not None and request_id not in resumed:
                groups.append_new_blocks(cached.new_block_ids[idx])
        return cached_original(self, scheduler_output, metadata)

    return {
        f"{connector_name}.__bases__": connector.__bases__ + (hma_mixin(supports_hma, forward_to_self=True),),
        f"{connector_name}.update_state_after_alloc": update_state_after_alloc,
        f"{connector_name}._process_cached_requests": _process_cached_requests,
        "LMCacheMPRequestMetadata.GetStoreMetadata": staticmethod(_per_group_planner(store_original)),
        "LMCacheMPRequestMetadata.GetRetrieveMetadata": staticmethod(_per_group_planner(retrieve_original)),
        "reformat_block_ids": _flat_group_ids,
    }



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

        return _mp_connector_values(ctx, connector, SupportsHMA)

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
