"""vLLM's builtin LMCache MP connector with every KV-cache group (real vLLM classes).

The connector object is built without its ZMQ scheduler adapter (the client of
the MP server process); a recorder stands in for the adapter's two lock calls.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA, supports_hma

from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.multigroup.attachments import BLOCK_TRACKER
from lmcache_ascend.multigroup.mp_wire import (
    FLAT,
    PER_GROUP,
    WireFormatMismatch,
    block_ids_wire_format,
    encode_block_ids,
    group_block_slices,
    tracked_prefix_bound,
)
from lmcache_ascend.patches import State, registry
from tests.patching import apply_now

REGISTRY = registry.process_registry()
MODULE = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector")
if hasattr(MODULE, "LMCacheMPConnectorUpstream"):
    PATCH, CLASS_NAME = "vllm-lmcache-mp-upstream-multigroup", "LMCacheMPConnectorUpstream"
else:
    PATCH, CLASS_NAME = "vllm-lmcache-mp-connector-multigroup", "LMCacheMPConnector"
CONNECTOR = getattr(MODULE, CLASS_NAME)

DSV4_SIZES = (256, 64, 64, 4, 8)  # vLLM's CUDA DeepSeek-V4 groups; vLLM block size = GCD = 4
VLLM_BS = 4
TOKENS = 4096
BLOCKS_IN_CHUNK = 64  # a 256-token LMCache chunk in vLLM blocks


def _tables(counts, base=1000):
    """Distinct, non-zero block ids per group (group g: base*(g+1) + i)."""
    return tuple([base * (g + 1) + i for i in range(n)] for g, n in enumerate(counts))


class _Adapter:
    def __init__(self):
        self.calls = []

    def cleanup_lookup_result(self, request_id):
        self.calls.append(("cleanup", request_id))

    def free_lookup_locks(self, **kwargs):
        self.calls.append(("free", kwargs))

    def end_session(self, request_id):
        self.calls.append(("end", request_id))


def _connector(block_sizes, vllm_bs=VLLM_BS):
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=size)) for size in block_sizes]
    conn = object.__new__(CONNECTOR)
    conn._kv_cache_config = SimpleNamespace(kv_cache_groups=groups)
    conn.vllm_block_size = vllm_bs
    conn.request_trackers = {}
    conn.scheduler_adapter = _Adapter()
    return conn


def _request(num_tokens=TOKENS, vllm_bs=VLLM_BS):
    return SimpleNamespace(
        request_id="r0",
        cache_salt=None,
        all_token_ids=list(range(num_tokens)),
        block_hashes=[object() for _ in range(num_tokens // vllm_bs)],
        kv_transfer_params=None,
    )


def _alloc(conn, request, tables):
    tracker = MODULE.LMCacheMPRequestTracker(request)
    conn.request_trackers[request.request_id] = tracker
    conn.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: tables), 0)
    return tracker


def _dsv4_tracker(counts):
    """A patched DSv4 connector with one request allocated `counts` blocks per group."""
    conn = _connector(DSV4_SIZES)
    tables = _tables(counts)
    return conn, tables, _alloc(conn, _request(), tables)


@pytest.fixture
def patched():
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    yield
    assert REGISTRY.revert(PATCH) is State.REVERTED


def test_dsv4_slices_and_prefix_bound_pure():
    counts = [len(t) for t in _tables([16, 64, 64, 1024, 512])]
    tables = _tables(counts)
    assert tracked_prefix_bound(tables, DSV4_SIZES, VLLM_BS) == 1024
    slices = group_block_slices(tables, DSV4_SIZES, VLLM_BS, 0, 1024)
    assert [len(s) for s in slices] == [16, 64, 64, 1024, 512]
    second = group_block_slices(tables, DSV4_SIZES, VLLM_BS, 64, 128)  # chunk 1 (tokens 256..511)
    assert second == [tables[0][1:2], tables[1][4:8], tables[2][4:8], tables[3][64:128], tables[4][32:64]]
    # A group with no blocks bounds the prefix to 0 (the review of vLLM #42437).
    assert tracked_prefix_bound(tables[:4] + ([],), DSV4_SIZES, VLLM_BS) == 0
    with pytest.raises(ValueError, match="group 4 .* has 3 blocks"):
        group_block_slices(tables[:4] + ([1, 2, 3],), DSV4_SIZES, VLLM_BS, 0, 64)


def test_wire_formats_and_mismatch_error():
    versions = {"connector": "vLLM 0.18.1", "server protocol": "LMCache 0.4.5"}
    assert encode_block_ids([[5, 6]], FLAT, versions) == [5, 6]
    assert encode_block_ids([[5, 6], [7]], PER_GROUP, versions) == [[5, 6], [7]]
    with pytest.raises(WireFormatMismatch, match=r"vLLM 0\.18\.1.*LMCache 0\.4\.5.*2 KV-cache groups"):
        encode_block_ids([[5, 6], [7]], FLAT, versions)
    assert block_ids_wire_format(MODULE.LoadStoreOp) == (
        PER_GROUP if MODULE.LoadStoreOp.__module__.startswith("lmcache.") and installed_version("lmcache") >= "0.5" else FLAT
    )


def test_connector_is_supports_hma_and_reverts():
    original = CONNECTOR.__bases__
    assert not supports_hma(CONNECTOR)
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    try:
        assert issubclass(CONNECTOR, SupportsHMA)
        conn = _connector((16,), 16)
        request = _request(64, 16)
        _alloc(conn, request, ([1, 2, 3, 4],))
        assert conn.request_finished_all_groups(request, ([1, 2, 3, 4],)) == (True, None)
        assert "r0" not in conn.request_trackers and ("end", "r0") in conn.scheduler_adapter.calls
    finally:
        assert REGISTRY.revert(PATCH) is State.REVERTED
    assert CONNECTOR.__bases__ == original and MODULE.reformat_block_ids.__module__ == MODULE.__name__


def test_unpatched_connector_refuses_more_than_one_group():
    with pytest.raises(RuntimeError, match="hybrid kv cache manager"):
        MODULE.reformat_block_ids(([1], [2]))


def test_store_plan_per_group_every_id(patched):
    conn, tables, tracker = _dsv4_tracker([16, 64, 64, 1024, 512])
    tracker.num_scheduled_tokens = TOKENS
    meta = MODULE.LMCacheMPRequestMetadata.GetStoreMetadata(tracker, BLOCKS_IN_CHUNK, VLLM_BS)
    assert (meta.op.start, meta.op.end) == (0, TOKENS)
    assert meta.op.block_ids == [list(t) for t in tables]  # every id of every group, in order
    assert tracker.num_stored_blocks == 1024
    assert MODULE.LMCacheMPRequestMetadata.GetStoreMetadata(tracker, BLOCKS_IN_CHUNK, VLLM_BS) is None


def test_store_waits_for_a_missing_group(patched):
    conn, tables, tracker = _dsv4_tracker([16, 64, 64, 1024, 0])
    tracker.num_scheduled_tokens = TOKENS
    assert MODULE.LMCacheMPRequestMetadata.GetStoreMetadata(tracker, BLOCKS_IN_CHUNK, VLLM_BS) is None
    # The group's blocks arrive in a later step (all blocks passed again): now the first 2 chunks.
    grown = tables[:4] + ([9000 + i for i in range(64)],)
    conn.update_state_after_alloc(_request(), SimpleNamespace(get_block_ids=lambda: grown), 0)
    meta = MODULE.LMCacheMPRequestMetadata.GetStoreMetadata(tracker, BLOCKS_IN_CHUNK, VLLM_BS)
    assert (meta.op.start, meta.op.end) == (0, 512)
    assert meta.op.block_ids == [tables[0][:2], tables[1][:8], tables[2][:8], tables[3][:128], grown[4]]


def test_cached_request_appends_per_group(patched):
    conn = _connector((8, 4))
    request = _request(64)
    tracker = _alloc(conn, request, ([1, 2], [11, 12, 13, 14]))
    tracker.num_scheduled_tokens = 16
    conn.scheduler_adapter.num_blocks_per_chunk = lambda: 4
    cached = SimpleNamespace(
        req_ids=["r0"], resumed_req_ids=set(), new_block_ids=[([3, 4], [15, 16, 17, 18])],
        num_computed_tokens=[16],  # vLLM 0.18 adds this (not num_scheduled_tokens) to the tracker
    )
    out = SimpleNamespace(scheduled_cached_reqs=cached, num_scheduled_tokens={"r0": 16})
    metadata = MODULE.LMCacheMPConnectorMetadata()
    conn._process_cached_requests(out, metadata)
    assert len(metadata) == 1
    # 32 tokens scheduled, both groups cover 8 vLLM blocks: chunks 0 and 1, with the appended ids.
    assert metadata.requests[0].op.block_ids == [[1, 2, 3, 4], [11, 12, 13, 14, 15, 16, 17, 18]]
    assert BLOCK_TRACKER.get(tracker).block_id_lists() == [[1, 2, 3, 4], [11, 12, 13, 14, 15, 16, 17, 18]]


def test_retrieve_plan_per_group_and_short_group_refused(patched):
    conn, tables, tracker = _dsv4_tracker([16, 64, 64, 1024, 512])
    tracker.num_lmcache_hit_blocks, tracker.num_vllm_hit_blocks = 128, 64
    tracker.state = MODULE.LMCacheMPRequestState.WAITING_FOR_LOAD
    meta = MODULE.LMCacheMPRequestMetadata.GetRetrieveMetadata(tracker, BLOCKS_IN_CHUNK, VLLM_BS)
    assert (meta.op.start, meta.op.end) == (256, 512)
    assert meta.op.block_ids == [tables[0][1:2], tables[1][4:8], tables[2][4:8], tables[3][64:128], tables[4][32:64]]
    del BLOCK_TRACKER.get(tracker).block_ids_by_group[4][40:]
    with pytest.raises(ValueError, match="group 4"):
        MODULE.LMCacheMPRequestMetadata.GetRetrieveMetadata(tracker, BLOCKS_IN_CHUNK, VLLM_BS)


def test_single_group_op_matches_unpatched():
    def plan():
        conn = _connector((16,), 16)
        request = _request(256, 16)
        tracker = MODULE.LMCacheMPRequestTracker(request)
        conn.request_trackers["r0"] = tracker
        conn.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (list(range(7, 23)),)), 0)
        tracker.num_scheduled_tokens = 256
        return MODULE.LMCacheMPRequestMetadata.GetStoreMetadata(tracker, 8, 16).op

    before = plan()
    assert apply_now(REGISTRY, PATCH) is State.APPLIED
    try:
        after = plan()
    finally:
        REGISTRY.revert(PATCH)
    assert (after.start, after.end, after.token_ids) == (before.start, before.end, before.token_ids)
    if block_ids_wire_format(MODULE.LoadStoreOp) == PER_GROUP:
        assert after.block_ids == [list(before.block_ids)]
    else:
        assert after.block_ids == list(before.block_ids)


@dataclass
class _LoadStoreOp045:
    """The shape of LMCache 0.4.5's MP ``LoadStoreOp`` (flat ``block_ids``), for stacks with 0.5.x."""

    token_ids: list[int]
    block_ids: list[int]
    start: int = 0
    end: int = 0
    skip_first_n_tokens: int = 0


def test_multi_group_to_flat_server_fails_naming_both_versions(patched, monkeypatch):
    # A flat op of an adapter that cannot negotiate (LMCache 0.4.5's own adapter learns the
    # server's format at registration: tests/multigroup/test_mp_server_client.py).
    flat_op = _LoadStoreOp045
    monkeypatch.setattr(MODULE, "LoadStoreOp", flat_op)
    conn = _connector((8, 4))
    tracker = _alloc(conn, _request(64), ([1, 2, 3, 4], list(range(11, 19))))
    tracker.num_scheduled_tokens = 32
    with pytest.raises(WireFormatMismatch) as error:
        MODULE.LMCacheMPRequestMetadata.GetStoreMetadata(tracker, 4, 4)
    message = str(error.value)
    assert f"vLLM {installed_version('vllm')}" in message and "2 KV-cache groups" in message
