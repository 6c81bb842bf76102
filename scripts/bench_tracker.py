#!/usr/bin/env python
"""Scheduler-side cost of LMCache's in-process connector per request-step.

Times ``LMCacheConnectorV1Impl.build_connector_meta`` (request tracker update +
ReqMeta / slot-mapping building) of the real LMCache adapter, over whole request
lives (chunked prefill, then decode), for:

- unpatched LMCache, single group (the baseline),
- patched (lmcache-adapter-multigroup), 1 group, 5 groups (DeepSeek-V4 on
  CUDA) and 11 groups (DeepSeek-V4 on vllm-ascend),

in one process, with the scheduler-side connector built as in the tests
(tests/multigroup/scheduler_driver.py). Prints a table and writes
results/bench_tracker.json. Decode steps are measured at two context lengths
to show that their cost does not grow with the number of blocks held.

Usage: python scripts/bench_tracker.py [--lives N] [--decode-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("LMCACHE_ASCEND_AUTOLOAD", "0")
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import lmcache_ascend  # noqa: E402

lmcache_ascend.deactivate()

from lmcache_ascend.patches import State, registry  # noqa: E402
from tests.fixtures.kv_cache_configs import (  # noqa: E402
    DSV4_ASCEND_STATE_GROUPS,
    dsv4_ascend_kv_cache_config,
    dsv4_cuda_kv_cache_config,
    single_group_kv_cache_config,
)
from tests.multigroup.scheduler_driver import RequestDriver, make_connector_impl  # noqa: E402

PATCH = "lmcache-adapter-multigroup"
CHUNK = 256


class BlockAllocator:
    """Hands out fresh block ids per group as a request grows (state groups: one block)."""

    def __init__(self, fixture) -> None:
        self.block_sizes = [g.kv_cache_spec.block_size for g in fixture.kv_cache_config.kv_cache_groups]
        self.state = {i for i, _ in DSV4_ASCEND_STATE_GROUPS} if fixture.name.startswith("dsv4-ascend") else set()
        self.held = [0] * len(self.block_sizes)
        self.next_id = 1

    def grow_to(self, num_tokens: int) -> tuple[list[int], ...]:
        new = []
        for group, size in enumerate(self.block_sizes):
            wanted = 1 if group in self.state else -(-num_tokens // size)
            count = max(0, wanted - self.held[group])
            new.append(list(range(self.next_id, self.next_id + count)))
            self.next_id += count
            self.held[group] += count
        return tuple(new)


def run_life(fixture, prompt_len: int, prefill_chunk: int, decode_steps: int, lifes: int):
    prefill_ns: list[int] = []
    decode_ns: list[int] = []
    for life in range(lifes):
        impl = make_connector_impl(fixture, chunk_size=CHUNK)
        original = impl.build_connector_meta
        sink = []

        def timed(scheduler_output, original=original, sink=sink):
            start = time.perf_counter_ns()
            result = original(scheduler_output)
            sink.append(time.perf_counter_ns() - start)
            return result

        impl.build_connector_meta = timed
        driver = RequestDriver(impl, f"req{life}", [(i * 31) % 30000 + 1 for i in range(prompt_len)])
        blocks = BlockAllocator(fixture)
        done = min(prefill_chunk, prompt_len)
        driver.start(done, blocks.grow_to(done))
        while done < prompt_len:
            step = min(prefill_chunk, prompt_len - done)
            done += step
            driver.advance(step, blocks.grow_to(done))
        prefill_ns.extend(sink)
        sink.clear()
        for i in range(decode_steps):
            done += 1
            driver.advance(1, blocks.grow_to(done), output_token=i + 1)
        decode_ns.extend(sink)
    return prefill_ns, decode_ns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lives", type=int, default=20)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    args = parser.parse_args()

    cases = [
        ("unpatched", single_group_kv_cache_config()),
        ("patched", single_group_kv_cache_config()),
        ("patched", dsv4_cuda_kv_cache_config()),
        ("patched", dsv4_ascend_kv_cache_config()),
    ]
    rows = []
    for mode, fixture in cases:
        if mode == "patched":
            assert registry.apply_now(PATCH) is State.APPLIED, registry.record(PATCH).reason
        else:
            registry.revert(PATCH)
        run_life(fixture, 512, 256, 4, 2)  # warm-up
        prefill, decode = run_life(fixture, args.prompt, args.prefill_chunk, args.decode_steps, args.lives)
        _, decode_long = run_life(fixture, args.prompt * 4, args.prompt, args.decode_steps, max(2, args.lives // 4))
        groups = len(fixture.kv_cache_config.kv_cache_groups)
        all_steps = prefill + decode
        rows.append(
            {
                "mode": mode,
                "fixture": fixture.name,
                "groups": groups,
                "prefill_step_us": statistics.median(prefill) / 1e3,
                "decode_step_us": statistics.median(decode) / 1e3,
                "decode_step_us_4x_context": statistics.median(decode_long) / 1e3,
                "mean_request_step_us": statistics.fmean(all_steps) / 1e3,
                "steps": len(all_steps),
            }
        )
        registry.revert(PATCH)

    base = rows[0]
    for row in rows:
        row["prefill_ratio_vs_unpatched"] = row["prefill_step_us"] / base["prefill_step_us"]
        row["decode_ratio_vs_unpatched"] = row["decode_step_us"] / base["decode_step_us"]
        row["mean_ratio_vs_unpatched"] = row["mean_request_step_us"] / base["mean_request_step_us"]

    header = (
        f"{'mode':<10} {'fixture':<15} {'groups':>6} {'prefill us':>11} {'decode us':>10} "
        f"{'decode@4x us':>13} {'mean us':>9} {'prefill x':>10} {'decode x':>9} {'mean x':>7}"
    )
    print(f"build_connector_meta per request-step; prompt {args.prompt} tokens in {args.prefill_chunk}-token "
          f"chunks, {args.decode_steps} decode steps, {args.lives} lives (medians; mean over all steps)")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['mode']:<10} {r['fixture']:<15} {r['groups']:>6} {r['prefill_step_us']:>11.1f} {r['decode_step_us']:>10.1f} "
            f"{r['decode_step_us_4x_context']:>13.1f} {r['mean_request_step_us']:>9.1f} {r['prefill_ratio_vs_unpatched']:>10.2f} "
            f"{r['decode_ratio_vs_unpatched']:>9.2f} {r['mean_ratio_vs_unpatched']:>7.2f}"
        )
    out = REPO_ROOT / "results" / "bench_tracker.json"
    out.parent.mkdir(exist_ok=True)
    from lmcache_ascend.compat.versions import installed_version as version

    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_tracker",
                "args": vars(args),
                "python": platform.python_version(),
                "vllm": version("vllm"),
                "lmcache": version("lmcache"),
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
