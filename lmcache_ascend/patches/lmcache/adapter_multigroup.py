"""Scheduler side of multi-group KV caches in LMCache's in-process vLLM adapter.

``RequestTracker`` gains a per-group block tracker (``tracker.ascend_block_tracker``),
``ReqMeta`` gains the step's per-group block ids (``req_meta.ascend_step_block_ids``, a
`StepBlockIds`; the worker resolves them to slots on its device), and the connector checks at start that multi-group mode has
``discard_partial_chunks`` and a chunk size every compress ratio divides; a tracker
rolled back after a failed load keeps the prefix all groups cover
(`lmcache_ascend.multigroup.adapter_scheduler`).  Single-group models take the
untouched upstream path (nothing is attached, results are byte-identical).
"""

from __future__ import annotations

import contextvars
import types

from lmcache_ascend.compat.signatures import call_argument, with_argument
from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER, STEP_BLOCK_IDS
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

# The layout of the connector whose build_connector_meta is running; the
# tracker/ReqMeta hooks are static methods with no connector at hand.
_ACTIVE_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("lmcache_ascend_active_layout", default=None)

# The multi-group logic (numpy), imported on the first wrapped call rather than with this
# declaration; kept here after that, since an import statement costs microseconds per step.
_logic: types.SimpleNamespace | None = None


def _load_logic() -> types.SimpleNamespace:
    global _logic
    from lmcache_ascend.multigroup import adapter_scheduler, slots, tracker

    _logic = types.SimpleNamespace(
        connector_layout=adapter_scheduler.connector_layout,
        roll_back_trackers=adapter_scheduler.roll_back_trackers,
        new_block_tracker=tracker.GroupBlockTracker.for_new_request,
        step_block_ids=slots.step_block_ids,
    )
    return _logic


def init_connector_state_wrapper(wrapped, instance, args, kwargs):
    logic = _logic or _load_logic()
    wrapped(*args, **kwargs)
    logic.connector_layout(instance)  # fail at connector start, naming the setting


def build_connector_meta_wrapper(wrapped, instance, args, kwargs):
    logic = _logic or _load_logic()
    layout = logic.connector_layout(instance)
    if layout is None:
        return wrapped(*args, **kwargs)
    logic.roll_back_trackers(instance, call_argument(wrapped, args, kwargs, "scheduler_output"), layout)
    token = _ACTIVE_LAYOUT.set(layout)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _ACTIVE_LAYOUT.reset(token)


def from_new_request_wrapper(wrapped, instance, args, kwargs):
    tracker = wrapped(*args, **kwargs)
    layout = _ACTIVE_LAYOUT.get()
    if layout is not None:
        new_request = call_argument(wrapped, args, kwargs, "new_request")
        BLOCK_TRACKER.set(tracker, (_logic or _load_logic()).new_block_tracker(new_request.block_ids, layout.num_groups))
    return tracker


def update_wrapper(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    groups = BLOCK_TRACKER.get(instance)
    if groups is None:
        return
    new_block_ids = call_argument(wrapped, args, kwargs, "new_block_ids")
    if call_argument(wrapped, args, kwargs, "preempted"):
        groups.reset_after_preemption(new_block_ids)
    elif new_block_ids is not None:
        groups.append_new_blocks(new_block_ids)


def from_request_tracker_wrapper(wrapped, instance, args, kwargs):
    layout = _ACTIVE_LAYOUT.get()
    if layout is None:  # single-group model: upstream's path, nothing read
        return wrapped(*args, **kwargs)
    tracker = call_argument(wrapped, args, kwargs, "tracker")
    groups = BLOCK_TRACKER.get(tracker)
    if groups is None:
        return wrapped(*args, **kwargs)
    # Upstream sizes its single slot mapping from one block table: hand it one
    # transferred group's table and block size (fixed per layout) so its
    # bookkeeping (token count checks, slot_mapping length = token count) holds.
    chunk_size = call_argument(wrapped, args, kwargs, "lmcache_chunk_size")
    table_group = layout.upstream_table_group(chunk_size)
    args, kwargs = with_argument(wrapped, args, kwargs, "block_size", layout.groups[table_group].block_size)
    group_zero_ids = tracker.allocated_block_ids
    tracker.allocated_block_ids = groups.block_ids_by_group[table_group]
    try:
        req_meta = wrapped(*args, **kwargs)
    finally:
        tracker.allocated_block_ids = group_zero_ids
    if req_meta is None:  # nothing to store or load this step (decode)
        return None
    slot_mapping = req_meta.slot_mapping
    if slot_mapping.untyped_storage().nbytes() > slot_mapping.numel() * slot_mapping.element_size():
        # A view of a larger table would be pickled whole to every worker.
        req_meta.slot_mapping = slot_mapping.clone()
    load_spec = call_argument(wrapped, args, kwargs, "load_spec")
    vllm_cached = load_spec.vllm_cached_tokens if load_spec is not None and load_spec.can_load else 0
    step_block_ids = (_logic or _load_logic()).step_block_ids
    STEP_BLOCK_IDS.set(req_meta, step_block_ids(layout, groups, len(req_meta.token_ids), chunk_size, vllm_cached))
    return req_meta


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
    wrappers={
        "LMCacheConnectorV1Impl._init_connector_state": init_connector_state_wrapper,
        "LMCacheConnectorV1Impl.build_connector_meta": build_connector_meta_wrapper,
        "RequestTracker.from_new_request": from_new_request_wrapper,
        "RequestTracker.update": update_wrapper,
        "ReqMeta.from_request_tracker": from_request_tracker_wrapper,
    },
    summary="tracks block ids and slot mappings per KV-cache group in LMCache's in-process adapter",
    why="upstream keeps only block_ids[0]; hybrid models (DeepSeek-V4) lose every other group's KV",
    mirrors="LMCache-Ascend #246 (multi-group in-process connector); vLLM #42437 per-group block ids",
    delete_when="LMCache's in-process vllm_v1_adapter tracks block_ids per KV-cache group",
    # (LMCache 0.5.6, LMCache 0.4.5)
    tested_fingerprints={
        "LMCacheConnectorV1Impl._init_connector_state": ("74e83ba8db50", "760e6c186972"),
        "LMCacheConnectorV1Impl.build_connector_meta": ("fbe28e9c19f0", "cf695efe8d0a"),
        "RequestTracker.from_new_request": ("de2f51ab3f2c",),
        "RequestTracker.update": ("abc2a75342ea",),
        "ReqMeta.from_request_tracker": ("96e75ac5d1d4",),
    },
)
