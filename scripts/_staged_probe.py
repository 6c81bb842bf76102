"""H100 diagnostic of the staged path: host timestamps of its steps (first occurrence, us after the call begins,
medians; each step wrapped, which adds a few us) and the device timeline of its copies, per layout and direction.

    python scripts/_staged_probe.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_request as br  # noqa: E402
from lmcache_ascend.kv_layout import transfer  # noqa: E402


def host_phases(run, rounds: int = 30) -> dict:
    """Host timestamps (us after the call begins) of the staged path's steps, first occurrence of
    each, medians over `rounds` calls; `kernels_done`: device time of the first wave's kernels' end."""
    from lmcache_ascend.kv_layout.transfer import ChunkMover

    marks: dict[str, list[float]] = {}
    current: dict[str, float] = {}
    begin = [0.0]
    wrapped = {}

    def wrap(owner, name, label):
        original = getattr(owner, name)
        wrapped[(owner, name)] = original

        def timed(*args, **kwargs):
            entered = (time.perf_counter() - begin[0]) * 1e6
            value = original(*args, **kwargs)
            current.setdefault(label + ".enter", entered)
            current.setdefault(label + ".exit", (time.perf_counter() - begin[0]) * 1e6)
            return value

        setattr(owner, name, timed)

    wrap(transfer, "chunk_buffers", "chunk_buffers")
    wrap(transfer, "_joined_neighbours", "joined")
    wrap(transfer._StagedWaves, "plan", "plan")
    wrap(ChunkMover, "move_batch", "move_batch")
    wrap(transfer, "resolve_chunk_batch", "resolve")
    wrap(transfer, "transfer_chunk_batches", "launches")
    wrap(transfer, "_copy_spans", "copy_spans")
    wrap(ChunkMover, "staging_buffer", "staging_buffer")
    wrap(transfer, "staging_waves", "waves")
    wrap(transfer, "pool_chunk_buffers", "pool_buffers")
    wrap(transfer, "_staging_spans", "spans")
    try:
        for _ in range(rounds):
            torch.cuda.synchronize()
            current.clear()
            begin[0] = time.perf_counter()
            run()
            for label, value in current.items():
                marks.setdefault(label, []).append(value)
    finally:
        for (owner, name), original in wrapped.items():
            setattr(owner, name, original)
    return {label: round(statistics.median(values), 1) for label, values in sorted(marks.items(), key=lambda kv: statistics.median(kv[1]))}


for name in ("dsv4_bundled", "mla"):
    case = br.RequestCase(name, 16384, 256, torch.device("cuda"))
    for store in (True, False):
        run = lambda: case.ours(case.host_chunks, store, "staging")
        run()
        print(name, "store" if store else "load", host_phases(run, 15), flush=True)
        print(name, "store" if store else "load", br.staged_timeline(case, store), flush=True)
    del case
    torch.cuda.empty_cache()
