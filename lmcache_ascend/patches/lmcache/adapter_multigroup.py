"""Scheduler side of multi-group KV caches in LMCache's in-process vLLM adapter.

The connector keeps a `GroupBlockTracker` per request (its `_SchedulerState`, by request id,
beside upstream's ``RequestTracker``, which keeps group 0's table only), ``ReqMeta`` gains the
step's per-group block ids (``req_meta.ascend_step_block_ids``, a `StepBlockIds`; the worker
resolves them to slots on its device), and the connector checks at start that multi-group mode
has ``discard_partial_chunks`` and a chunk size every compress ratio divides.

Only the step is wrapped (``build_connector_meta``); upstream's per-request loop runs unwrapped
and its trackers carry nothing of ours (an attribute added to them, or their dict asked for,
slows every read of their fields), so a decoding request costs what it costs upstream, plus one
turn of `advance_trackers` on a step that brings it a block (once it is retired, a lookup).
Around upstream's step:

- before it, the block trackers of the step's requests are brought up to date from the
  scheduler output (finished requests dropped, new blocks appended, a resumed request's fresh
  table: `lmcache_ascend.multigroup.adapter_scheduler.advance_trackers`, not called for a step
  that brings none of these, as most decode steps of a small batch do); where the connector
  saves nothing while a request decodes (upstream's rule, on the sources it was checked
  against), a decoding request's tracker is retired at its next block instead;
- during it, the connector's ``_block_size`` is group 0's block size. ``RequestTracker`` keeps
  group 0's table (``block_ids[0]``), so upstream's one slot mapping, and its cap of a rolled-back
  tracker, count that table's tokens rightly. Our connector does not read that slot mapping for
  a request that carries block ids; LMCache's worker reads only its length (and, after a failed
  load, the block ids in it, which vLLM refuses for models with several KV-cache groups anyway);
- after it, the step's new requests that upstream tracks get block trackers (from the tables
  the scheduler output hands them: `adapter_scheduler.track_new_requests`), and the few
  ``ReqMeta`` the step returns that make a worker store or load (upstream's decision, read off
  their specs) get their block ids.

Single-group models take the untouched upstream path (nothing is attached, results are
byte-identical).
"""

from __future__ import annotations

import logging
import sys
import types

from lmcache_ascend.compat.signatures import parameter
from lmcache_ascend.multigroup.attachments import CONNECTOR_GROUPS, SCHEDULER_STATE, STEP_BLOCK_IDS
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

logger = logging.getLogger(__name__)

# The multi-group logic (numpy), imported on the first wrapped call rather than with this
# declaration; kept here after that, since an import statement costs microseconds per step.
_logic: types.SimpleNamespace | None = None

_UNDECIDED = object()  # a connector whose layout is not decided yet (CONNECTOR_GROUPS unset)
_UNTRACKED = object()  # a request with no block tracker (upstream's metadata is left as it is)


def _load_logic() -> types.SimpleNamespace:
    global _logic
    from lmcache_ascend.multigroup import adapter_scheduler, slots

    _logic = types.SimpleNamespace(
        connector_kv_groups=adapter_scheduler.connector_kv_groups,
        advance_trackers=adapter_scheduler.advance_trackers,
        track_new_requests=adapter_scheduler.track_new_requests,
        step_block_ids=slots.step_block_ids,
    )
    return _logic


