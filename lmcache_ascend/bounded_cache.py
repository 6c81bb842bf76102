"""A dictionary of at most `bound` entries, the least recently used dropped first.

The hot path remembers what it derives from arguments that repeat from call to
call (a request length's chunk windows, a chunk shape's device table, an
engine's paged caches). Engines re-register caches and requests come in many
lengths, so every such memory is bounded: `docs/hot-path.md` lists each one,
its key and why. Pure Python; imports nothing of vLLM, LMCache or torch.
"""

from __future__ import annotations

import collections
from typing import Callable, Generic, Hashable, Iterator, TypeVar

V = TypeVar("V")


class BoundedCache(Generic[V]):
    __slots__ = ("_entries", "bound")

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"bound={bound!r} is not allowed; a cache holds at least 1 entry")
        self._entries: collections.OrderedDict[Hashable, V] = collections.OrderedDict()
        self.bound = bound

    # Callers on several threads (LMCache's MP server moves requests on more than one) may
    # evict an entry between two steps of another's lookup: each step is atomic under the
    # GIL, and an entry that is gone by the next step is simply not refreshed or dropped.

    def get(self, key: Hashable) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            try:
                self._entries.move_to_end(key)
            except KeyError:
                pass
        return value

    def put(self, key: Hashable, value: V) -> V:
        self._entries[key] = value
        try:
            self._entries.move_to_end(key)
            while len(self._entries) > self.bound:
                self._entries.popitem(last=False)
        except KeyError:
            pass
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], V]) -> V:
        value = self.get(key)
        return self.put(key, build()) if value is None else value

    def clear(self) -> None:
        self._entries.clear()

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))  # the keys, as of now

    def values(self) -> list[V]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries
