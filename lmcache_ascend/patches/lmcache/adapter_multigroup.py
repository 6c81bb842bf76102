"""Per-group block tracking and slot mappings in LMCache's in-process vLLM adapter.

What: in ``lmcache.integration.vllm.vllm_v1_adapter`` the scheduler side keeps
every KV-cache group: ``RequestTracker`` gains a per-group block tracker
(``tracker.ascend_block_tracker``), ``ReqMeta`` gains per-group slot mappings
(``req_meta.ascend_group_slots``, a `GroupSlotMappings`), and the connector
checks at start that multi-group mode has ``discard_partial_chunks`` and a
chunk size every compress ratio divides; a tracker rolled back after a failed
load keeps the prefix all groups cover. Single-group models take the
untouched upstream path (nothing is attached, results are byte-identical).
Why: upstream keeps only ``block_ids[0]`` ("TODO: support multiple
KVCacheGroup"), so hybrid models (DeepSeek-V4: 11 groups on vllm-ascend, 5 on
CUDA) lose every other group's KV.
Mirrors: LMCache-Ascend #246 (multi-group in-process connector) and vLLM
#42437 (per-group block ids for LMCache's MP connector), on the in-process path.
Delete when: LMCache's in-process adapter tracks ``block_ids`` per group.
"""

from __future__ import annotations

import contextvars
import functools

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

# The layout of the connector whose build_connector_meta is running; the
# tracker/ReqMeta hooks are static methods with no connector at hand.
_ACTIVE_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("lmcache_ascend_active_layout", default=None)

from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER, CONNECTOR_LAYOUT  # noqa: E402

LAYOUT_ATTRIBUTE = CONNECTOR_LAYOUT.name
TRACKER_ATTRIBUTE = BLOCK_TRACKER.name


def _build(ctx: PatchContext) -> dict[str, object]:
    from lmcache_ascend.multigroup.connector_state import (
        check_chunk_size,
        check_discard_partial_chunks,
        layout_for_connector,
    )
    from lmcache_ascend.multigroup.slicing import prefix_bound_in_vllm_blocks, primary_group_index
    from lmcache_ascend.multigroup.slots import REQ_META_ATTRIBUTE, build_group_slot_mappings
    from lmcache_ascend.multigroup.tracker import GroupBlockTracker

    original_init_state = ctx.original_function("LMCacheConnectorV1Impl._init_connector_state")
    original_build_meta = ctx.original_function("LMCacheConnectorV1Impl.build_connector_meta")
    original_from_new = ctx.original_function("RequestTracker.from_new_request")
    original_update = ctx.original_function("RequestTracker.update")
    original_from_tracker = ctx.original_function("ReqMeta.from_request_tracker")

    def connector_layout(connector):
        """Layout of `connector` (computed once); None for single-group models."""
        try:
            return vars(connector)[LAYOUT_ATTRIBUTE]
        except KeyError:
            pass
        parent = getattr(connector, "_parent", None)
        layout = layout_for_connector(
            getattr(parent, "_kv_cache_config", None), connector._block_size, getattr(connector, "config", None)
        )
        if layout is not None and layout.is_multi_group:
            check_discard_partial_chunks(layout, connector._discard_partial_chunks)
            check_chunk_size(layout, connector._lmcache_chunk_size)
        else:
            layout = None
        setattr(connector, LAYOUT_ATTRIBUTE, layout)
        return layout

    @functools.wraps(original_init_state)
    def _init_connector_state(self, role, vllm_config, config):
        original_init_state(self, role, vllm_config, config)
        connector_layout(self)  # fail at connector start, naming the setting

    def roll_back_trackers(connector, scheduler_output, layout) -> None:
        """Truncate rolled-back multi-group trackers before upstream does.

        After a failed load vLLM lowers ``num_computed_tokens``; upstream then
        caps the kept tokens at ``len(allocated_block_ids) * vLLM block size``,
        which for group 0 of a hybrid model is wrong (e.g. 256-token blocks
        counted as 4-token ones). The right cap is the prefix every
        transferred group covers (seed 001's bound, missing groups count 0).
        """
        for req_id in getattr(scheduler_output.scheduled_cached_reqs, "req_ids", ()):
            tracker = connector._request_trackers.get(req_id)
            request = connector._unfinished_requests.get(req_id)
            groups = vars(tracker).get(TRACKER_ATTRIBUTE) if tracker is not None else None
            if groups is None or request is None or request.num_computed_tokens >= len(tracker.token_ids):
                continue
            counts = groups.num_blocks_by_group()
            covered_blocks = prefix_bound_in_vllm_blocks(
                {g: counts[g] for g in layout.transferred_group_indices},
                {g: layout.groups[g].block_size for g in layout.transferred_group_indices},
                layout.vllm_block_size,
            )
            keep = min(request.num_computed_tokens, covered_blocks * layout.vllm_block_size)
            tracker.token_ids = list(request.all_token_ids[:keep])
            tracker.num_saved_tokens = min(tracker.num_saved_tokens, keep)

    @functools.wraps(original_build_meta)
    def build_connector_meta(self, scheduler_output):
        layout = connector_layout(self)
        if layout is None:
            return original_build_meta(self, scheduler_output)
        roll_back_trackers(self, scheduler_output, layout)
        token = _ACTIVE_LAYOUT.set(layout)
        try:
            return original_build_meta(self, scheduler_output)
        finally:
            _ACTIVE_LAYOUT.reset(token)

    @functools.wraps(original_from_new)
    def from_new_request(lmcache_config, new_request, *args, **kwargs):
        tracker = original_from_new(lmcache_config, new_request, *args, **kwargs)
        layout = _ACTIVE_LAYOUT.get()
        if layout is not None:
            setattr(tracker, TRACKER_ATTRIBUTE, GroupBlockTracker.for_new_request(new_request.block_ids, layout.num_groups))
        return tracker

    @functools.wraps(original_update)
    def update(self, new_token_ids, new_block_ids, preempted=False, *args, **kwargs):
        original_update(self, new_token_ids, new_block_ids, preempted, *args, **kwargs)
        groups = vars(self).get(TRACKER_ATTRIBUTE)
        if groups is not None and (preempted or new_block_ids is not None):
            if preempted:
                groups.reset_after_preemption(new_block_ids)
            else:
                groups.append_new_blocks(new_block_ids)

    @functools.wraps(original_from_tracker)
    def from_request_tracker(tracker, block_size, lmcache_chunk_size=256, load_spec=None, *args, **kwargs):
        groups = vars(tracker).get(TRACKER_ATTRIBUTE)
        layout = _ACTIVE_LAYOUT.get()
        if groups is None or layout is None:
            return original_from_tracker(tracker, block_size, lmcache_chunk_size, load_spec, *args, **kwargs)
        # Upstream sizes its single slot mapping from one block table; hand it
        # the primary group's table and block size so its bookkeeping (token
        # count checks, slot_mapping length = token count) stays meaningful.
        primary = primary_group_index(
            groups.num_blocks_by_group(), layout.block_sizes, layout.transferred_group_indices
        )
        group_zero_ids = tracker.allocated_block_ids
        tracker.allocated_block_ids = groups.block_ids_by_group[primary]
        try:
            req_meta = original_from_tracker(
                tracker, layout.groups[primary].block_size, lmcache_chunk_size, load_spec, *args, **kwargs
            )
        finally:
            tracker.allocated_block_ids = group_zero_ids
        if req_meta is not None:
            vllm_cached = load_spec.vllm_cached_tokens if load_spec is not None and load_spec.can_load else 0
            setattr(
                req_meta,
                REQ_META_ATTRIBUTE,
                build_group_slot_mappings(layout, groups, len(req_meta.token_ids), lmcache_chunk_size, vllm_cached),
            )
        return req_meta

    return {
        "LMCacheConnectorV1Impl._init_connector_state": _init_connector_state,
        "LMCacheConnectorV1Impl.build_connector_meta": build_connector_meta,
        "RequestTracker.from_new_request": staticmethod(from_new_request),
        "RequestTracker.update": update,
        "ReqMeta.from_request_tracker": staticmethod(from_request_tracker),
    }


