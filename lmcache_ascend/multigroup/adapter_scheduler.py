"""The scheduler side of LMCache's in-process adapter in multi-group mode (pure, duck-typed).

The connector's multi-group layout, computed once per connector and checked at
start, and the per-group block trackers of a step's running requests brought up
to date before upstream builds their metadata (new blocks, a resumed request's
fresh table).  Used by the ``lmcache-adapter-multigroup`` patch.
"""

from __future__ import annotations

import logging
from itertools import compress

from lmcache_ascend.multigroup.attachments import CONNECTOR_GROUPS, REUSE_BLOCKER
from lmcache_ascend.multigroup.connector_state import (
    check_chunk_size,
    check_discard_partial_chunks,
    check_single_group_chunk_size,
    kv_groups_for_connector,
)
from lmcache_ascend.multigroup.reuse_verdict import reuse_blocker
from lmcache_ascend.multigroup.tracker import GroupBlockTracker

__all__ = ["advance_trackers", "connector_kv_groups", "connector_reuse_blocker", "retires", "track_new_requests"]

logger = logging.getLogger(__name__)

_NOT_SET = object()
_GROUP_INDICES = range(1 << 20)  # group indices, as many as a table has (a range holds no memory)


def connector_kv_groups(connector):
    """Layout of LMCache's scheduler-side `connector` (computed once); None for single-group models.

    Raises naming the setting when the connector's config can't move KV exactly: multi-group
    mode without whole chunks, or a chunk_size that is not whole blocks of some moved group.
    """
    kv_groups = CONNECTOR_GROUPS.get(connector, _NOT_SET)
    if kv_groups is not _NOT_SET:
        return kv_groups
    parent = getattr(connector, "_parent", None)
    kv_groups = kv_groups_for_connector(
        getattr(parent, "_kv_cache_config", None), connector._block_size, getattr(connector, "config", None)
    )
    _decide_reuse(connector, kv_groups)
    chunk_size = connector._lmcache_chunk_size
    if kv_groups is not None and kv_groups.is_multi_group:
        check_discard_partial_chunks(kv_groups, connector._discard_partial_chunks)
        check_chunk_size(kv_groups, chunk_size)
    else:
        # One group (vLLM's hybrid manager off, or a one-group model): LMCache's own
        # path, whose chunks must be whole blocks all the same.
        if kv_groups is not None:
            check_chunk_size(kv_groups, chunk_size)
        else:
            check_single_group_chunk_size(connector._block_size, chunk_size)
        kv_groups = None
    CONNECTOR_GROUPS.set(connector, kv_groups)
    return kv_groups


def advance_trackers(block_trackers, scheduler_output, kv_groups, retire_from=None) -> None:
    """Bring the multi-group block trackers (`GroupBlockTracker` by request id) up to date with a
    scheduler step, before upstream's loop over its requests runs.

    Upstream's step drops the trackers of finished requests, then per running request calls
    ``RequestTracker.update``, which appends group 0's new blocks (or takes a resumed request's
    fresh table), then ``ReqMeta.from_request_tracker``. This does the first two for every group,
    from the same fields of the scheduler output, so that each block tracker holds the step's
    blocks when the step's ReqMeta get their block ids. A rolled-back request (vLLM lowered its
    computed tokens) needs nothing here: vLLM keeps its blocks, and upstream truncates its tokens
    to what group 0's table holds, counted in group 0's block size for the step (the step
    wrapper's). A request with no block tracker is left alone.

    `retire_from`: upstream's ``RequestTracker`` by request id, where the connector stores nothing
    while a request decodes (see `retires`); None keeps every tracker. A request of those that
    brings new blocks while decoding has its entry set to None (retired) instead: its blocks are
    never read again, and a resumed request gets a fresh tracker from its new table.

    A step with no finished request, an empty ``resumed_req_ids`` and every running request's new
    block ids None (vLLM's "no new block") changes nothing here, and the ``lmcache-adapter-multigroup``
    step wrapper does not call this for it: a field this comes to read must be read by that test too.
    """
    finished = scheduler_output.finished_req_ids
    if finished:
        for req_id in finished:
            block_trackers.pop(req_id, None)
    cached = scheduler_output.scheduled_cached_reqs
    if isinstance(cached, list):
        _advance_per_request_records(block_trackers, cached, kv_groups.num_groups)
        return
    req_ids = cached.req_ids
    if not req_ids:
        return
    # Which requests resumed after preemption, where upstream looks: a set of ids, or (older vLLM) a flag per request.
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is None:
        resumed = _flagged_resumed(cached, req_ids)
        if resumed is None:
            return  # upstream refuses a step that does not say which requests resumed
    new_block_ids = cached.new_block_ids
    if resumed:
        _advance_with_resumed(block_trackers, req_ids, new_block_ids, resumed, kv_groups.num_groups)
    elif any(new_block_ids):  # (most steps of a small batch bring no block: no call, no iterator made)
        _advance_running(block_trackers, req_ids, new_block_ids, kv_groups.num_groups, retire_from)


def _advance_per_request_records(block_trackers, cached: list, num_groups: int) -> None:
    """vLLM < 0.9.2: one record per request."""
    for request_data in cached:
        req_id = request_data.req_id
        if request_data.resumed_from_preemption:
            _resume(block_trackers, req_id, request_data.new_block_ids, num_groups)
            continue
        groups = block_trackers.get(req_id)
        if groups is not None and request_data.new_block_ids is not None:
            groups.append_new_blocks(request_data.new_block_ids)


