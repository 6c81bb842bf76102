"""H100 diagnostic of the staged path: host timestamps of its steps (first occurrence, us after the call begins,
medians; each step wrapped, which adds a few us) and the device timeline of its copies, per layout and direction;
then the pinned copy against the staged path under each of `VARIANTS` (waves doubling or at capacity after
the first), rounds interleaved. `--against` times this tree's staged calls against another checkout's in the
same process; `--fine` wraps every host step of a DSv4-like store.

    python scripts/_staged_probe.py [--rounds 15] [--against OTHER_CHECKOUT | --fine | --neighbours]
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


def fine_phases(run, before=None, rounds: int = 15) -> dict:
    """`host_phases` of a staged call with every step down to the launch and the stream calls wrapped,
    each call right after `before()` (where given) and a synchronization."""
    from lmcache_ascend.kernels import triton_transfer as tt
    from lmcache_ascend.kv_layout.transfer import ChunkMover

    owners = {
        "transfer": (transfer, ("chunk_buffers", "_joined_neighbours", "_staging_spans", "pool_chunk_buffers",
                                "_copy_spans", "staging_waves", "resolve_chunk_batch", "transfer_chunk_batches",
                                "_device_module")),
        "mover": (ChunkMover, ("staging_buffer", "move_batch", "batch_rows", "_device_slots", "_resolved_slots",
                               "reachable", "_staged_store")),
        "waves": (transfer._StagedWaves, ("plan", "check", "copy")),
        "tt": (tt, ("_launch_chunks", "_pool_offsets_table", "_chunks_launch", "_launch", "chunk_launch_shape")),
        "event": (torch.cuda.Event, ("record",)),
        "stream": (torch.cuda.Stream, ("wait_event",)),
        "context": (torch.cuda.StreamContext, ("__enter__", "__exit__")),
    }
    return host_phases(run, rounds, [(owner, name, f"{prefix}.{name}") for prefix, (owner, names) in owners.items()
                                     for name in names], before)


def host_phases(run, rounds: int = 30, targets=None, before=None) -> dict:
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

    for owner, name, label in targets or (
        (transfer, "chunk_buffers", "chunk_buffers"), (transfer, "_joined_neighbours", "joined"),
        (transfer._StagedWaves, "plan", "plan"), (ChunkMover, "move_batch", "move_batch"),
        (transfer, "resolve_chunk_batch", "resolve"), (transfer, "transfer_chunk_batches", "launches"),
        (transfer, "_copy_spans", "copy_spans"), (ChunkMover, "staging_buffer", "staging_buffer"),
        (transfer, "staging_waves", "waves"), (transfer, "pool_chunk_buffers", "pool_buffers"),
        (transfer, "_staging_spans", "spans"),
    ):
        wrap(owner, name, label)
    try:
        for _ in range(rounds):
            if before is not None:
                before()
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


def _waves_doubling(chunks, capacity, first=transfer.FIRST_WAVE_CHUNKS):
    return _staging_waves(chunks, capacity, first)


_staging_waves = transfer.staging_waves

def _waves_capacity(chunks, capacity, first=transfer.FIRST_WAVE_CHUNKS):
    """The first wave, then waves of `capacity` chunks (no doubling)."""
    waves = _staging_waves(min(chunks, first), capacity, first)
    begin = waves[-1][1] if waves else 0
    while begin < chunks:
        waves.append((begin, min(begin + capacity, chunks)))
        begin = waves[-1][1]
    return waves


# name -> the waves (the code's own first).
VARIANTS = {"doubling": _waves_doubling, "capacity": _waves_capacity}


def _interleaved(runs: dict, rounds: int) -> dict[str, list[float]]:
    """Each of `runs` (name -> call, "copy_pinned" among them) warmed, then timed `rounds` times in a
    rotating order, synchronized before each: name -> us per round."""
    order = list(runs)
    times: dict[str, list[float]] = {name: [] for name in order}
    for name in order:
        runs[name]()
    for round_index in range(rounds):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            torch.cuda.synchronize()
            begin = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - begin) * 1e6)
    return times


def _quartiles(values: list[float], digits: int) -> dict:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), digits), "p25": round(ordered[len(ordered) // 4], digits),
            "p75": round(ordered[(3 * len(ordered)) // 4], digits)}


def _against_pinned(times: dict[str, list[float]], names) -> dict:
    """Per name: its median us and the pinned copy / it per round (median, p25, p75)."""
    out = {name: {"us": round(statistics.median(times[name]), 1),
                  "pinned_over_staged": _quartiles([p / v for p, v in zip(times["copy_pinned"], times[name])], 3)}
           for name in names}
    out["copy_pinned_us"] = round(statistics.median(times["copy_pinned"]), 1)
    return out


def variants_ab(case, store: bool, rounds: int) -> dict:
    """pinned copy / staged call under each of `VARIANTS`, rounds interleaved."""
    saved = transfer.staging_waves

    def under(waves):
        def run():
            transfer.staging_waves = waves
            try:
                case.ours(case.host_chunks, store, "staging")
            finally:
                transfer.staging_waves = saved
        return run

    runs = {"copy_pinned": lambda: case.copy_pinned(store), **{name: under(w) for name, w in VARIANTS.items()}}
    return _against_pinned(_interleaved(runs, rounds), VARIANTS)


def against_ab(case, other_case, store: bool, rounds: int) -> dict:
    """pinned copy / staged call, this tree's against another checkout's (`other_case`: the same request
    built by its `_bench_request`), rounds interleaved; and other / this tree per round."""
    times = _interleaved({
        "copy_pinned": lambda: case.copy_pinned(store),
        "this_tree": lambda: case.ours(case.host_chunks, store, "staging"),
        "other": lambda: other_case.ours(other_case.host_chunks, store, "staging"),
    }, rounds)
    out = _against_pinned(times, ("this_tree", "other"))
    out["other_over_this_tree"] = _quartiles([o / t for o, t in zip(times["other"], times["this_tree"])], 4)
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


def _other_bench(root: str):
    """`scripts/_bench_request.py` of the checkout at `root`, imported beside this tree's with that
    checkout's lmcache_ascend and tests: their modules are loaded under their own names with this
    tree's set aside, then this tree's are put back (each module keeps the globals it was loaded with)."""
    import importlib

    def ours(name):
        return name.split(".")[0] in ("lmcache_ascend", "tests", "_bench_request")

    root_path = Path(root).resolve()
    kept = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in kept:
        del sys.modules[name]
    sys.path[:0] = [str(root_path / "scripts"), str(root_path)]
    try:
        other = importlib.import_module("_bench_request")
        transfer_file = sys.modules["lmcache_ascend.kv_layout.transfer"].__file__
        if not transfer_file.startswith(str(root_path)):
            raise RuntimeError(f"{transfer_file} is not under {root}")
    finally:
        del sys.path[:2]
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(kept)
    return other


def _write(result: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as handle:
        json.dump(result, handle, indent=1)
    print("wrote", out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="results/staged_probe.json")
    parser.add_argument("--against", metavar="TREE",
                        help="only: the staged calls of this tree against another checkout's (its lmcache_ascend)")
    parser.add_argument("--fine", action="store_true",
                        help="only: the DSv4-like staged store's host steps, all wrapped, back to back and after "
                             "the pinned copy")
    parser.add_argument("--neighbours", action="store_true",
                        help="only: the DSv4-like staged call after each other case of the bench")
    args = parser.parse_args()
    result = {}
    if args.against:
        other = _other_bench(args.against)
        for name in ("dsv4_bundled", "mla"):
            case = br.RequestCase(name, 16384, 256, torch.device("cuda"))
            other_case = other.RequestCase(name, 16384, 256, torch.device("cuda"))
            for store in (True, False):
                label = f"{name} {'store' if store else 'load'}"
                result[label] = against_ab(case, other_case, store, args.rounds)
                print(label, json.dumps(result[label]), flush=True)
            del case, other_case
            torch.cuda.empty_cache()
        _write(result, args.out)
        return
    if args.fine:
        case = br.RequestCase("dsv4_bundled", 16384, 256, torch.device("cuda"))
        run = lambda: case.ours(case.host_chunks, True, "staging")  # noqa: E731
        for label, before in (("back_to_back", None), ("after_copy_pinned", lambda: case.copy_pinned(True))):
            run()
            result[label] = fine_phases(run, before, args.rounds)
            print(label, json.dumps(result[label]), flush=True)
        _write(result, args.out)
        return
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
        _write(result, args.out)
        return
    for name in ("dsv4_bundled", "mla"):
        case = br.RequestCase(name, 16384, 256, torch.device("cuda"))
        for store in (True, False):
            label = f"{name} {'store' if store else 'load'}"
            run = lambda: case.ours(case.host_chunks, store, "staging")  # noqa: E731
            run()
            result[label] = {"host_phases_us": host_phases(run, 15), "timeline": br.staged_timeline(case, store),
                             "variants": variants_ab(case, store, args.rounds)}
            for key, value in result[label].items():
                print(label, key, value, flush=True)
        del case
        torch.cuda.empty_cache()
    _write(result, args.out)


if __name__ == "__main__":
    main()
