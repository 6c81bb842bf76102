"""`adapter_scheduler.advance_trackers`: a step's per-group block trackers, brought up to date once per step.

The loop skips a request with nothing to do (no new block, not resumed) without looking up its
tracker; every other request takes the full path: replace (resumed) or extend (new blocks) its
tables, as ``RequestTracker.update`` does to group 0. Finished requests' trackers are dropped, as
upstream drops its own. Both are compared here on the same random steps (block trackers and
duck-typed scheduler outputs, as the scheduler hands them over). Where the loop may retire
trackers (upstream's trackers handed in), a tracker it sets to None must be one `retires`
allows; every other tracker is the full path's. The same holds for the step wrapper of
``lmcache-adapter-multigroup``, which does not call `advance_trackers` on a step that brings nothing
(no request finished, resumed or given a block).
"""

from __future__ import annotations

import copy
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.multigroup.adapter_scheduler import advance_trackers, retires, track_new_requests
from lmcache_ascend.multigroup.attachments import SCHEDULER_STATE
from lmcache_ascend.multigroup.specs import KVGroupSpec, kv_groups_from_specs
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.multigroup.tracker import GroupBlockTracker
from lmcache_ascend.patches.lmcache import adapter_multigroup

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
    return types.SimpleNamespace(scheduled_cached_reqs=cached, finished_req_ids=set(finished), scheduled_new_reqs=[])


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


class _Connector:
    """What the step wrapper reads of LMCache's connector (multi-group: `KV_GROUPS`); its upstream
    step returns metadata with no request. Upstream's trackers, or None where it saves decode KV."""

    def __init__(self, block_trackers, upstream_trackers) -> None:
        self._block_size = 4
        self._lmcache_chunk_size = 16
        self._request_trackers = upstream_trackers if upstream_trackers is not None else {}
        self.config = types.SimpleNamespace(save_decode_cache=upstream_trackers is None)
        state = adapter_multigroup._SchedulerState(self, KV_GROUPS)
        state.block_trackers = block_trackers
        state.decode_rule_read = True  # (retiring as on the checked sources)
        SCHEDULER_STATE.set(self, state)
        self.block_sizes_seen = []

    def build_connector_meta(self, scheduler_output):
        self.block_sizes_seen.append(self._block_size)
        return types.SimpleNamespace(requests=[])


def wrapper_step(block_trackers, scheduler_output, kv_groups, retire_from=None):
    """The step of LMCache's connector under ``lmcache-adapter-multigroup``'s wrapper."""
    assert kv_groups is KV_GROUPS
    connector = _Connector(block_trackers, retire_from)
    adapter_multigroup.build_connector_meta_wrapper(connector.build_connector_meta, connector, (scheduler_output,), {})
    assert connector.block_sizes_seen == [BLOCK_SIZES[0]] and connector._block_size == 4


def _agrees_with_the_full_path(step, case):
    block_trackers, scheduler_output, retire_from = case
    fast_trackers, fast_output = copy.deepcopy((block_trackers, scheduler_output))
    expected = _outcome(full_path, block_trackers, scheduler_output)
    outcome = _outcome(step, fast_trackers, fast_output, retire_from)
    if outcome[0] == "done" and expected[0] == "done":
        # A tracker the loop retired is one it may retire, and it was not resumed this step.
        for req_id, lists in outcome[1].items():
            if lists is None and expected[1][req_id] is not None:
                assert retire_from is not None and retires(retire_from[req_id])
                assert req_id not in fast_output.scheduled_cached_reqs.resumed_req_ids
                outcome[1][req_id] = expected[1][req_id]
    assert outcome == expected


@settings(max_examples=600, deadline=None)
@given(steps())
def test_the_step_loop_leaves_every_tracker_as_the_full_path_does(case):
    _agrees_with_the_full_path(advance_trackers, case)


@settings(max_examples=600, deadline=None)
@given(steps(), st.booleans())
def test_the_step_wrapper_leaves_every_tracker_as_the_full_path_does(case, quiet):
    if quiet:  # no running request gets a block: the wrapper's own test decides, on the other fields
        cached = case[1].scheduled_cached_reqs
        cached.new_block_ids = [None] * len(cached.req_ids)
    _agrees_with_the_full_path(wrapper_step, case)


class _Advanced(Exception):
    pass


def _step_without_advance(connector, scheduler_output):
    """The wrapper's step with `advance_trackers` refused: whether it passed the step over."""
    state = SCHEDULER_STATE.get(connector)

    def refused(*args):
        raise _Advanced

    state.logic = types.SimpleNamespace(**{**vars(state.logic), "advance_trackers": refused})
    try:
        adapter_multigroup.build_connector_meta_wrapper(connector.build_connector_meta, connector, (scheduler_output,), {})
    except _Advanced:
        return False
    return True


def test_the_step_wrapper_passes_over_only_a_step_that_brings_nothing():
    def connector():
        return _Connector({"a": GroupBlockTracker([[1], [2], [3]]), "b": GroupBlockTracker([[4], [5], [6]])}, None)

    # Decode steps with no block for anyone (vLLM's None, or no running request): nothing to do.
    assert _step_without_advance(connector(), _output(["a", "b"], [None, None]))
    assert _step_without_advance(connector(), _output([], []))
    # A finished request only, a resumed one only, a block for one group of one request only, vLLM's
    # empty tables, or an older vLLM's form of the running requests: each goes to advance_trackers.
    assert not _step_without_advance(connector(), _output([], [], finished=["a"]))
    assert not _step_without_advance(connector(), _output(["a", "b"], [None, None], resumed=["b"]))
    assert not _step_without_advance(connector(), _output(["a", "b"], [None, ([], [7], [])]))
    assert not _step_without_advance(connector(), _output(["a"], [([], [], [])]))
    flags = types.SimpleNamespace(req_ids=["a"], resumed_from_preemption=[False], new_block_ids=[None])
    older = types.SimpleNamespace(scheduled_cached_reqs=flags, finished_req_ids=set(), scheduled_new_reqs=[])
    assert not _step_without_advance(connector(), older)
    older.scheduled_cached_reqs = []  # vLLM < 0.9.2: one record per running request
    assert not _step_without_advance(connector(), older)


def test_the_step_wrapper_drops_a_finished_tracker_and_renews_a_resumed_one():
    block_trackers = {"a": GroupBlockTracker([[1], [2], [3]]), "b": GroupBlockTracker([[4], [5], [6]])}
    wrapper_step(block_trackers, _output([], [], finished=["a"]), KV_GROUPS)
    assert list(block_trackers) == ["b"]
    wrapper_step(block_trackers, _output(["b"], [([8], [9], [10])], resumed=["b"]), KV_GROUPS)
    assert block_trackers["b"].block_id_lists() == [[8], [9], [10]]
    # Older vLLM: resumed requests as one flag per request.
    flags = types.SimpleNamespace(req_ids=["b"], resumed_from_preemption=[True], new_block_ids=[([11], [12], [13])])
    older = types.SimpleNamespace(scheduled_cached_reqs=flags, finished_req_ids=set(), scheduled_new_reqs=[])
    wrapper_step(block_trackers, older, KV_GROUPS)
    assert block_trackers["b"].block_id_lists() == [[11], [12], [13]]


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
