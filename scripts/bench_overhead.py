#!/usr/bin/env python
"""What lmcache-ascend costs at import time, measured in fresh processes.

    .venvs/stack-b/bin/python scripts/bench_overhead.py [--alone-runs 60] [--runs 10] [--skip-vllm]

Each cell is a fresh interpreter; baseline and overlay run interleaved, run by
run, so that machine noise hits both alike.  Every row reports the median with
its spread (interquartile range, minimum) for each side, the added time and its
ratio, and a bootstrap 95% interval of the difference of the medians: a row
"resolves 1%" when that interval is narrower than +-1% of the baseline median;
otherwise it says it cannot, and how many runs would be needed at this spread.

1. ``import lmcache_ascend`` (activation included: flags validated, the catalogue
   read, post-import hooks registered; no patch declaration is imported before its
   target) in a process that has already imported the standard library and
   packaging modules vLLM imports anyway (`VLLM_ALREADY_IMPORTED`): the package's
   own share.  Baseline: the same process timing nothing.  Target <= 5 ms.  With
   ``--before CHECKOUT`` the other checkout is timed in the same interleaved runs
   and a comparison row (that checkout as the baseline) gives the ratio and
   whether the runs resolve 1% of it.
2. ``import vllm; import lmcache`` without the overlay, and with it active through
   the wheel's .pth start-up hook (the way users get it). Target <= 2 % added.
3. The same plus the patch targets themselves (so every patch is really applied).

Times are taken inside the child around the timed imports only (interpreter
start-up is left out).  Prints a table and writes results/bench_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Children compile once and then load bytecode, as an installed wheel does; the cache
# lives outside every checkout (PYTHONDONTWRITEBYTECODE would time the compiler instead).
PYCACHE_PREFIX = Path(os.environ.get("TMPDIR", "/tmp")) / "lmcache-ascend-bench-pycache"
WARM_UP_RUNS = 2

# What a vLLM process has imported before anything of ours runs (a subset of what
# `import vllm` loads): the "alone" row times lmcache_ascend on top of these.
VLLM_ALREADY_IMPORTED = (
    "import argparse, contextvars, dataclasses, enum, functools, hashlib, importlib.metadata, inspect, "
    "json, logging, os, re, threading, traceback, typing, packaging.specifiers, packaging.version"
)

TIMED = """
import time, sys
{untimed}
start, cpu_start = time.perf_counter(), time.process_time()
{imports}
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
applied = 0
if 'lmcache_ascend' in sys.modules:
    from lmcache_ascend.patches import registry
    applied = sum(r.state.value == 'applied' for r in registry.process_registry().records())
print(f'ELAPSED={{elapsed}} CPU={{cpu}} APPLIED={{applied}}')
"""


def patch_targets() -> list[str]:
    sys.path.insert(0, str(REPO_ROOT))
    from lmcache_ascend.compat.versions import installed_version
    from lmcache_ascend.patches.catalogue import CATALOGUE

    return sorted({e.target for e in CATALOGUE if all(installed_version(d) for d in e.requires)})


def run_child(imports: str, overlay: bool, untimed: str = "", repo: Path = REPO_ROOT) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, patches applied) of the timed imports in a fresh child."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_ASCEND_") and k != "PYTHONDONTWRITEBYTECODE"
    }
    env.update(
        PYTHONPYCACHEPREFIX=str(PYCACHE_PREFIX),
        PYTHONPATH=str(repo),
        LMCACHE_ASCEND_AUTOLOAD="1" if overlay else "0",
        LMCACHE_LOG_LEVEL="WARNING",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    result = subprocess.run(
        [sys.executable, "-c", TIMED.format(untimed=untimed, imports=imports)],
        env=env, capture_output=True, text=True, cwd=repo,  # sys.path[0] is the working directory
    )
    line = next((l for l in result.stdout.splitlines() if l.startswith("ELAPSED=")), None)
    if result.returncode != 0 or line is None:
        raise SystemExit(f"child failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    elapsed, cpu, applied = (field.split("=")[1] for field in line.split())
    return float(elapsed), float(cpu), int(applied)


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def median_difference_interval(baseline: list[float], overlay: list[float], draws: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of median(overlay) - median(baseline)."""
    rng = random.Random(0)
    diffs = sorted(
        statistics.median(rng.choices(overlay, k=len(overlay))) - statistics.median(rng.choices(baseline, k=len(baseline)))
        for _ in range(draws)
    )
    return diffs[int(0.025 * draws)], diffs[int(0.975 * draws) - 1]


def summarize(baseline: list[float], overlay: list[float], applied: int | None) -> dict[str, object]:
    """Medians with spread, the added time, and whether the runs resolve a 1% difference."""
    row: dict[str, object] = {"runs": len(baseline)}
    for side, values in (("baseline", baseline), ("with_overlay", overlay)):
        q1, q3 = _quartiles(values)
        row[f"{side}_ms_median"] = round(statistics.median(values) * 1e3, 3)
        row[f"{side}_ms_iqr"] = [round(q1 * 1e3, 3), round(q3 * 1e3, 3)]
        row[f"{side}_ms_min"] = round(min(values) * 1e3, 3)
    base_median = statistics.median(baseline)
    added = statistics.median(overlay) - base_median
    low, high = median_difference_interval(baseline, overlay)
    row["added_ms_median"] = round(added * 1e3, 3)
    row["added_ms_95ci"] = [round(low * 1e3, 3), round(high * 1e3, 3)]
    half_width = (high - low) / 2
    row["resolution_ratio"] = round(half_width / base_median, 4) if base_median > 0 else None
    row["resolves_1_percent"] = bool(base_median > 0 and half_width <= 0.01 * base_median)
    if not row["resolves_1_percent"] and base_median > 0:
        # The interval narrows as 1/sqrt(runs).
        row["runs_needed_for_1_percent"] = int(len(baseline) * (half_width / (0.01 * base_median)) ** 2) + 1
    if base_median > 0:
        row["added_ratio_median"] = round(added / base_median, 4)
    if applied is not None:
        row["patches_applied"] = applied
    return row


