"""Where a staged request's time goes, read from device events (no profiler: it slows the host several times).

For one layout's 16K-token request through the staging buffer, per variant: when the
first staging copy starts after the call begins, the idle gaps between copies, when the
last copy ends, the wall time, and the pinned copy of the same bytes beside it (cases
interleaved round by round). A diagnostic for bench_transfer's staged rows.

    python scripts/_staged_probe.py [--layout dsv4_bundled] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_request as br  # noqa: E402
from lmcache_ascend.kv_layout import transfer  # noqa: E402

_events: list = []
_original_copy = transfer._StagedWaves.copy
_original_waves = transfer.staging_waves


def _recorded_copy(self, spans, *, to_staging):
    """`_StagedWaves.copy` between two timing events on the stream it copies on."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    _original_copy(self, spans, to_staging=to_staging)
    end.record()
    _events.append((begin, end))


def timeline(run) -> dict:
    """Run once with the copies between events; us after the call's first event."""
    torch.cuda.synchronize()
    _events.clear()
    transfer._StagedWaves.copy = _recorded_copy
    try:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        host_begin = time.perf_counter()
        run()
        wall = (time.perf_counter() - host_begin) * 1e6
    finally:
        transfer._StagedWaves.copy = _original_copy
    torch.cuda.synchronize()
    spans = [(start.elapsed_time(b) * 1e3, start.elapsed_time(e) * 1e3) for b, e in _events]
    spans.sort()
    return {
        "first_copy_us": round(spans[0][0], 1),
        "gaps_us": [round(b[0] - a[1], 1) for a, b in zip(spans, spans[1:])],
        "copy_busy_us": round(sum(e - b for b, e in spans), 1),
        "last_copy_end_us": round(spans[-1][1], 1),
        "wall_us": round(wall, 1),
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layout", default="dsv4_bundled")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cuda")
    case = br.RequestCase(args.layout, 16384, 256, device)
    resolved = case.mover.upload(case.group_slots.transferred_slot_mappings(), 0)

    def staged(store: bool, first: int, pre_resolved: bool):
        def run():
            transfer.staging_waves = lambda chunks, capacity: _original_waves(chunks, capacity, first)
            slots = resolved if pre_resolved else (lambda: case.mover.upload(case.group_slots.transferred_slot_mappings(), 0))
            try:
                case.mover.move_chunks(case.host_chunks, case.starts, slots, store=store, host_path="staging")
                torch.cuda.synchronize()
            finally:
                transfer.staging_waves = _original_waves
        return run

    result = {"layout": args.layout, "device": torch.cuda.get_device_name(), "directions": {}}
    for store in (True, False):
        variants = {"copy_pinned": lambda: case.copy_pinned(store)}
        for first in (1, 2, 4):
            variants[f"in_call_first{first}"] = staged(store, first, False)
            variants[f"resolved_first{first}"] = staged(store, first, True)
        for run in variants.values():
            run()
            run()
        walls = {label: [] for label in variants}
        lines = {label: [] for label in variants if label != "copy_pinned"}
        labels = list(variants)
        for index in range(args.rounds):
            for label in labels[index % len(labels):] + labels[: index % len(labels)]:
                torch.cuda.synchronize()
                begin = time.perf_counter()
                variants[label]()
                walls[label].append((time.perf_counter() - begin) * 1e6)
            for label in lines:
                lines[label].append(timeline(variants[label]))
        copy = statistics.median(walls["copy_pinned"])
        table = {}
        for label, samples in walls.items():
            median = statistics.median(samples)
            row = {"median_us": round(median, 1), "p25_us": round(sorted(samples)[len(samples) // 4], 1),
                   "p75_us": round(sorted(samples)[3 * len(samples) // 4], 1), "copy_over_this": round(copy / median, 3)}
            if label in lines:
                row["first_copy_us"] = statistics.median(t["first_copy_us"] for t in lines[label])
                row["gap_sum_us"] = statistics.median(sum(t["gaps_us"]) for t in lines[label])
                row["tail_us"] = statistics.median(t["wall_us"] - t["last_copy_end_us"] for t in lines[label])
                row["example_gaps_us"] = lines[label][len(lines[label]) // 2]["gaps_us"]
            table[label] = row
        direction = "store" if store else "load"
        table["host_phases_resolved_first4"] = host_phases(variants["resolved_first4"])
        print(f"  host phases (resolved_first4, us after the call begins): {table['host_phases_resolved_first4']}")
        result["directions"][direction] = table
        print(f"\n{args.layout} {direction}: median wall us [p25, p75], pinned copy / this, device events (medians)")
        for label, row in table.items():
            if label.startswith("host_phases"):
                continue
            extra = (f"  first copy {row['first_copy_us']:>7.1f}  gaps {row['gap_sum_us']:>7.1f}  tail {row['tail_us']:>6.1f}"
                     if "first_copy_us" in row else "")
            print(f"  {label:<18}{row['median_us']:>9.1f} [{row['p25_us']:>8.1f},{row['p75_us']:>8.1f}]"
                  f"  {row['copy_over_this']:>6.3f}{extra}")
    out = Path(os.environ.get("OUT", "results")) / f"staged_probe_{args.layout}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
