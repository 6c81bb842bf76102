#!/usr/bin/env python
"""What the chunk seal costs beside the remote transfer it guards.

    .venvs/stack-d/bin/python scripts/bench_chunk_seal.py [--rounds 15] [--sizes-mib 0.4,4,32]

A chunk that leaves the process is sealed as LMCache's remote backend sends it and
checked as it comes back (`lmcache_ascend.kv_worker.chunk_seal`). This times, per
chunk size and interleaved round by round on the same buffer:

- ``seal + check``: writing the seal and checking it (what one store and one load
  of the chunk add);
- ``host copy``: one copy of the chunk's bytes in host memory (a lower bound of any
  transfer: a remote get lands the bytes once at least);
- ``redis set + get``: the chunk's bytes stored into and read back from a Redis
  server on loopback, as LMCache's Redis connector moves them: the transfer the seal
  guards (left out without ``redis-server`` on PATH or the ``redis`` package);
- ``file write + read``: the chunk written to a file of the temporary folder and read
  back into a buffer, as LMCache's local disk backend moves it (through the page cache:
  the cheapest a disk round trip gets).

Sizes: 0.4 MiB is a 256-token chunk of the engine tests' tiny Gemma-style model;
4 MiB and 32 MiB are 256-token chunks of 1B- and 8B-class models (fp16, full
attention). Prints medians with their interquartile range and the seal's share of
each transfer; writes results/bench_chunk_seal.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from lmcache_ascend.kv_worker.chunk_seal import is_sealed, seal  # noqa: E402


@contextlib.contextmanager
def _redis():
    if shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None:
        print("no redis-server on PATH or no redis package: the Redis row is left out")
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield client
    finally:
        server.kill()
        server.wait()


def _timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _arms(buffer: np.ndarray, target: np.ndarray, client, folder: Path) -> dict:
    def seal_and_check():
        seal(buffer)
        assert is_sealed(buffer)

    def file_round_trip():
        path = folder / "bench-chunk"
        with open(path, "wb") as handle:
            handle.write(memoryview(buffer))
        with open(path, "rb") as handle:
            assert handle.readinto(memoryview(target)) == buffer.nbytes

    arms = {"seal + check": seal_and_check, "host copy": lambda: np.copyto(target, buffer),
            "file write + read": file_round_trip}
    if client is not None:
        view = memoryview(buffer)

        def redis_round_trip():
            client.set("bench-chunk", view)
            assert len(client.get("bench-chunk")) == buffer.nbytes

        arms["redis set + get"] = redis_round_trip
    return arms


def _summary(samples: list[float]) -> dict:
    quartiles = statistics.quantiles(samples, n=4)
    return {"median_ms": statistics.median(samples) * 1e3, "iqr_ms": (quartiles[2] - quartiles[0]) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes-mib", default="0.4,4,32")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_chunk_seal.json")
    options = parser.parse_args()
    if options.rounds < 3:
        parser.error(f"--rounds {options.rounds}: at least 3 rounds are needed for a spread")
    try:
        sizes = [float(size) for size in options.sizes_mib.split(",")]
    except ValueError:
        parser.error(f"--sizes-mib {options.sizes_mib!r}: comma-separated sizes in MiB, e.g. 0.4,4,32")
    if not sizes or min(sizes) <= 0:
        parser.error(f"--sizes-mib {options.sizes_mib!r}: every size must be positive")
    rows = []
    with _redis() as client, tempfile.TemporaryDirectory(prefix="bench-chunk-seal-") as folder:
        for size in sizes:
            nbytes = int(size * (1 << 20))
            buffer = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            target = np.empty_like(buffer)
            arms = _arms(buffer, target, client, Path(folder))
            samples = {name: [] for name in arms}
            for action in arms.values():  # warm-up: pages touched, connection open
                action()
            for round_index in range(options.rounds):
                names = list(arms)
                for name in names[round_index % len(names):] + names[: round_index % len(names)]:
                    samples[name].append(_timed(arms[name]))
            row = {"size_mib": size, **{name: _summary(times) for name, times in samples.items()}}
            seal_ms = row["seal + check"]["median_ms"]
            row["seal_over_copy"] = seal_ms / row["host copy"]["median_ms"]
            row["seal_over_file"] = seal_ms / row["file write + read"]["median_ms"]
            if "redis set + get" in row:
                row["seal_over_redis"] = seal_ms / row["redis set + get"]["median_ms"]
            rows.append(row)
    header = (f"{'MiB':>6} | {'seal + check ms':>16} | {'host copy ms':>14} | {'redis set+get ms':>17} | "
              f"{'file w+r ms':>15} | seal/copy | seal/redis | seal/file")
    print(header)
    print("-" * len(header))
    for row in rows:
        redis_cell = (f"{row['redis set + get']['median_ms']:8.2f} ({row['redis set + get']['iqr_ms']:.2f})"
                      if "redis set + get" in row else "-")
        file_cell = f"{row['file write + read']['median_ms']:7.3f} ({row['file write + read']['iqr_ms']:.3f})"
        print(f"{row['size_mib']:6.1f} | {row['seal + check']['median_ms']:8.3f} ({row['seal + check']['iqr_ms']:.3f})"
              f" | {row['host copy']['median_ms']:7.3f} ({row['host copy']['iqr_ms']:.3f}) | {redis_cell:>17} | "
              f"{file_cell:>15} | {row['seal_over_copy']:9.2f} | {row.get('seal_over_redis', float('nan')):10.3f} | "
              f"{row['seal_over_file']:9.3f}")
    print("medians (interquartile range) over", options.rounds, "interleaved rounds")
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps({"rounds": options.rounds, "rows": rows}, indent=2))
    print("wrote", options.out)


if __name__ == "__main__":
    main()
