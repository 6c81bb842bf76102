"""cProfile of the batched request path's host side on CUDA (a diagnostic for bench_transfer's request rows).

    python scripts/_profile_request.py [layout ...]     # default: dsv4_bundled mla
"""

import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_request as br  # noqa: E402

for name in sys.argv[1:] or ("dsv4_bundled", "mla"):
    case = br.RequestCase(name, 16384, 256, torch.device("cuda"))
    for label, run in (
        ("device store", lambda: case.ours(case.device_chunks, True)),
        ("staged store", lambda: case.ours(case.host_chunks, True, "staging")),
        ("staged load", lambda: case.ours(case.host_chunks, False, "staging")),
    ):
        for _ in range(5):
            run()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            run()
        profiler.disable()
        print(f"==== {name} {label}: 20 requests")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    del case
    torch.cuda.empty_cache()
