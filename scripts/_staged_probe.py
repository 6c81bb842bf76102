"""H100 diagnostic of the staged path: host timestamps of its steps (first occurrence, us after the call begins,
medians; each step wrapped, which adds a few us) and the device timeline of its copies, per layout and direction;
then the pinned copy against the staged path as it is (the first wave's chunks checked alone, its work issued
before the others are checked) and with every chunk checked first (the order before), rounds interleaved.

    python scripts/_staged_probe.py [--rounds 15]
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


def _check_all_first(self, through: int) -> None:
    """`_StagedWaves.check` as before the first wave went out alone: every chunk at the first check."""
    _check(self, len(self.chunks))


_check = transfer._StagedWaves.check


def first_wave_ab(case, store: bool, rounds: int) -> dict:
    """pinned copy / staged, the first wave checked alone (as it is) and every chunk checked first, rounds
    interleaved in a rotating order; medians and [p25-p75] of the per-round ratios."""
    variants = {
        "first_wave_alone": lambda: case.ours(case.host_chunks, store, "staging"),
        "all_checked_first": lambda: case.ours(case.host_chunks, store, "staging"),
    }
    times: dict[str, list[float]] = {name: [] for name in ("copy_pinned", *variants)}
    for name in variants:  # warm both
        variants[name]()
    order = ["copy_pinned", *variants]
    for round_index in range(rounds):
        for name in order[round_index % 3:] + order[: round_index % 3]:
            if name == "all_checked_first":
                transfer._StagedWaves.check = _check_all_first
            try:
                torch.cuda.synchronize()
                begin = time.perf_counter()
                case.copy_pinned(store) if name == "copy_pinned" else variants[name]()
                times[name].append((time.perf_counter() - begin) * 1e6)
            finally:
                transfer._StagedWaves.check = _check
    out = {}
    for name in variants:
        ratios = sorted(p / v for p, v in zip(times["copy_pinned"], times[name]))
        out[name] = {"us": round(statistics.median(times[name]), 1),
                     "pinned_over_staged": round(statistics.median(ratios), 3),
                     "p25": round(ratios[len(ratios) // 4], 3), "p75": round(ratios[(3 * len(ratios)) // 4], 3)}
    out["copy_pinned_us"] = round(statistics.median(times["copy_pinned"]), 1)
    return out


def after_neighbours(case, store: bool, rounds: int) -> dict:
    """The staged call's wall time and its first copy's start (device events, us after the call begins)
    right after each other case of the bench (synchronized in between, as the bench does); medians."""
    neighbours = {label: run for label, run in case.cases(store).items() if label != "ours_staged"}
    neighbours["itself"] = lambda: case.ours(case.host_chunks, store, "staging")
    out = {}
    for label, neighbour in neighbours.items():
        timeline = br.staged_timeline(case, store, rounds, before=neighbour)
        out[label] = {"staged_us": timeline["wall_us"], "first_copy_after_us": timeline["first_copy_after_us"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="results/staged_probe.json")
    parser.add_argument("--neighbours", action="store_true",
                        help="only: the DSv4-like staged call after each other case of the bench")
    args = parser.parse_args()
    result = {}
    if args.neighbours:
        case = br.RequestCase("dsv4_bundled", 16384, 256, torch.device("cuda"))
        for store in (True, False):
            for label, run in case.cases(store).items():
                run()  # warm
            pinned = []
            for _ in range(args.rounds):
                torch.cuda.synchronize()
                begin = time.perf_counter()
                case.copy_pinned(store)
                pinned.append((time.perf_counter() - begin) * 1e6)
            entry = after_neighbours(case, store, args.rounds)
            entry["copy_pinned_us"] = round(statistics.median(pinned), 1)
            result["store" if store else "load"] = entry
            print("store" if store else "load", json.dumps(entry), flush=True)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
        return
    for name in ("dsv4_bundled", "mla"):
        case = br.RequestCase(name, 16384, 256, torch.device("cuda"))
        for store in (True, False):
            label = f"{name} {'store' if store else 'load'}"
            run = lambda: case.ours(case.host_chunks, store, "staging")  # noqa: E731
            run()
            result[label] = {"host_phases_us": host_phases(run, 15), "timeline": br.staged_timeline(case, store),
                             "first_wave": first_wave_ab(case, store, args.rounds)}
            for key, value in result[label].items():
                print(label, key, value, flush=True)
        del case
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
