"""Scheduler side of multi-group KV caches in LMCache's in-process vLLM adapter.

``RequestTracker`` gains a per-group block tracker (``tracker.ascend_block_tracker``),
``ReqMeta`` gains the step's per-group block ids (``req_meta.ascend_step_block_ids``, a
`StepBlockIds`; the worker resolves them to slots on its device), and the connector checks at start that multi-group mode has
``discard_partial_chunks`` and a chunk size every compress ratio divides.  The block trackers of
a step's running requests are brought up to date once per step, before upstream's loop, from the
scheduler output (new blocks, a resumed request's fresh table, a tracker rolled back after a
failed load keeping the prefix all groups cover: `lmcache_ascend.multigroup.adapter_scheduler`);
``RequestTracker.update`` is not wrapped: per request, a decode step adds one turn of that loop
and the wrapped ``ReqMeta.from_request_tracker`` call.
Single-group models take the untouched upstream path (nothing is attached, results are
byte-identical).
"""

from __future__ import annotations

import contextvars
import sys
import types

from lmcache_ascend.compat.signatures import call_argument, parameter
from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER, CONNECTOR_LAYOUT, STEP_BLOCK_IDS
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

# The layout of the connector whose build_connector_meta is running; the
# ReqMeta hook is a static method with no connector at hand.
_ACTIVE_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("lmcache_ascend_active_layout", default=None)
_UNDECIDED = object()  # a connector whose layout is not decided yet (CONNECTOR_LAYOUT unset)

# The multi-group logic (numpy), imported on the first wrapped call rather than with this
# declaration; kept here after that, since an import statement costs microseconds per step.
_logic: types.SimpleNamespace | None = None


def _load_logic() -> types.SimpleNamespace:
    global _logic
    from lmcache_ascend.multigroup import adapter_scheduler, slots, tracker

    _logic = types.SimpleNamespace(
        connector_layout=adapter_scheduler.connector_layout,
        advance_trackers=adapter_scheduler.advance_trackers,
        new_block_tracker=tracker.GroupBlockTracker.for_new_request,
        step_block_ids=slots.step_block_ids,
    )
    return _logic


class _TrackerCall:
    """How one upstream ``ReqMeta.from_request_tracker`` takes what its wrapper reads and sets,
    worked out on the function's first call (it runs for every request of every step).

    Upstream's loop passes the tracker, the block size and the chunk size by position: a call
    with more than ``last`` positional arguments has all three at their positions and is read by
    index; any other call is read by name.
    """

    def __init__(self, function) -> None:
        self.function = function
        self.tracker = parameter(function, "tracker")
        self.block_size = parameter(function, "block_size")
        self.chunk_size = parameter(function, "lmcache_chunk_size")
        self.load_spec = parameter(function, "load_spec")
        positions = (self.tracker.position, self.block_size.position, self.chunk_size.position)
        self.last = sys.maxsize if None in positions else max(positions)


# Located on the first call of the upstream function, not looked up by name on every call.
_tracker_call: _TrackerCall | None = None
_scheduler_output = None  # build_connector_meta's parameter (compat.signatures.Parameter)


def init_connector_state_wrapper(wrapped, instance, args, kwargs):
    logic = _logic or _load_logic()
    wrapped(*args, **kwargs)
    logic.connector_layout(instance)  # fail at connector start, naming the setting


def build_connector_meta_wrapper(wrapped, instance, args, kwargs):
    global _scheduler_output
    # The layout is decided once per connector (at its start): a single-group model's step
    # costs this one read.
    layout = CONNECTOR_LAYOUT.get(instance, _UNDECIDED)
    if layout is _UNDECIDED:
        layout = (_logic or _load_logic()).connector_layout(instance)
    if layout is None:
        return wrapped(*args, **kwargs)
    reads = _scheduler_output
    if reads is None or reads.function is not wrapped.__func__:
        reads = _scheduler_output = parameter(wrapped, "scheduler_output")
    # Every group's blocks of the step's running requests, before upstream builds their ReqMeta.
    (_logic or _load_logic()).advance_trackers(instance, reads.read(args, kwargs), layout)
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


def from_request_tracker_wrapper(wrapped, instance, args, kwargs):
    global _tracker_call
    layout = _ACTIVE_LAYOUT.get()
    if layout is None:  # single-group model: upstream's path, nothing read
        return wrapped(*args, **kwargs)
    call = _tracker_call
    if call is None or call.function is not wrapped:
        call = _tracker_call = _TrackerCall(wrapped)
    by_position = len(args) > call.last
    tracker = args[call.tracker.position] if by_position else call.tracker.read(args, kwargs)
    groups = BLOCK_TRACKER.get(tracker)
    if groups is None:
        return wrapped(*args, **kwargs)
    # Upstream sizes its single slot mapping from one block table: hand it one
    # transferred group's table and block size (fixed per layout) so its
    # bookkeeping (token count checks, slot_mapping length = token count) holds.
    chunk_size = args[call.chunk_size.position] if by_position else call.chunk_size.read(args, kwargs)
    table = layout.upstream_table(chunk_size)
    if by_position:
        args = list(args)
        args[call.block_size.position] = table.block_size
        args = tuple(args)
    else:
        args, kwargs = call.block_size.replaced(args, kwargs, table.block_size)
    group_zero_ids = tracker.allocated_block_ids
    tracker.allocated_block_ids = groups.block_ids_by_group[table.group_index]
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
    load_spec = call.load_spec.read(args, kwargs)
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
        "ReqMeta.from_request_tracker": ("96e75ac5d1d4",),
    },
)