def _flagged_resumed(cached, req_ids) -> set | None:
    """Older vLLM: the requests whose resumed-from-preemption flag is set; None where the step has no flags."""
    flags = getattr(cached, "resumed_from_preemption", None)
    if flags is None:
        return None
    return {req_id for req_id, flag in zip(req_ids, flags) if flag}


def _advance_with_resumed(block_trackers, req_ids, new_block_ids, resumed, num_groups: int) -> None:
    """A step that resumes a request (rare): every request takes the general test."""
    for req_id, request_new_ids in zip(req_ids, new_block_ids):
        if req_id in resumed:
            _resume(block_trackers, req_id, request_new_ids, num_groups)
        elif not _brings_nothing(request_new_ids, num_groups):
            groups = block_trackers.get(req_id)
            if groups is not None:
                groups.append_new_blocks(request_new_ids)


def _advance_running(block_trackers, req_ids, new_block_ids, num_groups: int, retire_from) -> None:
    """Runs for every running request of a step that brings a block. Most are decoding with no new block, which
    vLLM says with None: those (and any empty table) are passed over at C level (`compress` on
    the tables' truth), without a turn of the loop. The rest mostly bring vLLM's usual form, one
    list per group: appended here, touching only the groups that got a block, rather than
    through `GroupBlockTracker.append_new_blocks`, whose call alone cost about a quarter of this
    loop at a server's batch (docs/design-decisions.md, section 3). Any other form takes that
    checked path. A decoding request whose blocks are never read again is retired at its first
    new block (`retires`), so from then on its turn is the lookup that finds None."""
    for req_id, request_new_ids in compress(zip(req_ids, new_block_ids), new_block_ids):
        if type(request_new_ids) is tuple and len(request_new_ids) == num_groups and type(request_new_ids[0]) is list:
            if not any(request_new_ids):
                continue
            groups = block_trackers.get(req_id)
            if groups is None:
                continue
            if retire_from is not None and retires(retire_from.get(req_id)):
                block_trackers[req_id] = None
                continue
            # Only the groups that got a block are touched (most get none on a decode step).
            tables = groups.block_ids_by_group
            for group in compress(_GROUP_INDICES, request_new_ids):  # (as many as there are groups)
                tables[group].extend(request_new_ids[group])
        elif not _brings_nothing(request_new_ids, num_groups):
            groups = block_trackers.get(req_id)
            if groups is not None:
                groups.append_new_blocks(request_new_ids)


def _brings_nothing(new_block_ids, num_groups: int) -> bool:
    """vLLM's "no new block" for a running request: None, or a tuple with an empty list per group
    (which `GroupBlockTracker.append_new_blocks` would take as nothing to append; a tuple of ints,
    a flat table, takes its path and is refused there)."""
    return new_block_ids is None or (
        type(new_block_ids) is tuple
        and not any(new_block_ids)
        and len(new_block_ids) == num_groups
        and type(new_block_ids[0]) is not int
    )


def track_new_requests(block_trackers, scheduler_output, upstream_trackers, num_groups: int) -> None:
    """After upstream's step: a block tracker for each new request of the step that upstream made
    a ``RequestTracker`` for (`upstream_trackers`, by request id), from the whole table vLLM
    hands it. Upstream decides which new requests it tracks (it skips data-parallel dummies)."""
    for request in scheduler_output.scheduled_new_reqs:
        if request.req_id in upstream_trackers:
            block_trackers[request.req_id] = GroupBlockTracker.for_new_request(request.block_ids, num_groups)


def retires(upstream_tracker) -> bool:
    """Whether a request's block tracker may be retired: upstream's ``RequestTracker`` says it is
    decoding and not a disaggregated transfer. Upstream's rule (``ReqMeta.from_request_tracker``):
    such a request is saved again only where the connector saves decode KV (the caller passes
    `advance_trackers` no trackers then), and ``is_decode_phase`` is never cleared; it is loaded
    again only after a preemption, whose resumed step brings the whole new table."""
    return upstream_tracker is not None and upstream_tracker.is_decode_phase and upstream_tracker.disagg_spec is None


def _resume(block_trackers, req_id, block_ids, num_groups: int) -> None:
    """A request resumed after preemption (tracked, or retired): its old blocks are gone, the
    fresh table it brings is its tracker now."""
    if req_id in block_trackers:
        block_trackers[req_id] = GroupBlockTracker.for_new_request(block_ids, num_groups)


def _decide_reuse(connector, kv_groups) -> None:
    """Decide once per connector whether it may supply prefixes; say why not, once, at start.

    An engine that may not reuse also stores nothing (LMCache's own ``force_skip_save``): its
    chunks' keys name its layout, so only an engine of the same model and groups could find
    them, and that engine is refused reuse for the same reason.
    """
    blocker = reuse_blocker(kv_groups, getattr(connector, "_vllm_config", None))
    REUSE_BLOCKER.set(connector, blocker)
    if blocker is not None:
        connector.force_skip_save = True
        logger.warning(
            "lmcache-ascend: LMCache supplies no prefix to this engine and stores nothing (every lookup "
            "reports 0 tokens; vLLM computes every prompt): %s",
            blocker,
        )


def connector_reuse_blocker(connector):
    """Why LMCache's scheduler-side `connector` supplies no prefix, or None (decided at start)."""
    if not REUSE_BLOCKER.is_set(connector):
        connector_kv_groups(connector)
    return REUSE_BLOCKER.get(connector)
