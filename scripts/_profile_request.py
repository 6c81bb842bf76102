"""cProfile of the batched request path's host side on CUDA (a diagnostic for bench_transfer's request rows)."""

import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_request as br  # noqa: E402

for name in ("mla", "dsv4_bundled"):
    case = br.RequestCase(name, 16384, 256, torch.device("cuda"))
    run = lambda: case.ours(case.device_chunks, True)  # noqa: E731
    for _ in range(5):
        run()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(30):
        run()
    profiler.disable()
    print(f"==== {name}: 30 requests")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
