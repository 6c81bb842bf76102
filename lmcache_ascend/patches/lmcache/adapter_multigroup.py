"""Scheduler side of multi-group KV caches in LMCache's in-process vLLM adapter.

``RequestTracker`` gains a per-group block tracker (``tracker.ascend_block_tracker``),
``ReqMeta`` gains the step's per-group block ids (``req_meta.ascend_step_block_ids``, a
`StepBlockIds`; the worker resolves them to slots on its device), and the connector checks at start that multi-group mode has
``discard_partial_chunks`` and a chunk size every compress ratio divides.  The block trackers of
a step's running requests are brought up to date once per step, before upstream's loop, from the
scheduler output (new blocks, a resumed request's fresh table, a tracker rolled back after a
failed load keeping the prefix all groups cover: `lmcache_ascend.multigroup.adapter_scheduler`);
``RequestTracker.update`` is not wrapped: per request, a decode step adds one turn of that loop
and the wrapped ``ReqMeta.from_request_tracker`` call, which hands upstream one group's table
(`KVGroups.upstream_table`, worked out once per connector with what else every step
reads: `_StepReads`) and returns upstream's answer as is when it is None. The block ids are built
only for metadata that upstream's specs make the workers store or load; for the step, upstream's
loop is handed the table's block size (the connector's ``_block_size``, restored after the step).
Single-group models take the untouched upstream path (nothing is attached, results are
byte-identical).
"""

from __future__ import annotations

import contextvars
import sys
import types

from lmcache_ascend.compat.signatures import call_argument, parameter
from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER, CONNECTOR_GROUPS, STEP_BLOCK_IDS, STEP_READS
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

# What the per-request hook reads while a multi-group connector's build_connector_meta runs
# (its `_StepReads`); the ReqMeta hook is a static method with no connector at hand.
_ACTIVE_STEP: contextvars.ContextVar = contextvars.ContextVar("lmcache_ascend_active_step", default=None)

# The multi-group logic (numpy), imported on the first wrapped call rather than with this
# declaration; kept here after that, since an import statement costs microseconds per step.
_logic: types.SimpleNamespace | None = None

_UNDECIDED = object()  # a connector whose layout is not decided yet (CONNECTOR_GROUPS unset)
_BLOCK_TRACKER = BLOCK_TRACKER.name  # read from the tracker's own dict per request (`Attachment.get`, inlined)


def _load_logic() -> types.SimpleNamespace:
    global _logic
    from lmcache_ascend.multigroup import adapter_scheduler, slots, tracker

    _logic = types.SimpleNamespace(
        connector_kv_groups=adapter_scheduler.connector_kv_groups,
        advance_trackers=adapter_scheduler.advance_trackers,
        new_block_tracker=tracker.GroupBlockTracker.for_new_request,
        step_block_ids=slots.step_block_ids,
    )
    return _logic


class _StepReads:
    """What every step of one multi-group connector reads, worked out at its first step (its
    groups are fixed at its start): the groups, and the group whose block table upstream's one
    slot mapping is built from for the connector's chunk size (`KVGroups.upstream_table`),
    with its block size; ``vllm_block_size`` is the connector's own (vLLM's) block size.
    """

    __slots__ = ("connector", "kv_groups", "chunk_size", "table_group", "table_block_size", "vllm_block_size")

    def __init__(self, connector, kv_groups) -> None:
        self.connector = connector
        self.kv_groups = kv_groups
        self.chunk_size = connector._lmcache_chunk_size
        self.vllm_block_size = connector._block_size
        table = kv_groups.upstream_table(self.chunk_size)
        self.table_group, self.table_block_size = table.group_index, table.block_size


class _TrackerCall:
    """How one upstream ``ReqMeta.from_request_tracker`` takes what its wrapper reads and sets,
    worked out on the function's first call (it runs for every request of every step).

    Upstream's loop passes the tracker, the block size and the chunk size by position: a call
    with more than ``last`` positional arguments has all three at their positions (``*_at``)
    and is read by index; any other call is read by name.
    """

    def __init__(self, function) -> None:
        self.function = function
        self.tracker = parameter(function, "tracker")
        self.block_size = parameter(function, "block_size")
        self.chunk_size = parameter(function, "lmcache_chunk_size")
        self.tracker_at, self.block_size_at, self.chunk_size_at = positions = (
            self.tracker.position, self.block_size.position, self.chunk_size.position
        )
        self.last = sys.maxsize if None in positions else max(positions)


# Located on the first call of the upstream function, not looked up by name on every call.
_tracker_call: _TrackerCall | None = None
_scheduler_output = None  # build_connector_meta's parameter (compat.signatures.Parameter)


def init_connector_state_wrapper(wrapped, instance, args, kwargs):
    logic = _logic or _load_logic()
    wrapped(*args, **kwargs)
    logic.connector_kv_groups(instance)  # fail at connector start, naming the setting