def _upstream_tracks_groups(module) -> bool | None:
    fields = getattr(module.RequestTracker, "__dataclass_fields__", None)
    if fields is None:
        return None
    return "allocated_block_ids_by_group" in fields or "block_ids_by_group" in fields


PATCH = Patch(
    name="lmcache-adapter-multigroup",
    target="lmcache.integration.vllm.vllm_v1_adapter",
    attributes=(
        "LMCacheConnectorV1Impl._init_connector_state",
        "LMCacheConnectorV1Impl.build_connector_meta",
        "RequestTracker.from_new_request",
        "RequestTracker.update",
        "ReqMeta.from_request_tracker",
    ),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        probe=_upstream_tracks_groups,
        fixed_if_source_contains=("allocated_block_ids_by_group",),
        unfixed_if_source_contains=("TODO: Please support multiple KVCacheGroup",),
    ),
    flags=("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"),
    build=_build,
    summary="tracks block ids and slot mappings per KV-cache group in LMCache's in-process adapter",
    why="upstream keeps only block_ids[0]; hybrid models (DeepSeek-V4) lose every other group's KV",
    mirrors="LMCache-Ascend #246 (multi-group in-process connector); vLLM #42437 per-group block ids",
    delete_when="LMCache's in-process vllm_v1_adapter tracks block_ids per KV-cache group",
    # (LMCache 0.5.6 / stack B, LMCache 0.4.5 / stack A)
    tested_fingerprints={
        "LMCacheConnectorV1Impl._init_connector_state": ("74e83ba8db50", "760e6c186972"),
        "LMCacheConnectorV1Impl.build_connector_meta": ("fbe28e9c19f0", "cf695efe8d0a"),
        "RequestTracker.from_new_request": ("de2f51ab3f2c",),
        "RequestTracker.update": ("abc2a75342ea",),
        "ReqMeta.from_request_tracker": ("96e75ac5d1d4",),
    },
)
