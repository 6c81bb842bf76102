"""Per-group scheduler side of vLLM's builtin LMCache MP connector (glue for two patches).

vLLM's builtin MP connector (``LMCacheMPConnector`` in 0.18, the fallback
``LMCacheMPConnectorUpstream`` later) keeps one flat block list per request and
refuses more than one KV-cache group. The wrappers built here keep every
group's block table beside it (`GroupBlockTracker` on the request tracker),
run upstream's store/retrieve planning against the coarse prefix bound of all
groups, and replace the single list in the resulting ``LoadStoreOp`` with the
per-group slices in the server's wire format (`lmcache_ascend.multigroup.mp_wire`).
Upstream's own logic (chunking, APC overlap, state machine, lock release) runs
unchanged.

Imports vLLM: only loaded from a patch's build step or from tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.multigroup.mp_wire import (
    FLAT,
    NEGOTIATED,
    block_ids_wire_format,
    encode_block_ids,
    group_block_slices,
    tracked_prefix_bound,
)
from lmcache_ascend.multigroup.tracker import GroupBlockTracker

__all__ = ["MPGroupState", "build_mp_connector_values", "mp_group_state"]

# Attribute names on upstream's request tracker.
_BLOCKS = "lmcache_ascend_group_blocks"
_STATE = "lmcache_ascend_mp_state"


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
        getattr(tracker, _BLOCKS).block_ids_by_group, state.block_sizes, size, op.start // size, op.end // size
    )
    op.block_ids = encode_block_ids(slices, state.wire_format, dict(state.versions))
    return meta


def _per_group_planner(original):
    """Upstream's store or retrieve planner over the prefix all groups cover, then per-group slices."""

    @functools.wraps(original)
    def planner(tracker, blocks_in_chunk, vllm_block_size):
        state = getattr(tracker, _STATE, None)
        if state is None:  # a tracker our allocation hook never saw: upstream as it was
            return original(tracker, blocks_in_chunk, vllm_block_size)
        groups = getattr(tracker, _BLOCKS)
        bound = tracked_prefix_bound(groups.block_ids_by_group, state.block_sizes, vllm_block_size)
        meta = _planned(original, tracker, blocks_in_chunk, vllm_block_size, bound)
        return _with_group_slices(meta, tracker, state)

    return planner


def build_mp_connector_values(ctx: Any, connector_name: str, supports_hma: type) -> dict[str, object]:
    """The patched attributes: connector bases and hooks, planners, ``reformat_block_ids``."""
    from lmcache_ascend.multigroup.hma import hma_mixin

    module = ctx.module
    connector = getattr(module, connector_name)
    store_original = ctx.original_function("LMCacheMPRequestMetadata.GetStoreMetadata")
    retrieve_original = ctx.original_function("LMCacheMPRequestMetadata.GetRetrieveMetadata")
    after_alloc_original = ctx.original_function(f"{connector_name}.update_state_after_alloc")
    cached_original = ctx.original_function(f"{connector_name}._process_cached_requests")

    def state_of(connector_self: Any) -> MPGroupState:
        state = connector_self.__dict__.get(_STATE)
        if state is None:
            state = mp_group_state(
                getattr(connector_self, "_kv_cache_config", None), connector_self.vllm_block_size, module.LoadStoreOp
            )
            connector_self.__dict__[_STATE] = state
        return state

    @functools.wraps(after_alloc_original)
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        state = state_of(self)
        tracker = self._get_request_tracker(request.request_id)
        table = blocks.get_block_ids()
        groups = getattr(tracker, _BLOCKS, None)
        if groups is None:
            setattr(tracker, _BLOCKS, GroupBlockTracker.for_new_request(table, len(state.block_sizes)))
            setattr(tracker, _STATE, state)
        else:
            groups.extend_to(table)
        return after_alloc_original(self, request, blocks, num_external_tokens)

    @functools.wraps(cached_original)
    def _process_cached_requests(self, scheduler_output, metadata):
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        for idx, request_id in enumerate(cached.req_ids):
            tracker = self._get_request_tracker(request_id)
            groups = getattr(tracker, _BLOCKS, None)
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
