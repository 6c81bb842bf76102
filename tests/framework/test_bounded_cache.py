"""`BoundedCache`: at most `bound` entries, the least recently used dropped first, built once per key."""

from __future__ import annotations

import collections

import pytest

from lmcache_ascend.bounded_cache import BoundedCache


def test_the_least_recently_used_entry_goes_first():
    cache = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)
    assert "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2


def test_get_or_build_builds_once_per_key():
    cache = BoundedCache(4)
    built = []

    def build(value):
        built.append(value)
        return value

    assert [cache.get_or_build(key, lambda key=key: build(key * 10)) for key in (1, 2, 1, 2, 3)] == [10, 20, 10, 20, 30]
    assert built == [10, 20, 30]
    cache.clear()
    assert cache.get_or_build(1, lambda: build(11)) == 11 and built[-1] == 11


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="bound=0 is not allowed"):
        BoundedCache(0)


class _EvictedAfterRead(collections.OrderedDict):
    """An entry another thread evicts between this thread's read and its refresh."""

    def get(self, key, default=None):
        value = super().get(key, default)
        self.pop(key, None)
        return value


class _EvictedAfterWrite(collections.OrderedDict):
    """An entry another thread evicts right after this thread stored it, then everything."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.clear()


def test_an_entry_evicted_by_another_thread_midway_is_not_an_error():
    cache = BoundedCache(2)
    cache._entries = _EvictedAfterRead(a=1)
    assert cache.get("a") == 1 and "a" not in cache
    cache._entries = _EvictedAfterWrite()
    assert cache.put("b", 2) == 2 and len(cache) == 0

