"""`adapter_scheduler.advance_trackers`: a step's per-group block trackers, brought up to date once per step.

The loop skips a request with nothing to do (no new block, not resumed, not rolled back)
without reading its attachment; every other request takes the full path, which is what the
adapter did per request before: truncate a rolled-back tracker, then replace (resumed) or
extend (new blocks) its tables. Both are compared here on the same random steps (duck-typed
connector, trackers and scheduler outputs, as the scheduler hands them over).
"""

from __future__ import annotations

import copy
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.multigroup.adapter_scheduler import advance_trackers
from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER
from lmcache_ascend.multigroup.slicing import prefix_bound_in_vllm_blocks
from lmcache_ascend.multigroup.specs import KVGroupSpec, kv_groups_from_specs
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.multigroup.tracker import GroupBlockTracker

# Block sizes of a hybrid model whose vLLM block size is their GCD (4).
BLOCK_SIZES = (16, 4, 8)
KV_GROUPS = kv_groups_from_specs(
    tuple(KVGroupSpec(g, f"G{g}", size) for g, size in enumerate(BLOCK_SIZES)), 4, StateGroupPolicy()
)


class Tracker:
    """The fields of LMCache's RequestTracker the step reads and writes."""

    def __init__(self, token_ids: list[int], num_saved_tokens: int) -> None:
        self.token_ids = token_ids
        self.num_saved_tokens = num_saved_tokens


def full_path(connector, scheduler_output, kv_groups) -> None:
    """Every known request, in order: roll back, then replace or extend its tables."""
    cached = scheduler_output.scheduled_cached_reqs
    for index, req_id in enumerate(cached.req_ids):
        tracker = connector._request_trackers.get(req_id)
        request = connector._unfinished_requests.get(req_id)
        if tracker is None or request is None:
            continue
        groups = BLOCK_TRACKER.get(tracker)
        if groups is None:
            continue
        if request.num_computed_tokens < len(tracker.token_ids):
            counts = groups.num_blocks_by_group()
            covered = prefix_bound_in_vllm_blocks(
                {g: counts[g] for g in kv_groups.transferred_group_indices},
                {g: kv_groups.groups[g].block_size for g in kv_groups.transferred_group_indices},
                kv_groups.vllm_block_size,
            )
            keep = min(request.num_computed_tokens, covered * kv_groups.vllm_block_size)
            tracker.token_ids = list(request.all_token_ids[:keep])
            tracker.num_saved_tokens = min(tracker.num_saved_tokens, keep)
        new_block_ids = cached.new_block_ids[index]
        if req_id in cached.resumed_req_ids:
            groups.reset_after_preemption(new_block_ids)
        elif new_block_ids is not None:
            groups.append_new_blocks(new_block_ids)


def _new_block_ids(draw, index: int):
    form = draw(
        st.sampled_from(["none", "empty lists", "some groups", "a group's None", "one group short", "ints", "a list"])
    )
    if form == "none":
        return None
    if form == "empty lists":
        return tuple([] for _ in BLOCK_SIZES)
    if form == "one group short":  # refused: one list per group
        return tuple([] for _ in BLOCK_SIZES[1:])
    if form == "ints":  # a flat table: refused for several groups
        return tuple(0 for _ in BLOCK_SIZES)
    lists = [draw(st.lists(st.integers(0, 50), max_size=3)) for _ in BLOCK_SIZES]
    lists = [[1000 * index + block for block in blocks] for blocks in lists]
    if form == "a group's None":  # nothing new for that group (first or later: two paths of the loop)
        lists[draw(st.integers(0, len(BLOCK_SIZES) - 1))] = None
    return lists if form == "a list" else tuple(lists)


