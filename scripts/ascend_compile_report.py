"""Table of the Ascend compile check: every recorded launch, per target, its stages and DMA counts.

Runs on stack ascend (scripts/test-env ascend), like tests/ascend, and compiles the same
launches (tests/ascend/launches.py) the same way (tests/ascend/_compile.py), then prints
kernel x launch key x target: the stages reached (TTIR, linalg, HIVM; hivmc, CANN's last
step, is not on any registry and is not run), the global->UB and UB->global DMA calls in
the HIVM module, the element-at-a-time data accesses (must be 0) and the scalar loads of
global memory (slot and table reads). Writes the rows as JSON too.

    .venvs/stack-ascend/bin/python scripts/ascend_compile_report.py [--a5-all] [--out results/ascend_compile.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a5-all", action="store_true", help="every launch on A5 too (default: the judge's A5 keys)")
    parser.add_argument("--out", default=str(REPO / "results" / "ascend_compile.json"))
    args = parser.parse_args()

    from tests.ascend import _compile

    missing = _compile.available()
    if missing is not None:
        print(f"ascend_compile_report: {missing}; build it with scripts/test-env ascend", file=sys.stderr)
        return 2
    from tests.ascend.launches import record_launches

    rows = []
    print(f"{'kernel':<22}{'launch key':<26}{'target':<16}{'stages':<18}{'gm->ub':>7}{'ub->gm':>7}{'elem':>6}{'scalar':>8}{'s':>7}")
    with tempfile.TemporaryDirectory(prefix="ascend-report-") as scratch:
        for launch in record_launches():
            for arch in (_compile.A2, _compile.A5):
                if arch == _compile.A5 and not args.a5_all and launch.name not in _compile.A5_KEYS:
                    continue
                work = Path(scratch) / f"{launch.name.replace(' ', '_')}-{arch}"
                work.mkdir()
                compiled = _compile.compile_kernel(launch.kernel, launch.arguments, launch.constexprs,
                                                   launch.num_warps, arch, work)
                row = {"kernel": compiled.kernel, "launch": launch.name, "target": arch, "stages": compiled.reached,
                       "error": compiled.error, "seconds": round(sum(compiled.seconds.values()), 1)}
                if compiled.reached == list(_compile.STAGES):
                    path = _compile.data_path(compiled.hivm, compiled.kernel, compiled.pointer_params, ("data_anchor",))
                    row.update(gm_to_ub=path.gm_to_ub, ub_to_gm=path.ub_to_gm,
                               element_accesses=len(path.scalar_data_accesses), scalar_gm_loads=path.scalar_gm_loads)
                rows.append(row)
                print(f"{row['kernel']:<22}{launch.name:<26}{arch:<16}{'/'.join(row['stages']) or '-':<18}"
                      f"{row.get('gm_to_ub', '-'):>7}{row.get('ub_to_gm', '-'):>7}{row.get('element_accesses', '-'):>6}"
                      f"{row.get('scalar_gm_loads', '-'):>8}{row['seconds']:>7}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")
    return 0 if all(row["stages"] == list(_compile.STAGES) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
