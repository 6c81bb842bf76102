#!/usr/bin/env python
"""What lmcache-ascend costs at import time, measured in fresh processes.

    .venvs/stack-b/bin/python scripts/bench_overhead.py [--runs 10]

Three measurements over --runs fresh interpreters each, the variants interleaved
run by run so that machine noise hits them alike; median and minimum are both
reported (the minimum is the noise-free estimate: noise only adds time):

1. ``import lmcache_ascend`` alone (activation included: flags validated, every
   patch declaration loaded, post-import hooks registered), beside the standard
   library modules it needs (which vLLM imports anyway). Target <= 20 ms.
2. ``import vllm; import lmcache`` without the overlay, and with it active through
   the wheel's .pth start-up hook (the way users get it). Target <= 2 % added.
3. The same plus the patch targets themselves (so every patch is really applied),
   without and with the overlay.

Times are taken inside the child around the imports (interpreter start-up is
the same for both and left out). Prints a table and writes results/bench_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

TIMED = """
import time, sys
start = time.perf_counter()
{imports}
elapsed = time.perf_counter() - start
applied = 0
if 'lmcache_ascend' in sys.modules:
    from lmcache_ascend.patches import registry
    applied = sum(r.state.value == 'applied' for r in registry.process_registry().records())
print(f'ELAPSED={{elapsed}} APPLIED={{applied}}')
"""


def patch_targets() -> list[str]:
    sys.path.insert(0, str(REPO_ROOT))
    from lmcache_ascend.compat.versions import installed_version
    from lmcache_ascend.patches.registry import load_declared_patches

    patches, _ = load_declared_patches()
    return sorted({p.target for p in patches if all(installed_version(d) for d in p.requires)})


def run_child(imports: str, overlay: bool) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_ASCEND_")}
    env.update(
        PYTHONPATH=str(REPO_ROOT),
        LMCACHE_ASCEND_AUTOLOAD="1" if overlay else "0",
        LMCACHE_LOG_LEVEL="WARNING",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    result = subprocess.run(
        [sys.executable, "-c", TIMED.format(imports=imports)], env=env, capture_output=True, text=True, cwd=REPO_ROOT
    )
    line = next((l for l in result.stdout.splitlines() if l.startswith("ELAPSED=")), None)
    if result.returncode != 0 or line is None:
        raise SystemExit(f"child failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    elapsed, applied = line.split()
    return float(elapsed.split("=")[1]), int(applied.split("=")[1])


# The standard-library modules lmcache_ascend needs (vLLM imports them too): the
# baseline of the "alone" row, so that the package's own share shows.
STDLIB_NEEDED = "import dataclasses, enum, functools, inspect, threading, typing"


def summarize(baseline: list[float], overlay: list[float], applied: int | None) -> dict[str, object]:
    """Median and minimum of each side; the minimum is the noise-free estimate
    (scheduling noise only ever adds time to an import)."""
    row: dict[str, object] = {"runs": len(baseline)}
    for label, pick in (("median", statistics.median), ("min", min)):
        base_ms, with_ms = pick(baseline) * 1e3, pick(overlay) * 1e3
        row[f"baseline_ms_{label}"] = round(base_ms, 2)
        row[f"with_overlay_ms_{label}"] = round(with_ms, 2)
        row[f"added_ms_{label}"] = round(with_ms - base_ms, 2)
        row[f"added_ratio_{label}"] = round((with_ms - base_ms) / base_ms, 4)
    if applied is not None:
        row["patches_applied"] = applied
    return row


def measure(imports: str, runs: int) -> dict[str, object]:
    baseline, overlay, applied = [], [], 0
    for _ in range(runs):
        baseline.append(run_child(imports, overlay=False)[0])
        seconds, applied = run_child(imports, overlay=True)
        overlay.append(seconds)
    return summarize(baseline, overlay, applied)


def measure_alone(runs: int) -> dict[str, object]:
    stdlib, package = [], []
    for _ in range(runs):
        stdlib.append(run_child(STDLIB_NEEDED, overlay=False)[0])
        package.append(run_child("import lmcache_ascend", overlay=False)[0])
    return summarize(stdlib, package, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--output", default=str(REPO_ROOT / "results" / "bench_overhead.json"))
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")

    targets = patch_targets()
    rows = {
        "import lmcache_ascend (vs its stdlib)": measure_alone(args.runs),
        "import vllm + lmcache": measure("import vllm\nimport lmcache", args.runs),
        "import vllm + lmcache + patch targets": measure(
            "import importlib\nfor name in %r:\n    importlib.import_module(name)" % (targets,), args.runs
        ),
    }
    versions = {}
    for dist in ("vllm", "lmcache", "torch"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:
            versions[dist] = None

    print(f"import overhead, {args.runs} fresh processes per cell ({', '.join(f'{k} {v}' for k, v in versions.items())})")
    print(f"{'measurement':<40} {'stat':>6} {'baseline ms':>12} {'overlay ms':>12} {'added ms':>10} {'added':>8} {'applied':>8}")
    for label, row in rows.items():
        for stat in ("median", "min"):
            print(
                f"{label if stat == 'median' else '':<40} {stat:>6} {row[f'baseline_ms_{stat}']:>12} "
                f"{row[f'with_overlay_ms_{stat}']:>12} {row[f'added_ms_{stat}']:>10} "
                f"{row[f'added_ratio_{stat}']:>8.2%} {row.get('patches_applied', '-'):>8}"
            )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"versions": versions, "targets": targets, "rows": rows}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