class _SchedulerState:
    """A multi-group connector's scheduler side, made at its first step (its groups are fixed at
    its start): its groups, chunk size, group 0's block size (the one upstream's loop is handed
    for a step: the table ``RequestTracker`` keeps is group 0's) and a `GroupBlockTracker` per
    request upstream tracks, by request id (made with upstream's tracker, dropped with it; None
    once retired: a decoding request whose blocks upstream never saves or loads again,
    `adapter_scheduler.retires`). `decode_rule_read`: upstream's decode save rule is one that
    retiring was checked against (`_DECODE_SAVE_RULE`). `output_first`: upstream's step takes the
    scheduler output as its first argument (located at the connector's first step:
    `_read_scheduler_output`). `logic`: the multi-group logic (`_load_logic`).
    """

    __slots__ = (
        "connector", "kv_groups", "chunk_size", "table_block_size", "block_trackers", "decode_rule_read",
        "output_first", "logic",
    )

    def __init__(self, connector, kv_groups) -> None:
        self.connector = connector
        self.kv_groups = kv_groups
        self.chunk_size = connector._lmcache_chunk_size
        self.table_block_size = kv_groups.groups[0].block_size
        self.block_trackers: dict = {}
        self.decode_rule_read = _decode_save_rule_read(connector)
        self.output_first = False
        self.logic = _logic or _load_logic()


# Where upstream decides that a decoding request is saved no more (``ReqMeta.from_request_tracker``:
# decode phase, no disaggregated transfer, the connector's ``save_decode_cache`` off) and that the
# decode phase, once set, stays (``RequestTracker.update``): the sources retiring was checked
# against (LMCache 0.4.5 and 0.5.6). Elsewhere every tracker follows its request to the end.
_DECODE_SAVE_RULE = {
    "ReqMeta.from_request_tracker": ("96e75ac5d1d4",),
    "RequestTracker.update": ("abc2a75342ea",),
}


def _decode_save_rule_read(connector) -> bool:
    from lmcache_ascend.compat.source import fingerprint

    module = sys.modules.get(type(connector).__module__)
    for path, known in _DECODE_SAVE_RULE.items():
        owner, name = path.split(".")
        if fingerprint(getattr(getattr(module, owner, None), name, None)) not in known:
            logger.info("lmcache-ascend: LMCache's %s is not a source whose decode save rule was checked; "
                        "decoding requests keep their block trackers", path)
            return False
    return True


def init_connector_state_wrapper(wrapped, instance, args, kwargs):
    logic = _logic or _load_logic()
    wrapped(*args, **kwargs)
    logic.connector_kv_groups(instance)  # fail at connector start, naming the setting


def build_connector_meta_wrapper(wrapped, instance, args, kwargs):
    # Decided once per connector (at its start): a single-group model's step costs this one read.
    state = getattr(instance, _SCHEDULER_STATE, None)  # (`SCHEDULER_STATE.get`, inlined)
    if state is None:
        state = _scheduler_state(instance)
    if state is _SINGLE_GROUP:
        return wrapped(*args, **kwargs)
    # The scheduler output: vLLM passes it first. Where upstream's step takes it was located at the
    # connector's first step; the function wrapped is the same for as long as the connector lives.
    if args and state.output_first:
        scheduler_output = args[0]
    else:
        scheduler_output = _read_scheduler_output(state, wrapped, args, kwargs)
    # Every group's blocks of the step's requests, before upstream builds their ReqMeta. A step on
    # which no request finished or resumed and no running request got a block (vLLM's None; most
    # decode steps of a small batch) changes no block tracker: `advance_trackers` returns at its own
    # test of the same fields, so it is not called. Any other step takes it, as does a scheduler
    # output that says otherwise which requests resumed (no ``resumed_req_ids``: older vLLM).
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)
    if scheduler_output.finished_req_ids or resumed is None or resumed or any(cached.new_block_ids):
        # Upstream reads save_decode_cache off the config each step: so does the choice to retire.
        retire_from = (
            instance._request_trackers if state.decode_rule_read and not instance.config.save_decode_cache else None
        )
        state.logic.advance_trackers(state.block_trackers, scheduler_output, state.kv_groups, retire_from)
    # Upstream's loop builds every slot mapping from group 0's table with ``self._block_size``,
    # and caps a rolled-back tracker at that table's blocks times it: for the step, group 0's
    # block size (vLLM's may be another group's). Upstream reads it nowhere else in the step.
    vllm_block_size = instance._block_size
    try:
        instance._block_size = state.table_block_size
        meta = wrapped(*args, **kwargs) if kwargs else wrapped(*args)  # (``**kwargs`` copies even an empty dict)
    finally:
        instance._block_size = vllm_block_size
    if scheduler_output.scheduled_new_reqs:
        state.logic.track_new_requests(
            state.block_trackers, scheduler_output, instance._request_trackers, state.kv_groups.num_groups
        )
    requests = getattr(meta, "requests", None)
    if requests:  # (none on a decode step)
        _attach_step_block_ids(state, requests, state.logic.step_block_ids)
    return meta