@st.composite
def steps(draw):
    """A connector with a few running requests and one step of the scheduler for them."""
    trackers, requests = {}, {}
    req_ids, new_block_ids, resumed = [], [], set()
    for index in range(draw(st.integers(1, 4))):
        req_id = f"r{index}"
        tokens = list(range(7 * index, 7 * index + draw(st.integers(0, 96))))
        tracker = Tracker(list(tokens), draw(st.integers(0, len(tokens))))
        if draw(st.booleans()) or index == 0:  # a multi-group tracker (else: none attached)
            tables = [draw(st.lists(st.integers(1, 99), max_size=8)) for _ in BLOCK_SIZES]
            BLOCK_TRACKER.set(tracker, GroupBlockTracker([list(t) for t in tables]))
        computed = draw(st.sampled_from([len(tokens), len(tokens), draw(st.integers(0, len(tokens)))]))
        presence = draw(st.sampled_from(["both", "both", "both", "no tracker", "no request"]))
        if presence != "no tracker":
            trackers[req_id] = tracker
        if presence != "no request":
            requests[req_id] = types.SimpleNamespace(
                num_computed_tokens=computed, all_token_ids=tokens + list(range(500, 510))
            )
        req_ids.append(req_id)
        new_block_ids.append(_new_block_ids(draw, index))
        if draw(st.integers(0, 4)) == 0:
            resumed.add(req_id)
    connector = types.SimpleNamespace(_request_trackers=trackers, _unfinished_requests=requests)
    cached = types.SimpleNamespace(req_ids=req_ids, resumed_req_ids=resumed, new_block_ids=new_block_ids)
    return connector, types.SimpleNamespace(scheduled_cached_reqs=cached)


def _state(connector):
    out = {}
    for req_id, tracker in connector._request_trackers.items():
        groups = BLOCK_TRACKER.get(tracker)
        out[req_id] = (tracker.token_ids, tracker.num_saved_tokens, groups and groups.block_ids_by_group)
    return out


def _outcome(step, connector, scheduler_output):
    try:
        step(connector, scheduler_output, KV_GROUPS)
    except ValueError as error:
        return ("refused", str(error))
    return ("done", _state(connector))


@settings(max_examples=400, deadline=None)
@given(steps())
def test_the_step_loop_leaves_every_tracker_as_the_full_path_does(case):
    connector, scheduler_output = case
    fast_connector, fast_output = copy.deepcopy((connector, scheduler_output))
    expected = _outcome(full_path, connector, scheduler_output)
    assert _outcome(advance_trackers, fast_connector, fast_output) == expected


def test_a_step_that_brings_nothing_reads_no_attachment():
    class Unreadable(Tracker):
        @property
        def __dict__(self):
            raise AssertionError("the attachment was read")

    tracker = Unreadable([1, 2, 3], 0)
    connector = types.SimpleNamespace(
        _request_trackers={"r": tracker},
        _unfinished_requests={"r": types.SimpleNamespace(num_computed_tokens=3, all_token_ids=[1, 2, 3, 4])},
    )
    for nothing in (None, ([], [], [])):
        cached = types.SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[nothing])
        advance_trackers(connector, types.SimpleNamespace(scheduled_cached_reqs=cached), KV_GROUPS)
    cached = types.SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[([], [5], [])])
    with pytest.raises(AssertionError, match="attachment was read"):
        advance_trackers(connector, types.SimpleNamespace(scheduled_cached_reqs=cached), KV_GROUPS)


def test_older_vllm_forms_of_the_running_requests():
    def connector_with(req_id, tables):
        tracker = Tracker([1, 2, 3, 4], 0)
        BLOCK_TRACKER.set(tracker, GroupBlockTracker([list(t) for t in tables]))
        requests = {req_id: types.SimpleNamespace(num_computed_tokens=4, all_token_ids=[1, 2, 3, 4])}
        return types.SimpleNamespace(_request_trackers={req_id: tracker}, _unfinished_requests=requests), tracker

    # Resumed requests as one flag per request (resumed_from_preemption) instead of a set of ids.
    connector, tracker = connector_with("a", ([1], [2], [3]))
    cached = types.SimpleNamespace(req_ids=["a"], resumed_from_preemption=[True], new_block_ids=[([7], [8], [9])])
    advance_trackers(connector, types.SimpleNamespace(scheduled_cached_reqs=cached), KV_GROUPS)
    assert BLOCK_TRACKER.get(tracker).block_ids_by_group == [[7], [8], [9]]
    # vLLM < 0.9.2: one record per running request.
    connector, tracker = connector_with("b", ([1], [2], [3]))
    record = types.SimpleNamespace(req_id="b", new_block_ids=([4], [], [5]), resumed_from_preemption=False)
    advance_trackers(connector, types.SimpleNamespace(scheduled_cached_reqs=[record]), KV_GROUPS)
    assert BLOCK_TRACKER.get(tracker).block_ids_by_group == [[1, 4], [2], [3, 5]]