def measure(imports: str, runs: int) -> dict[str, object]:
    for _ in range(WARM_UP_RUNS):  # bytecode written, file-system caches warm
        run_child(imports, overlay=False)
        run_child(imports, overlay=True)
    baseline, overlay, applied = [], [], 0
    for _ in range(runs):
        baseline.append(run_child(imports, overlay=False))
        overlay.append(run_child(imports, overlay=True))
        applied = overlay[-1][2]
    row = summarize([run[0] for run in baseline], [run[0] for run in overlay], applied)
    row["cpu"] = summarize([run[1] for run in baseline], [run[1] for run in overlay], None)
    return row


def measure_alone(runs: int, repos: dict[str, Path]) -> dict[str, dict[str, object]]:
    """The "alone" row for each checkout in `repos` (this one, and --before), interleaved run by run."""
    nothing: list[tuple[float, float, int]] = []
    package: dict[str, list[tuple[float, float, int]]] = {label: [] for label in repos}
    for _ in range(WARM_UP_RUNS):
        for repo in repos.values():
            run_child("import lmcache_ascend", overlay=False, untimed=VLLM_ALREADY_IMPORTED, repo=repo)
    for _ in range(runs):
        nothing.append(run_child("pass", overlay=False, untimed=VLLM_ALREADY_IMPORTED))
        for label, repo in repos.items():
            package[label].append(
                run_child("import lmcache_ascend", overlay=False, untimed=VLLM_ALREADY_IMPORTED, repo=repo)
            )
    rows = {}
    for label, runs_of_package in package.items():
        row = _absolute_row([run[0] for run in nothing], [run[0] for run in runs_of_package])
        row["cpu"] = _absolute_row([run[1] for run in nothing], [run[1] for run in runs_of_package])
        rows[f"import lmcache_ascend ({label})"] = row
    this, *others = package
    for label in others:  # the other checkout is the baseline: ratio and 1% resolution mean something here
        before, after = package[label], package[this]
        row = summarize([run[0] for run in before], [run[0] for run in after], None)
        row["cpu"] = summarize([run[1] for run in before], [run[1] for run in after], None)
        rows[f"import lmcache_ascend, {this} vs {label}"] = row
    return rows


def _absolute_row(nothing: list[float], package: list[float]) -> dict[str, object]:
    row = summarize(nothing, package, None)
    # The baseline times nothing: a ratio to it means nothing, the added milliseconds do.
    for key in ("added_ratio_median", "resolution_ratio", "runs_needed_for_1_percent"):
        row.pop(key, None)
    row["resolves_1_percent"] = None
    return row


def print_table(rows: dict[str, dict[str, object]], versions: dict[str, str | None]) -> None:
    print("import overhead, fresh processes, baseline and overlay interleaved ("
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")")
    print(f"{'measurement':<54} {'runs':>5} {'baseline median [IQR] ms':>28} {'overlay median [IQR] ms':>28} "
          f"{'added ms [95% CI]':>26} {'added':>8}  resolves 1%")
    table = {}
    for label, row in rows.items():
        table[f"{label}, wall"] = row
        table[f"{label}, CPU"] = row["cpu"]
    for label, row in table.items():
        def cell(side: str) -> str:
            q1, q3 = row[f"{side}_ms_iqr"]
            return f"{row[f'{side}_ms_median']:.2f} [{q1:.2f}, {q3:.2f}]"

        low, high = row["added_ms_95ci"]
        ratio = row.get("added_ratio_median")
        resolves = row["resolves_1_percent"]
        verdict = ("n/a (absolute row)" if resolves is None else "yes" if resolves
                   else f"no: +-{row['resolution_ratio']:.1%}, ~{row['runs_needed_for_1_percent']} runs needed")
        print(f"{label:<54} {row['runs']:>5} {cell('baseline'):>28} {cell('with_overlay'):>28} "
              f"{row['added_ms_median']:>8.2f} [{low:.2f}, {high:.2f}] "
              f"{'-' if ratio is None else format(ratio, '.2%'):>8}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alone-runs", type=int, default=60, help="runs of the 'import lmcache_ascend' row")
    parser.add_argument("--runs", type=int, default=10, help="runs of each vLLM row")
    parser.add_argument("--skip-vllm", action="store_true", help="only the 'import lmcache_ascend' row")
    parser.add_argument("--before", type=Path, help="another checkout whose 'import lmcache_ascend' is timed alongside")
    parser.add_argument("--output", default=str(REPO_ROOT / "results" / "bench_overhead.json"))
    args = parser.parse_args()
    for name in ("alone_runs", "runs"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2 (a spread needs two runs), got {getattr(args, name)}")

    repos = {"this checkout": REPO_ROOT}
    if args.before is not None:
        repos[f"before: {args.before}"] = args.before.resolve()
    rows = measure_alone(args.alone_runs, repos)
    if not args.skip_vllm:
        targets = patch_targets()
        rows["import vllm + lmcache"] = measure("import vllm\nimport lmcache", args.runs)
        rows["import vllm + lmcache + patch targets"] = measure(
            "import importlib\nfor name in %r:\n    importlib.import_module(name)" % (targets,), args.runs
        )
    versions = {}
    for dist in ("vllm", "lmcache", "torch"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:
            versions[dist] = None
    print_table(rows, versions)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"versions": versions, "rows": rows}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