def _read_scheduler_output(state, wrapped, args, kwargs):
    """The scheduler output of a step the wrapper did not read at once: the connector's first step
    (which locates upstream's parameter), or one that passes it otherwise than first."""
    output = parameter(wrapped, "scheduler_output")
    state.output_first = output.position == 0
    return output.read(args, kwargs)


def _attach_step_block_ids(state, requests, step_block_ids) -> None:
    """Give each of the step's ReqMeta (`requests`) that makes a worker store or load its
    per-group block ids."""
    block_trackers = state.block_trackers
    producer = state.connector.kv_role == "kv_producer"
    for req_meta in requests:
        groups = block_trackers.get(req_meta.req_id, _UNTRACKED)
        if groups is _UNTRACKED:  # not tracked per group: upstream's metadata as is (a worker refuses to move it)
            continue
        slot_mapping = req_meta.slot_mapping
        if slot_mapping.untyped_storage().nbytes() > slot_mapping.numel() * slot_mapping.element_size():
            # A view of the whole table's slots would be pickled whole to every worker.
            req_meta.slot_mapping = slot_mapping.clone()
        load_spec = req_meta.load_spec
        loads = load_spec is not None and load_spec.can_load
        save_spec = req_meta.save_spec
        if not loads and not (save_spec is not None and save_spec.can_save) and not producer:
            # Moves nothing (a load spec that cannot load travels for the workers' metrics): the
            # workers store where the save spec can save, or always for a producer, and load
            # where the load spec can load.
            continue
        if groups is None:
            raise RuntimeError(
                f"lmcache-ascend: request {req_meta.req_id!r} makes LMCache {'load' if loads else 'store'} KV while "
                "decoding, after its block tracker was retired (upstream's rule: a decoding request is not saved "
                "unless save_decode_cache is on); refusing to move KV whose blocks are no longer known"
            )
        vllm_cached = load_spec.vllm_cached_tokens if loads else 0
        STEP_BLOCK_IDS.set(
            req_meta, step_block_ids(state.kv_groups, groups, len(req_meta.token_ids), state.chunk_size, vllm_cached)
        )


_SCHEDULER_STATE = SCHEDULER_STATE.name  # on the connector: its `_SchedulerState`, or `_SINGLE_GROUP`
_SINGLE_GROUP = object()


def _scheduler_state(connector):
    kv_groups = CONNECTOR_GROUPS.get(connector, _UNDECIDED)
    if kv_groups is _UNDECIDED:
        kv_groups = (_logic or _load_logic()).connector_kv_groups(connector)
    state = _SINGLE_GROUP if kv_groups is None else _SchedulerState(connector, kv_groups)
    SCHEDULER_STATE.set(connector, state)
    return state


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
    },
    summary="tracks every KV-cache group's block ids in LMCache's in-process adapter and ships them with each step",
    why="upstream keeps only block_ids[0]; hybrid models (DeepSeek-V4) lose every other group's KV",
    mirrors="LMCache-Ascend #246 (multi-group in-process connector); vLLM #42437 per-group block ids",
    delete_when="LMCache's in-process vllm_v1_adapter tracks block_ids per KV-cache group",
    # (LMCache 0.5.6, LMCache 0.4.5)
    tested_fingerprints={
        "LMCacheConnectorV1Impl._init_connector_state": ("74e83ba8db50", "760e6c186972"),
        "LMCacheConnectorV1Impl.build_connector_meta": ("fbe28e9c19f0", "cf695efe8d0a"),
    },
)
