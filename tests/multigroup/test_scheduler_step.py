"""`adapter_scheduler.advance_trackers`: a step's per-group block trackers, brought up to date once per step.

The loop skips a request with nothing to do (no new block, not resumed) without looking up its
tracker; every other request takes the full path: replace (resumed) or extend (new blocks) its
tables, as ``RequestTracker.update`` does to group 0. Finished requests' trackers are dropped, as
upstream drops its own. Both are compared here on the same random steps (block trackers and
duck-typed scheduler outputs, as the scheduler hands them over). Where the loop may retire
trackers (upstream's trackers handed in), a tracker it sets to None must be one `retires`
allows; every other tracker is the full path's.
"""

from __future__ import annotations

import copy
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.multigroup.adapter_scheduler import advance_trackers, retires, track_new_requests
from lmcache_ascend.multigroup.specs import KVGroupSpec, kv_groups_from_specs
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.multigroup.tracker import GroupBlockTracker

# Block sizes of a hybrid model whose vLLM block size is their GCD (4).
BLOCK_SIZES = (16, 4, 8)
KV_GROUPS = kv_groups_from_specs(
    tuple(KVGroupSpec(g, f"G{g}", size) for g, size in enumerate(BLOCK_SIZES)), 4, StateGroupPolicy()
)


def full_path(block_trackers, scheduler_output, kv_groups) -> None:
    """Finished requests dropped; then every request with a block tracker (or a retired one, None),
    in order: a new tracker from its table (resumed), or its tables extended (new blocks)."""
    for req_id in scheduler_output.finished_req_ids:
        block_trackers.pop(req_id, None)
    cached = scheduler_output.scheduled_cached_reqs
    for index, req_id in enumerate(cached.req_ids):
        if req_id not in block_trackers:
            continue
        new_block_ids = cached.new_block_ids[index]
        if req_id in cached.resumed_req_ids:
            block_trackers[req_id] = GroupBlockTracker.for_new_request(new_block_ids, kv_groups.num_groups)
        elif new_block_ids is not None and block_trackers[req_id] is not None:
            block_trackers[req_id].append_new_blocks(new_block_ids)


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


def _output(req_ids, new_block_ids, resumed=(), finished=()):
    cached = types.SimpleNamespace(req_ids=list(req_ids), resumed_req_ids=set(resumed), new_block_ids=list(new_block_ids))
    return types.SimpleNamespace(scheduled_cached_reqs=cached, finished_req_ids=set(finished))


@st.composite
def steps(draw):
    """Block trackers of a few requests (some retired) and one step of the scheduler: some of them
    running (with or without a tracker), some finished; upstream's trackers of the requests
    (decoding or not, disaggregated or not), or None where the connector saves decode KV."""
    block_trackers, upstream = {}, {}
    req_ids, new_block_ids, resumed, finished = [], [], set(), set()
    for index in range(draw(st.integers(1, 5))):
        req_id = f"r{index}"
        if draw(st.booleans()) or index == 0:  # tracked per group (else: a request with none)
            tables = [draw(st.lists(st.integers(1, 99), max_size=8)) for _ in BLOCK_SIZES]
            block_trackers[req_id] = None if draw(st.integers(0, 5)) == 0 else GroupBlockTracker([list(t) for t in tables])
            upstream[req_id] = types.SimpleNamespace(
                is_decode_phase=draw(st.booleans()), disagg_spec=draw(st.sampled_from([None, None, "spec"]))
            )
        if draw(st.integers(0, 5)) == 0:
            finished.add(req_id)
            continue
        req_ids.append(req_id)
        new_block_ids.append(_new_block_ids(draw, index))
        if draw(st.integers(0, 4)) == 0:
            resumed.add(req_id)
    return block_trackers, _output(req_ids, new_block_ids, resumed, finished), draw(st.sampled_from([upstream, None]))


def _outcome(step, block_trackers, scheduler_output, *retire_from):
    try:
        step(block_trackers, scheduler_output, KV_GROUPS, *retire_from)
    except ValueError as error:
        return ("refused", str(error))
    return ("done", {req_id: groups and groups.block_id_lists() for req_id, groups in block_trackers.items()})


@settings(max_examples=600, deadline=None)
@given(steps())
def test_the_step_loop_leaves_every_tracker_as_the_full_path_does(case):
    block_trackers, scheduler_output, retire_from = case
    fast_trackers, fast_output = copy.deepcopy((block_trackers, scheduler_output))
    expected = _outcome(full_path, block_trackers, scheduler_output)
    outcome = _outcome(advance_trackers, fast_trackers, fast_output, retire_from)
    if outcome[0] == "done" and expected[0] == "done":
        # A tracker the loop retired is one it may retire, and it was not resumed this step.
        for req_id, lists in outcome[1].items():
            if lists is None and expected[1][req_id] is not None:
                assert retire_from is not None and retires(retire_from[req_id])
                assert req_id not in fast_output.scheduled_cached_reqs.resumed_req_ids
                outcome[1][req_id] = expected[1][req_id]
    assert outcome == expected


