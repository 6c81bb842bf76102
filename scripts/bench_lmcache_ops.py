"""lmcache_ascend.ops on a GPU: byte equality with LMCache's torch baseline, then speed against it.

    python scripts/bench_lmcache_ops.py [--baseline-sources DIR] [--cases 200] [--out results/]

1. Equality: `--cases` random cases per op (tests/ops/_cases.py: formats x dtypes
   incl. int8/fp8 x block sizes x layer counts x chunk and slot patterns), run on
   the GPU by our ops (Triton) and by LMCache 0.5.6's baseline, every byte compared.
2. Speed of `multi_layer_block_kv_transfer` (LMCache's MP transfer op), store and
   load, objects on the GPU, for MLA, K/V-separate MHA and a DSv4-like bundled
   layout at 256 / 1024 / 4096 / 16384 tokens: ours, the baseline and a same-byte
   `copy_`, interleaved round by round, CUDA-event timed; median and IQR. Beside
   each, the host time of one call of ours and of the baseline (from an idle
   device to the call's return).
The baseline is LMCache itself when installed, else its baseline files in
`--baseline-sources` (see tests/ops/_baseline.py). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lmcache_ascend.kernels import launch_counter  # noqa: E402
from tests.ops import _cases  # noqa: E402
from tests.ops._baseline import load_from_sources, lmcache_baseline, ours  # noqa: E402

LAYOUTS = {
    # name: (format, layers, block size, per-layer plane shapes (trailing dims) and dtypes)
    "MLA (NL_X_NB_BS_HS, bf16 576)": (3, 32, 64, [((576,), torch.bfloat16)]),
    "K/V-separate MHA (NL_X_TWO_X_NB_BS_NH_HS, 8x128 bf16)": (16, 32, 128, [((8, 128), torch.bfloat16)] * 2),
    "DSv4-like bundled (NL_X_NP_X_NB_BS_ONE_HS: fp8 512, bf16 64, int8 128, fp16 1)": (
        17, 32, 64,
        [((1, 512), torch.float8_e4m3fn), ((1, 64), torch.bfloat16), ((1, 128), torch.int8), ((1, 1), torch.float16)],
    ),
}
TOKENS = (256, 1024, 4096, 16384)
CHUNK = 256


def equality(device, baseline, mine, cases):
    results = {}
    for op in _cases.OPS:
        outcomes = collections.Counter()
        launch_counter.reset()
        first_mismatch = None
        for seed in range(cases):
            case = _cases.build(op, _cases.RandomDraw(10_000 + seed), device)
            outcome, detail = _cases.run_case(case, mine, baseline)
            outcomes[outcome] += 1
            outcomes[detail] += outcome == "equal"
            if outcome == "mismatch" and first_mismatch is None:
                first_mismatch = (seed, case["meta"], detail)
        results[op] = {"cases": cases, **outcomes, "triton_launches": launch_counter.triton,
                       "torch_launches": launch_counter.torch, "first_mismatch": repr(first_mismatch)}
        print(f"EQUALITY {op}: {dict(outcomes)} triton={launch_counter.triton} torch={launch_counter.torch}"
              + (f" FIRST MISMATCH {first_mismatch}" if first_mismatch else ""), flush=True)
    return results


def _setup(device, fmt, layers, bs, planes, tokens, ops):
    blocks = tokens // bs
    nb = blocks * 2 + 8
    paged = []
    for _ in range(layers):
        per_layer = tuple(torch.randint(0, 256, (nb, bs, *shape[:-1], shape[-1] * dtype.itemsize),
                                        dtype=torch.uint8, device=device).view(dtype) for shape, dtype in planes)
        paged.append(per_layer)
    if fmt == 3:
        paged = [p[0] for p in paged]
    row = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in planes)
    objects = tokens // CHUNK
    if fmt == 16:
        hidden = torch.Size(planes[0][0]).numel()
        objs = [torch.zeros(2, layers, CHUNK, hidden, dtype=planes[0][1], device=device) for _ in range(objects)]
    elif fmt == 3:
        objs = [torch.zeros(layers, CHUNK, planes[0][0][0], dtype=planes[0][1], device=device) for _ in range(objects)]
    else:
        objs = [torch.zeros(layers, CHUNK, row, dtype=torch.uint8, device=device) for _ in range(objects)]
    ids = torch.randperm(nb, device=device)[:blocks].to(torch.int64)
    desc = ops.PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs = (1 if fmt != 16 else 2), layers, nb, bs
    desc.nh, desc.hs = 1, planes[0][0][-1]
    desc.element_size = planes[0][1].itemsize
    desc.dtype = None if fmt == 17 else planes[0][1]
    moved = layers * tokens * row
    return paged, objs, ids, desc, moved


def _time(fn, repeats=1):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * 1000.0  # us


def _host_time(fn):
    """Host time of one call (us): from an idle device to the call's return, no synchronization
    inside it (what the calling thread spends; the device may still be working)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    elapsed = (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    return elapsed


def speed(device, baseline, mine, rounds):
    rows = []
    for name, (fmt, layers, bs, planes) in LAYOUTS.items():
        for tokens in TOKENS:
            for store in (True, False):
                times = {"ours": [], "baseline": [], "copy": [], "ours_host": [], "baseline_host": []}
                paged, objs, ids, desc, moved = _setup(device, fmt, layers, bs, planes, tokens, mine)
                # The baseline's own dtype handling of fp8 planes: uint8 views of the same bytes.
                base_paged = [tuple(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in layer)
                              for layer in paged] if fmt == 17 else paged
                bdesc = baseline.PageBufferShapeDesc()
                for field in ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size"):
                    setattr(bdesc, field, getattr(desc, field))
                bdesc.dtype = desc.dtype
                src = torch.empty(moved, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                direction = 1 if store else 0

                def run_ours():
                    mine.multi_layer_block_kv_transfer(paged, objs, ids, device, direction, desc, CHUNK,
                                                       mine.fmt(fmt), 0)

                def run_baseline():
                    baseline.multi_layer_block_kv_transfer(base_paged, objs, ids, device,
                                                           direction, bdesc, CHUNK,
                                                           baseline.fmt(fmt), 0)

                def run_copy():
                    dst.copy_(src)

                for fn in (run_ours, run_baseline, run_copy):
                    fn()
                torch.cuda.synchronize()
                inner = max(1, min(20, int(2e5 // max(1, moved // 10**4))))
                for _ in range(rounds):
                    times["ours"].append(_time(run_ours, inner))
                    times["baseline"].append(_time(run_baseline, 1))
                    times["copy"].append(_time(run_copy, inner))
                    times["ours_host"].append(_host_time(run_ours))
                    times["baseline_host"].append(_host_time(run_baseline))
                row = {"layout": name, "tokens": tokens, "direction": "store (D2H)" if store else "load (H2D)",
                       "bytes": moved}
                for key, values in times.items():
                    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
                    row[f"{key}_us"] = statistics.median(values)
                    row[f"{key}_iqr_us"] = [quartiles[0], quartiles[2]]
                row["baseline_over_ours"] = row["baseline_us"] / row["ours_us"]
                row["ours_over_copy"] = row["ours_us"] / row["copy_us"]
                row["ours_GBps"] = moved / row["ours_us"] / 1e3
                rows.append(row)
                print(f"SPEED {name[:28]:28s} {tokens:6d} {row['direction']:11s} ours {row['ours_us']:9.1f} us "
                      f"baseline {row['baseline_us']:10.1f} us copy {row['copy_us']:8.1f} us  "
                      f"baseline/ours {row['baseline_over_ours']:7.1f}x  ours/copy {row['ours_over_copy']:5.2f}x "
                      f"{row['ours_GBps']:7.1f} GB/s  host per call: ours {row['ours_host_us']:7.1f} us "
                      f"baseline {row['baseline_host_us']:8.1f} us", flush=True)
                del paged, objs, base_paged, src, dst
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-sources", default=None)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    baseline = load_from_sources(args.baseline_sources) if args.baseline_sources else lmcache_baseline()
    mine = ours(baseline.fmt)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    print(report, flush=True)
    report["equality"] = equality(device, baseline, mine, args.cases)
    if device.type == "cuda" and not args.skip_speed:
        report["speed"] = speed(device, baseline, mine, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_lmcache_ops.json").write_text(json.dumps(report, indent=1, default=str))
    mismatches = sum(r.get("mismatch", 0) for r in report["equality"].values())
    print("MISMATCHES", mismatches)
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    os.environ.setdefault("LMCACHE_ASCEND_AUTOLOAD", "0")
    main()
