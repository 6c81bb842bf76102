"""Group geometries for the worker-side tests: `KVGroupSpec`s described by rows per block."""

from __future__ import annotations

from lmcache_ascend.multigroup.specs import KVGroupSpec


def geometry(group: int, compress_ratio: int = 1, sliding_window: int | None = None, *, transferred: bool = True,
             block_rows: int = 1) -> KVGroupSpec:
    """Scheduler group `group` whose blocks hold `block_rows` rows of `compress_ratio` tokens."""
    return KVGroupSpec(group, f"test-group-{group}", block_rows * compress_ratio, compress_ratio, sliding_window,
                       transferred=transferred)
