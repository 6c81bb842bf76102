#!/usr/bin/env python3
"""Prefix-cache hit rate of a DeepSeek-V4-like replay on vLLM's real KVCacheManager.

Runs the same workload in three fresh processes and prints one table:

  A unpatched   stack A (vLLM 0.18.1) as shipped
  A patched     stack A with the lmcache-ascend prefix-cache backports
  B native      stack B (vLLM 0.23.0), whose own code has the mechanisms

Workload (the seed's replay): 8K-token prompts with unaligned tails,
concurrency 32, repeat rate 0.9, chunked prefill, 16 output tokens, and a
KV cache far too small to hold every distinct prompt. No model runs: each
step allocates slots exactly as the scheduler would.

    scripts/bench_prefix_retention.py            # full run
    scripts/bench_prefix_retention.py --quick    # smoke test (seconds)

Writes results/bench_prefix_retention.json. The stacks' pythons are taken
from .venvs/stack-{a,b} (override with --python-a / --python-b).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = (
    ("A unpatched", "a", False),
    ("A patched", "a", True),
    ("B native", "b", False),
)


def _hybrid_and_workload(quick: bool, compressed_storage_block: int | None = None):
    from lmcache_ascend.prefix_cache.block_sizes import compressed_kv_block_size, prefix_block_size
    from tests.prefix_cache.harness import HybridModel, ReplayWorkload

    # MLA group (128-token blocks), sliding window 128 in 64-token blocks, and a
    # compressed group whose block covers 1024 prompt tokens (e.g. 8 rows x ratio 128).
    compressed_tokens = 1024
    if compressed_storage_block is not None:
        # DeepSeek-V4 on vllm-ascend: a compress-ratio-128 block of `storage`
        # rows covers storage x 128 prompt tokens (VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE).
        rows = compressed_kv_block_size(128, compressed_storage_block)
        compressed_tokens = prefix_block_size(_CompressedSpec(rows))
    hybrid = HybridModel(
        mla_block_size=128,
        sliding_window_block_size=64,
        sliding_window=128,
        compressed_block_tokens=compressed_tokens,
        num_blocks=1200 if quick else 2500,
    )
    workload = ReplayWorkload(
        num_requests=64 if quick else 384,
        distinct_prompts=16 if quick else 48,
        concurrency=32,
        repeat_rate=0.9,
        prompt_tokens=8192,
        prompt_jitter=255,
    )
    return hybrid, workload


class _CompressedSpec:
    """The two fields prefix_block_size reads from a DSv4 compressed spec."""

    compress_ratio = 128

    def __init__(self, storage_block_size: int):
        self.storage_block_size = self.block_size = storage_block_size


def worker(patched: bool, quick: bool, compressed_storage_block: int | None = None) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.prefix_cache.harness import CORE_BACKPORT_PATCHES

    states = {}
    if patched:
        from lmcache_ascend.patches import registry
        from tests.patching import apply_now

        states = {name: apply_now(registry.process_registry(), name).value for name in CORE_BACKPORT_PATCHES}
        not_applied = {name: state for name, state in states.items() if state != "applied"}
        if not_applied:
            raise SystemExit(f"patches did not apply: {not_applied}")
    import vllm

    from tests.prefix_cache.harness import hybrid_config, make_manager, run_replay

    hybrid, workload = _hybrid_and_workload(quick, compressed_storage_block)
    if not patched:
        from lmcache_ascend.patches import registry

        process = registry.process_registry()
        applied = [name for name in CORE_BACKPORT_PATCHES if process.state(name).value == "applied"]
        if applied:
            raise SystemExit(f"unpatched run has patches applied: {applied}")
    manager = make_manager(hybrid_config(hybrid), hybrid.scheduler_block_size, hybrid.hash_block_size)
    started = time.perf_counter()
    stats = run_replay(manager, workload, hybrid.hash_block_size)
    return {
        "vllm": vllm.__version__,
        "patches": states,
        "layout": asdict(hybrid),
        "workload": asdict(workload),
        "requests": stats.requests,
        "prompt_tokens": stats.prompt_tokens,
        "hit_tokens": stats.hit_tokens,
        "hit_rate": stats.hit_rate,
        "blocks_allocated": stats.blocks_allocated,
        "preemptions": stats.preemptions,
        "seconds": time.perf_counter() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small workload for a smoke test")
    parser.add_argument("--python-a", default=str(REPO / ".venvs/stack-a/bin/python"))
    parser.add_argument("--python-b", default=str(REPO / ".venvs/stack-b/bin/python"))
    parser.add_argument("--output", default=str(REPO / "results/bench_prefix_retention.json"))
    parser.add_argument("--worker", choices=("patched", "unpatched"), help=argparse.SUPPRESS)
    parser.add_argument("--compressed-storage-block", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(worker(args.worker == "patched", args.quick, args.compressed_storage_block)))
        return 0

    pythons = {"a": args.python_a, "b": args.python_b}
    for stack, python in pythons.items():
        if not Path(python).exists():
            print(f"bench_prefix_retention: no python for stack {stack} at {python} (run scripts/test-env {stack})")
            return 2
    env = dict(os.environ, LMCACHE_ASCEND_AUTOLOAD="0", PYTHONHASHSEED="0")
    env.pop("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", None)  # compare the defaults
    def run(label: str, stack: str, patched: bool, compressed_storage_block: int | None = None) -> dict | None:
        command = [pythons[stack], __file__, "--worker", "patched" if patched else "unpatched"]
        if args.quick:
            command.append("--quick")
        if compressed_storage_block is not None:
            command += ["--compressed-storage-block", str(compressed_storage_block)]
        # Importing lmcache_ascend activates every patch: the unpatched and the
        # native runs switch the overlay off; the patched run applies ours.
        variant_env = dict(env, LMCACHE_ASCEND_PATCHES="1" if patched else "0")
        done = subprocess.run(command, cwd=REPO, env=variant_env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{label}: worker failed\n{done.stderr[-3000:]}")
            return None
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["variant"] = label
        result["compressed_storage_block"] = compressed_storage_block
        return result

    rows = []
    for label, stack, patched in VARIANTS:
        result = run(label, stack, patched)
        if result is None:
            return 1
        rows.append(result)

    baseline = next(row for row in rows if row["variant"] == "B native")
    print(f"{'variant':<12} {'vLLM':<8} {'hit rate':>9} {'vs B (pt)':>10} {'blocks alloc':>13} {'vs B':>6} {'preempt':>8} {'s':>6}")
    for row in rows:
        points = (row["hit_rate"] - baseline["hit_rate"]) * 100
        ratio = row["blocks_allocated"] / baseline["blocks_allocated"] if baseline["blocks_allocated"] else float("nan")
        row["hit_rate_points_vs_b"] = points
        row["blocks_allocated_ratio_vs_b"] = ratio
        print(
            f"{row['variant']:<12} {row['vllm']:<8} {row['hit_rate'] * 100:>8.2f}% {points:>+10.2f} "
            f"{row['blocks_allocated']:>13} {ratio:>6.2f} {row['preemptions']:>8} {row['seconds']:>6.1f}"
        )
    # DeepSeek-V4 compressed block size (the vllm-ascend switch), same workload:
    # the compressed group's prefix block is storage rows x compress ratio 128.
    compressed_rows = []
    print()
    print(f"{'compressed rows':<16} {'tokens/block':>12} {'A patched':>10} {'B native':>10} {'A-B (pt)':>9}")
    for storage in (128, 32) if args.quick else (128, 64, 32):
        pair = [run(f"{label} / {storage} rows", stack, patched, storage) for label, stack, patched in VARIANTS[1:]]
        if None in pair:
            return 1
        patched_a, native_b = pair
        compressed_rows += pair
        print(
            f"{storage:<16} {patched_a['hybrid']['compressed_block_tokens']:>12} {patched_a['hit_rate'] * 100:>9.2f}% "
            f"{native_b['hit_rate'] * 100:>9.2f}% {(patched_a['hit_rate'] - native_b['hit_rate']) * 100:>+9.2f}"
        )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"quick": args.quick, "rows": rows, "compressed_block_rows": compressed_rows}, indent=2))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
