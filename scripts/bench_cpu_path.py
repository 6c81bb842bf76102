#!/usr/bin/env python3
"""Benchmark a whole request's store and load on the torch path (a CPU worker); print a table and write JSON.

One request in LMCache chunks, stored into memory objects and loaded back, through the
connector's data path (`ChunkMover.move_chunks`, as `MultiGroupGPUConnector` calls it):

* ``ours``: the torch path as shipped (`torch_transfer_chunks`: the batch's bookkeeping
  once, then per chunk, layer and plane one indexed copy; the reference where a batch
  has holes);
* ``reference``: the same call through the reference (`reference_transfer_chunks`, its
  bookkeeping chunk by chunk: what a CPU worker ran before);
* ``memcpy``: one copy of the request's payload bytes (what no layout change can beat).

Layouts: the engine benchmark's tiny Gemma-3 hybrid and Llama (fp32, 4 layers), a
Llama-3-8B-shaped cache (bf16, 32 layers, 8 KV heads of 128), and the DeepSeek-V4-like
bundle of `_bench_request.py`. Cases run interleaved round by round on the same buffers;
each path's bytes are checked against ``reference`` first (stored chunks poisoned first,
loaded caches compared whole).

    python scripts/bench_cpu_path.py                      # 4K and 16K requests
    python scripts/bench_cpu_path.py --tokens 4096 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import _bench_request  # noqa: E402
from _bench_request import RequestCase  # noqa: E402

from lmcache_ascend.kernels import dispatch  # noqa: E402
from lmcache_ascend.kernels.reference import reference_transfer_chunks  # noqa: E402

# (name, groups: (class name, block size, compress ratio, window, planes: ((dtype, row elements), ...)), layers),
# in the form of `_bench_request.LAYOUTS`; K and V are planes of their own, as vLLM's CPU backend keeps them.
LAYOUTS = {
    "gemma3-tiny (2 groups)": (
        (("SlidingWindow", 16, 1, 128, ((torch.float32, 64), (torch.float32, 64))),
         ("FullAttention", 16, 1, None, ((torch.float32, 64), (torch.float32, 64)))),
        2,
    ),
    "llama-tiny": ((("FullAttention", 16, 1, None, ((torch.float32, 64), (torch.float32, 64))),), 4),
    "llama-3-8b shape": ((("FullAttention", 16, 1, None, ((torch.bfloat16, 1024), (torch.bfloat16, 1024))),), 32),
    "dsv4_bundled": _bench_request.LAYOUTS["dsv4_bundled"],
}
PATHS = ("ours", "reference", "memcpy")


def _path(case: RequestCase, name: str, store: bool):
    if name == "memcpy":
        return lambda: case.copy_dst.copy_(case.copy_src)
    transfer = dispatch.torch_transfer_chunks if name == "ours" else reference_transfer_chunks

    def run():
        saved = dispatch.torch_transfer_chunks
        dispatch.torch_transfer_chunks = transfer
        try:
            case.ours(case.device_chunks, store)
        finally:
            dispatch.torch_transfer_chunks = saved

    return run


def _check(case: RequestCase) -> None:
    """ours stores the bytes the reference stores and loads the caches the reference loads."""
    stored = {}
    for name in ("reference", "ours"):
        case.device_pool.fill_(0xA5)
        _path(case, name, True)()
        stored[name] = case.device_pool.clone()
    if not torch.equal(stored["ours"], stored["reference"]):
        raise SystemExit(f"{case.name}: ours stored other bytes than the reference")
    snapshot = case.caches_bytes()
    loaded = {}
    for name in ("reference", "ours"):
        case.set_caches(snapshot)
        _path(case, name, False)()
        loaded[name] = case.caches_bytes()
    if any(not torch.equal(a, b) for a, b in zip(loaded["ours"], loaded["reference"])):
        raise SystemExit(f"{case.name}: ours loaded other bytes than the reference")


def measure(name: str, tokens: int, chunk_size: int, rounds: int) -> dict:
    saved = dict(_bench_request.LAYOUTS)
    _bench_request.LAYOUTS[name] = LAYOUTS[name]
    try:
        case = RequestCase(name, tokens, chunk_size, torch.device("cpu"))
    finally:
        _bench_request.LAYOUTS.clear()
        _bench_request.LAYOUTS.update(saved)
    _check(case)
    result = {"layout": name, "tokens": tokens, "payload_bytes": case.payload, "chunks": len(case.starts)}
    for store in (True, False):
        runs = {path: _path(case, path, store) for path in PATHS}
        for run in runs.values():
            run()  # warm-up
        samples = {path: [] for path in PATHS}
        for index in range(rounds):
            order = PATHS[index % 3:] + PATHS[: index % 3]
            for path in order:
                begin = time.perf_counter()
                runs[path]()
                samples[path].append((time.perf_counter() - begin) * 1e3)
        stats = {path: {"median_ms": statistics.median(values), "p25_ms": sorted(values)[len(values) // 4],
                        "p75_ms": sorted(values)[3 * len(values) // 4]} for path, values in samples.items()}
        per_round = [old / new for old, new in zip(samples["reference"], samples["ours"])]
        result["store" if store else "load"] = {
            "paths": stats,
            "reference_over_ours": statistics.median(per_round),
            "reference_over_ours_range": [min(per_round), max(per_round)],
            "memcpy_over_ours": stats["memcpy"]["median_ms"] / stats["ours"]["median_ms"],
        }
    return result


def table(results: list[dict]) -> str:
    lines = ["| layout | tokens | payload MB | direction | ours ms (p25-p75) | reference ms (p25-p75) | "
             "speed-up (range) | memcpy ms | memcpy / ours |", "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for direction in ("store", "load"):
            entry = result[direction]
            ours, old, copy = (entry["paths"][p] for p in PATHS)
            low, high = entry["reference_over_ours_range"]
            lines.append(
                f"| {result['layout']} | {result['tokens']} | {result['payload_bytes'] / 2**20:.1f} | {direction} | "
                f"{ours['median_ms']:.2f} ({ours['p25_ms']:.2f}-{ours['p75_ms']:.2f}) | "
                f"{old['median_ms']:.2f} ({old['p25_ms']:.2f}-{old['p75_ms']:.2f}) | "
                f"**{entry['reference_over_ours']:.2f}x** ({low:.2f}-{high:.2f}) | {copy['median_ms']:.2f} | "
                f"{entry['memcpy_over_ours']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096,16384", help="comma-separated request lengths in tokens")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (default 1: a CPU worker given one core per thread's worth; "
                             "the engine benchmark's workers run one)")
    parser.add_argument("--out", default="results/bench_cpu_path.json")
    args = parser.parse_args()
    if args.threads <= 0:
        parser.error(f"--threads={args.threads}: allowed: an int >= 1")
    torch.set_num_threads(args.threads)
    try:
        lengths = [int(value) for value in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens={args.tokens!r}: allowed: comma-separated positive ints")
    if any(length <= 0 or length % args.chunk_size for length in lengths):
        parser.error(f"--tokens={args.tokens!r}: each must be a positive multiple of --chunk-size={args.chunk_size}")
    names = args.layouts.split(",")
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: {unknown} unknown; allowed: {', '.join(LAYOUTS)}")
    results = []
    for name in names:
        for length in lengths:
            results.append(measure(name, length, args.chunk_size, args.rounds))
            print(f"  {name} {length}: store {results[-1]['store']['reference_over_ours']:.2f}x, "
                  f"load {results[-1]['load']['reference_over_ours']:.2f}x", flush=True)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
