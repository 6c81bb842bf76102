"""The scheduler side of LMCache's in-process adapter in multi-group mode (pure, duck-typed).

The connector's multi-group layout, computed once per connector and checked at
start, and the per-group block trackers of a step's running requests brought up
to date before upstream builds their metadata (new blocks, a resumed request's
fresh table, a rolled-back tracker truncated to the prefix every transferred
group covers).  Used by the ``lmcache-adapter-multigroup`` patch.
"""

from __future__ import annotations

import logging

from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER, CONNECTOR_GROUPS, REUSE_BLOCKER
from lmcache_ascend.multigroup.connector_state import (
    check_chunk_size,
    check_discard_partial_chunks,
    check_single_group_chunk_size,
    kv_groups_for_connector,
)
from lmcache_ascend.multigroup.reuse_verdict import reuse_blocker
from lmcache_ascend.multigroup.slicing import prefix_bound_in_vllm_blocks

__all__ = ["advance_trackers", "connector_kv_groups", "connector_reuse_blocker"]

logger = logging.getLogger(__name__)

_NOT_SET = object()
_BLOCK_TRACKER = BLOCK_TRACKER.name  # read from the tracker's own dict (`Attachment.get`, inlined: per request)


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


def advance_trackers(connector, scheduler_output, kv_groups) -> None:
    """Bring the multi-group trackers of the step's running requests up to date, before upstream's
    loop over them runs.

    Upstream's loop, per running request: truncate a rolled-back tracker, ``RequestTracker.update``
    (which keeps group 0's new blocks only), ``ReqMeta.from_request_tracker``. This does the first
    two for every group, request by request, from the same fields of the scheduler output that
    upstream reads: a rolled-back tracker is truncated to the prefix every transferred group covers
    (`_roll_back`), then a resumed request's fresh table replaces its tracked blocks and a running
    request's new blocks are appended. Each `GroupBlockTracker` thus holds the step's blocks when
    upstream builds the request's ReqMeta, and the step costs one loop rather than a wrapped call
    of ``RequestTracker.update`` per request. A request upstream does not know (no tracker or no
    vLLM request: upstream raises) is left alone.
    """
    cached = scheduler_output.scheduled_cached_reqs
    trackers = connector._request_trackers
    if isinstance(cached, list):
        # vLLM < 0.9.2: one record per request; upstream rolls nothing back on this path.
        for request_data in cached:
            tracker = trackers.get(request_data.req_id)
            groups = None if tracker is None else BLOCK_TRACKER.get(tracker)
            if groups is not None:
                _apply_new_blocks(groups, request_data.new_block_ids, request_data.resumed_from_preemption)
        return
    req_ids = cached.req_ids
    if not req_ids:
        return
    # Which requests resumed after preemption, where upstream looks: a set of ids, or (older vLLM) a flag per request.
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is None:
        flags = getattr(cached, "resumed_from_preemption", None)
        if flags is None:
            return  # upstream refuses a step that does not say which requests resumed
        resumed = {req_id for req_id, flag in zip(req_ids, flags) if flag}
    requests = connector._unfinished_requests
    # Runs for every running request on every step. Most are decoding: no new block, not
    # resumed, not rolled back; they cost the tests below and nothing else (no attachment read,
    # no call). "No new block" is vLLM's None, or a tuple with an empty list per group, which
    # `GroupBlockTracker.append_new_blocks` would take as nothing to append (a tuple of ints, a
    # flat table, takes its path and is refused there).
    for req_id, new_block_ids in zip(req_ids, cached.new_block_ids):
        tracker = trackers.get(req_id)
        if tracker is None:
            continue
        request = requests.get(req_id)
        if request is None:
            continue
        if request.num_computed_tokens < len(tracker.token_ids):
            rolled_back = True
        elif req_id in resumed:
            rolled_back = False
        elif new_block_ids is None or (
            type(new_block_ids) is tuple
            and not any(new_block_ids)
            and len(new_block_ids) == len(kv_groups.groups)
            and type(new_block_ids[0]) is not int
        ):
            continue
        else:
            rolled_back = False
        groups = tracker.__dict__.get(_BLOCK_TRACKER)
        if groups is None:
            continue
        if rolled_back:
            _roll_back(tracker, groups, request, kv_groups)
        _apply_new_blocks(groups, new_block_ids, req_id in resumed)


def _apply_new_blocks(groups, new_block_ids, preempted) -> None:
    # What ``RequestTracker.update(new_token_ids, new_block_ids, preempted)`` does to group 0, for every group.
    if preempted:
        groups.reset_after_preemption(new_block_ids)
    elif new_block_ids is not None:
        groups.append_new_blocks(new_block_ids)


def _roll_back(tracker, groups, request, kv_groups) -> None:
    """Truncate a rolled-back multi-group tracker before upstream does.

    After a failed load vLLM lowers ``num_computed_tokens``; upstream then
    caps the kept tokens at ``len(allocated_block_ids) * vLLM block size``,
    which for group 0 of a hybrid model is wrong (e.g. 256-token blocks
    counted as 4-token ones). The right cap is the prefix every
    transferred group covers (a group with no blocks counts 0).
    """
    counts = groups.num_blocks_by_group()
    covered_blocks = prefix_bound_in_vllm_blocks(
        {g: counts[g] for g in kv_groups.transferred_group_indices},
        {g: kv_groups.groups[g].block_size for g in kv_groups.transferred_group_indices},
        kv_groups.vllm_block_size,
    )
    keep = min(request.num_computed_tokens, covered_blocks * kv_groups.vllm_block_size)
    tracker.token_ids = list(request.all_token_ids[:keep])
    tracker.num_saved_tokens = min(tracker.num_saved_tokens, keep)


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
