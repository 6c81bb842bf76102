"""Which requests a failed load of several KV-cache groups touched (pure logic)."""

from __future__ import annotations

from lmcache_ascend.multigroup.load_failures import blocks_of, failed_requests

# Two groups (a sliding window whose early blocks are the null block 0, full attention).
REQUESTS = {
    "a": ([0, 0, 7, 8], [3, 4, 5, 6]),
    "b": ([0, 9, 10], [11, 12, 13]),
    "c": ([14], [15]),
}


def test_an_id_of_any_group_fails_the_requests_holding_it():
    assert failed_requests({8}, REQUESTS) == ["a"]
    assert failed_requests({4}, REQUESTS) == ["a"]
    assert failed_requests({9, 15}, REQUESTS) == ["b", "c"]


def test_ids_no_request_holds_fail_none():
    assert failed_requests({99, 100}, REQUESTS) == []
    assert failed_requests(set(), REQUESTS) == []


def test_the_null_block_fails_nobody():
    assert failed_requests({0}, REQUESTS) == []
    assert failed_requests({0, 10}, REQUESTS) == ["b"]
    assert failed_requests({5}, {"a": ([5, 6], [7])}, null_block_id=5) == []


def test_a_block_shared_by_two_requests_fails_both():
    shared = {"x": ([1, 2], [3]), "y": ([1, 4], [5])}
    assert failed_requests({1}, shared) == ["x", "y"]


def test_every_block_of_a_failed_request_leaves_the_prefix_cache_but_the_null_block():
    assert blocks_of(REQUESTS["a"]) == {3, 4, 5, 6, 7, 8}
    assert blocks_of(([5, 6], [7]), null_block_id=5) == {6, 7}