def build_connector_meta_wrapper(wrapped, instance, args, kwargs):
    global _scheduler_output
    # Decided once per connector (at its start): a single-group model's step costs this one read.
    reads = instance.__dict__.get(_STEP_READS)  # (`STEP_READS.get`, inlined)
    if reads is None:
        reads = _step_reads(instance)
    if reads is _SINGLE_GROUP:
        return wrapped(*args, **kwargs)
    output = _scheduler_output
    if output is None or output.function is not wrapped.__func__:
        output = _scheduler_output = parameter(wrapped, "scheduler_output")
    # Every group's blocks of the step's running requests, before upstream builds their ReqMeta.
    scheduler_output = args[0] if args and output.position == 0 else output.read(args, kwargs)
    (_logic or _load_logic()).advance_trackers(instance, scheduler_output, reads.kv_groups)
    # Upstream's loop hands every ReqMeta.from_request_tracker call ``self._block_size``: for the
    # step, the block size of the table that call is given (the hook swaps the table per request).
    # Upstream reads it nowhere else in the step for a request that has per-group trackers (its
    # roll-back cap does not fire: `advance_trackers` truncated such a tracker already).
    vllm_block_size = instance._block_size
    token = _ACTIVE_STEP.set(reads)
    try:
        instance._block_size = reads.table_block_size
        return wrapped(*args, **kwargs)
    finally:
        instance._block_size = vllm_block_size
        _ACTIVE_STEP.reset(token)


_STEP_READS = STEP_READS.name  # on the connector: its `_StepReads`, or `_SINGLE_GROUP`
_SINGLE_GROUP = object()


def _step_reads(connector):
    kv_groups = CONNECTOR_GROUPS.get(connector, _UNDECIDED)
    if kv_groups is _UNDECIDED:
        kv_groups = (_logic or _load_logic()).connector_kv_groups(connector)
    reads = _SINGLE_GROUP if kv_groups is None else _StepReads(connector, kv_groups)
    STEP_READS.set(connector, reads)
    return reads


def from_new_request_wrapper(wrapped, instance, args, kwargs):
    tracker = wrapped(*args, **kwargs)
    reads = _ACTIVE_STEP.get()
    if reads is not None:
        new_request = call_argument(wrapped, args, kwargs, "new_request")
        BLOCK_TRACKER.set(
            tracker, (_logic or _load_logic()).new_block_tracker(new_request.block_ids, reads.kv_groups.num_groups)
        )
    return tracker


def from_request_tracker_wrapper(wrapped, instance, args, kwargs):
    global _tracker_call
    reads = _ACTIVE_STEP.get()
    if reads is None:  # single-group model: upstream's path, nothing read
        return wrapped(*args, **kwargs)
    call = _tracker_call
    if call is None or call.function is not wrapped:
        call = _tracker_call = _TrackerCall(wrapped)
    if len(args) > call.last:
        tracker, passed_block_size, chunk_size = args[call.tracker_at], args[call.block_size_at], args[call.chunk_size_at]
    else:
        tracker, passed_block_size = call.tracker.read(args, kwargs), None
        chunk_size = call.chunk_size.read(args, kwargs)
    groups = tracker.__dict__.get(_BLOCK_TRACKER)
    # Upstream sizes its single slot mapping from one block table: hand it one
    # transferred group's table and block size (fixed per layout and chunk size) so
    # its bookkeeping (token count checks, slot_mapping length = token count) holds.
    if groups is None:  # a tracker without per-group blocks: upstream's call with vLLM's block size
        table_group, block_size = None, reads.vllm_block_size
    elif chunk_size == reads.chunk_size:
        table_group, block_size = reads.table_group, reads.table_block_size
    else:
        table = reads.kv_groups.upstream_table(chunk_size)
        table_group, block_size = table.group_index, table.block_size
    if passed_block_size != block_size:  # (upstream's loop passes the step's already: see the step wrapper)
        args, kwargs = call.block_size.replaced(args, kwargs, block_size)
    if table_group == 0:
        # Group 0's table is upstream's own: ``RequestTracker`` keeps exactly group 0's blocks
        # (appended, or replaced on resumption, from the same scheduler output as ours).
        req_meta = wrapped(*args, **kwargs)
    elif table_group is None:
        return wrapped(*args, **kwargs)
    else:
        group_zero_ids = tracker.allocated_block_ids
        tracker.allocated_block_ids = groups.block_ids_by_group[table_group]
        try:
            req_meta = wrapped(*args, **kwargs)
        finally:
            tracker.allocated_block_ids = group_zero_ids
    if req_meta is None:  # upstream's answer: nothing to store or load this step (a decode step)
        return None
    slot_mapping = req_meta.slot_mapping
    if slot_mapping.untyped_storage().nbytes() > slot_mapping.numel() * slot_mapping.element_size():
        # A view of a larger table would be pickled whole to every worker.
        req_meta.slot_mapping = slot_mapping.clone()
    load_spec = req_meta.load_spec
    loads = load_spec is not None and load_spec.can_load
    save_spec = req_meta.save_spec
    if not loads and not (save_spec is not None and save_spec.can_save) and reads.connector.kv_role != "kv_producer":
        # Upstream's metadata moves nothing for this request (it carries a load spec that cannot
        # load, for the workers' metrics): its workers read no block ids (they store where
        # upstream's save spec can save, or always for a producer, and load where it can load).
        return req_meta
    step_block_ids = (_logic or _load_logic()).step_block_ids
    vllm_cached = load_spec.vllm_cached_tokens if loads else 0
    STEP_BLOCK_IDS.set(req_meta, step_block_ids(reads.kv_groups, groups, len(req_meta.token_ids), chunk_size, vllm_cached))
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
