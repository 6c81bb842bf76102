"""The benchmark scripts that run without an accelerator run to the end on the CPU, with the fewest rounds.

What is measured is not checked here (no timings in tests): that each script still runs against the
package as it is, prints its table and writes its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "bench_slot_resolution.py": ["--device", "cpu", "--rounds", "2", "--tokens", "1024"],
    "bench_tracker.py": ["--rounds", "1", "--prompt", "512", "--prefill-chunk", "256", "--decode-steps", "2",
                         "--batch", "1,4"],
    "bench_transfer.py": ["--device", "cpu", "--tokens", "256", "--calls", "1", "--repeats", "1",
                          "--request-tokens", "1024", "--request-rounds", "1"],
    "bench_chunk_seal.py": ["--rounds", "3", "--sizes-mib", "0.1"],
    "bench_hole_blend.py": ["--seeds", "1", "--random-seeds", "1", "--documents", "6", "--holes", "1",
                            "--placements", "start", "--ratios", "0.3"],
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_benchmark_script_runs_on_the_cpu(script, tmp_path):
    if script == "bench_tracker.py":
        pytest.importorskip("lmcache.integration.vllm.vllm_v1_adapter", reason="times LMCache's own adapter")
    out = tmp_path / "result.json"
    env = dict(os.environ, LMCACHE_ASCEND_AUTOLOAD="0", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), *SCRIPTS[script], "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout
    assert json.loads(out.read_text())
