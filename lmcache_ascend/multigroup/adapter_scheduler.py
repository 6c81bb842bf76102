"""The scheduler side of LMCache's in-process adapter in multi-group mode (pure, duck-typed).

The connector's multi-group layout, computed once per connector and checked at
start, and the truncation of rolled-back request trackers to the prefix every
transferred group covers.  Used by the ``lmcache-adapter-multigroup`` patch.
"""

from __future__ import annotations

import logging

from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER, CONNECTOR_LAYOUT, REUSE_BLOCKER
from lmcache_ascend.multigroup.connector_state import (
    check_chunk_size,
    check_discard_partial_chunks,
    check_single_group_chunk_size,
    layout_for_connector,
)
from lmcache_ascend.multigroup.reuse_verdict import reuse_blocker
from lmcache_ascend.multigroup.slicing import prefix_bound_in_vllm_blocks

__all__ = ["connector_layout", "connector_reuse_blocker", "roll_back_trackers"]

logger = logging.getLogger(__name__)

_NOT_SET = object()


def connector_layout(connector):
    """Layout of LMCache's scheduler-side `connector` (computed once); None for single-group models.

    Raises naming the setting when the connector's config can't move KV exactly: multi-group
    mode without whole chunks, or a chunk_size that is not whole blocks of some moved group.
    """
    layout = CONNECTOR_LAYOUT.get(connector, _NOT_SET)
    if layout is not _NOT_SET:
        return layout
    parent = getattr(connector, "_parent", None)
    layout = layout_for_connector(
        getattr(parent, "_kv_cache_config", None), connector._block_size, getattr(connector, "config", None)
    )
    _decide_reuse(connector, layout)
    chunk_size = connector._lmcache_chunk_size
    if layout is not None and layout.is_multi_group:
        check_discard_partial_chunks(layout, connector._discard_partial_chunks)
        check_chunk_size(layout, chunk_size)
    else:
        # One group (vLLM's hybrid manager off, or a one-group model): LMCache's own
        # path, whose chunks must be whole blocks all the same.
        if layout is not None:
            check_chunk_size(layout, chunk_size)
        else:
            check_single_group_chunk_size(connector._block_size, chunk_size)
        layout = None
    CONNECTOR_LAYOUT.set(connector, layout)
    return layout


def roll_back_trackers(connector, scheduler_output, layout) -> None:
    """Truncate rolled-back multi-group trackers before upstream does.

    After a failed load vLLM lowers ``num_computed_tokens``; upstream then
    caps the kept tokens at ``len(allocated_block_ids) * vLLM block size``,
    which for group 0 of a hybrid model is wrong (e.g. 256-token blocks
    counted as 4-token ones). The right cap is the prefix every
    transferred group covers (a group with no blocks counts 0).
    """
    for req_id in getattr(scheduler_output.scheduled_cached_reqs, "req_ids", ()):
        tracker = connector._request_trackers.get(req_id)
        request = connector._unfinished_requests.get(req_id)
        # Most steps roll nothing back: the token count decides before the attachment is read.
        if tracker is None or request is None or request.num_computed_tokens >= len(tracker.token_ids):
            continue
        groups = BLOCK_TRACKER.get(tracker)
        if groups is None:
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


def _decide_reuse(connector, layout) -> None:
    """Decide once per connector whether it may supply prefixes; say why not, once, at start.

    An engine that may not reuse also stores nothing (LMCache's own ``force_skip_save``): its
    chunks' keys name its layout, so only an engine of the same model and groups could find
    them, and that engine is refused reuse for the same reason.
    """
    blocker = reuse_blocker(layout, getattr(connector, "_vllm_config", None))
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
        connector_layout(connector)
    return REUSE_BLOCKER.get(connector)