def test_a_decoding_request_is_retired_at_its_next_block_and_comes_back_when_resumed():
    upstream = {"d": types.SimpleNamespace(is_decode_phase=True, disagg_spec=None),
                "p": types.SimpleNamespace(is_decode_phase=False, disagg_spec=None),
                "x": types.SimpleNamespace(is_decode_phase=True, disagg_spec="spec")}
    block_trackers = {req_id: GroupBlockTracker([[1], [2], [3]]) for req_id in upstream}
    step = _output(["d", "p", "x"], [None] * 3)
    advance_trackers(block_trackers, step, KV_GROUPS, upstream)  # nothing new: nothing retired
    assert all(block_trackers.values())
    advance_trackers(block_trackers, _output(["d", "p", "x"], [([], [5], [])] * 3), KV_GROUPS, None)
    assert [groups.block_id_lists() for groups in block_trackers.values()] == [[[1], [2, 5], [3]]] * 3
    advance_trackers(block_trackers, _output(["d", "p", "x"], [([], [6], [])] * 3), KV_GROUPS, upstream)
    assert block_trackers["d"] is None  # decoding, no transfer: its blocks are never read again
    assert block_trackers["p"].block_id_lists() == block_trackers["x"].block_id_lists() == [[1], [2, 5, 6], [3]]
    advance_trackers(block_trackers, _output(["d"], [([7], [8], [9])], resumed={"d"}), KV_GROUPS, upstream)
    assert block_trackers["d"].block_id_lists() == [[7], [8], [9]]


def test_a_step_that_brings_nothing_looks_up_no_tracker():
    class Untouchable(dict):
        def get(self, *args):
            raise AssertionError("a tracker was looked up")

    block_trackers = Untouchable(r=GroupBlockTracker([[1], [2], [3]]))
    for nothing in (None, ([], [], [])):
        advance_trackers(block_trackers, _output(["r"], [nothing]), KV_GROUPS)
    with pytest.raises(AssertionError, match="tracker was looked up"):
        advance_trackers(block_trackers, _output(["r"], [([], [5], [])]), KV_GROUPS)


def test_older_vllm_forms_of_the_running_requests():
    # Resumed requests as one flag per request (resumed_from_preemption) instead of a set of ids.
    block_trackers = {"a": GroupBlockTracker([[1], [2], [3]])}
    cached = types.SimpleNamespace(req_ids=["a"], resumed_from_preemption=[True], new_block_ids=[([7], [8], [9])])
    advance_trackers(block_trackers, types.SimpleNamespace(scheduled_cached_reqs=cached, finished_req_ids=set()), KV_GROUPS)
    assert block_trackers["a"].block_id_lists() == [[7], [8], [9]]
    # vLLM < 0.9.2: one record per running request.
    block_trackers = {"b": GroupBlockTracker([[1], [2], [3]])}
    record = types.SimpleNamespace(req_id="b", new_block_ids=([4], [], [5]), resumed_from_preemption=False)
    advance_trackers(block_trackers, types.SimpleNamespace(scheduled_cached_reqs=[record], finished_req_ids=set()), KV_GROUPS)
    assert block_trackers["b"].block_id_lists() == [[1, 4], [2], [3, 5]]


def test_new_requests_get_trackers_only_where_upstream_tracks_them():
    new = [
        types.SimpleNamespace(req_id="a", block_ids=([1, 2], [3], [4, 5])),
        types.SimpleNamespace(req_id="mock_req_0", block_ids=([6], [7], [8])),  # upstream skipped it
    ]
    block_trackers = {"old": GroupBlockTracker([[9], [9], [9]])}
    track_new_requests(block_trackers, types.SimpleNamespace(scheduled_new_reqs=new), {"a": object()}, 3)
    assert set(block_trackers) == {"old", "a"}
    assert block_trackers["a"].block_id_lists() == [[1, 2], [3], [4, 5]]
    with pytest.raises(ValueError, match="block ids for 2 KV-cache groups, expected 3"):
        track_new_requests(
            block_trackers,
            types.SimpleNamespace(scheduled_new_reqs=[types.SimpleNamespace(req_id="a", block_ids=([1], [2]))]),
            {"a": object()},
            3,
        )
