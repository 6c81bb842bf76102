#!/usr/bin/env python
"""Scheduler-side cost of LMCache's in-process connector, on equal work.

Times ``LMCacheConnectorV1Impl.build_connector_meta`` (request tracker update
plus ReqMeta building; multi-group: the step's block ids per group, which the
workers resolve to slots on their device) of the real LMCache adapter, and the
pickling of the metadata it returns (vLLM pickles it to the workers), for one
request stream that every case processes alike: the same prompt tokens,
scheduled in the same chunked-prefill steps, then the same decode steps. The
cases differ only in how the model's KV cache is split into groups:

- ``upstream 1 group``: unpatched LMCache, one full-attention group (the
  baseline: what LMCache costs today for these tokens);
- ``ours 1 group``: the same model with ``lmcache-adapter-multigroup``
  applied (single-group models take upstream's path; this is the price of
  the wrapper);
- ``ours 5 groups``: the same tokens split into DeepSeek-V4's 5 CUDA groups
  (block sizes 256/64/64/4/8, one sliding window);
- ``ours 11 groups``: the same tokens in vllm-ascend's 11 DeepSeek-V4 groups
  (the six compressor-state groups moved, as by default; one sliding window).

Upstream cannot run the multi-group cases (it keeps ``block_ids[0]`` and
would build wrong slots), so its single-group cost on the same tokens is the
reference. Each case owns one long-lived connector (its layout computed
before timing, as at connector start); rounds interleave the cases in a
rotating order, the patch applied or reverted between cases outside the timed
region.

A server decodes many requests per step, so the decode step is also timed
with ``--batch`` N requests decoding together: each is prefilled on its own
(untimed), then every decode step schedules all N in one scheduler output
(built before the timed call, as every step's is; the prefill's garbage is collected before the
first timed step). Request k's prompt is
``k % 64`` tokens shorter, so a step mixes requests that get a new block in
some group with requests that get none, as a server's steps do. The step's
time divided by N is the per-request decode cost: what the step-level work
(the wrapper's setup, upstream's loop prologue) adds per request shrinks as N
grows, what is paid per request does not.

Prints two tables (medians with interquartile range; ratios are medians of
per-round ratios against the baseline of the same round and batch) and writes
JSON under results/.

Usage: python scripts/bench_tracker.py [--rounds N] [--prompt T] [--prefill-chunk T] [--decode-steps N] [--batch N,N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("LMCACHE_ASCEND_AUTOLOAD", "0")
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import lmcache_ascend  # noqa: E402

lmcache_ascend.deactivate()

from lmcache_ascend.compat.versions import installed_version  # noqa: E402
from lmcache_ascend.patches import State, registry  # noqa: E402
from tests.fixtures.kv_cache_configs import (  # noqa: E402
    KVCacheFixture,
    dsv4_ascend_kv_cache_config,
    dsv4_cuda_kv_cache_config,
    single_group_kv_cache_config,
)
from tests.multigroup.scheduler_driver import RequestDriver, make_connector_impl, step_together  # noqa: E402
from tests.patching import apply_now  # noqa: E402

REGISTRY = registry.process_registry()
PATCH = "lmcache-adapter-multigroup"
LMCACHE_CHUNK = 256
# Request k of a batch has a prompt k % BATCH_STAGGER tokens shorter: block boundaries of
# every group up to 64 tokens fall on different steps for different requests.
BATCH_STAGGER = 64
# Block ids of a batch's requests do not overlap: request k's start at 1 + k * BLOCK_ID_STRIDE.
BLOCK_ID_STRIDE = 1 << 20
DECODE_METRICS = ("decode_us_per_request", "decode_us_per_request_long_context")
METRICS = (
    "prefill_step_us",
    "decode_step_us",
    "decode_step_us_long_context",
    "request_us",
    "prefill_pickle_us",
    "prefill_meta_kib",
)


class BlockAllocator:
    """Hands out fresh block ids per group as a request grows (every group, the moved state groups too)."""

    def __init__(self, fixture: KVCacheFixture, first_id: int = 1) -> None:
        self.block_sizes = [g.kv_cache_spec.block_size for g in fixture.kv_cache_config.kv_cache_groups]
        self.held = [0] * len(self.block_sizes)
        self.next_id = first_id

    def grow_to(self, num_tokens: int) -> tuple[list[int], ...] | None:
        """The blocks `num_tokens` tokens need beyond those handed out, as vLLM's scheduler ships
        a running request's new blocks: one list per group, or None when no group gets one."""
        new = []
        for group, size in enumerate(self.block_sizes):
            wanted = -(-num_tokens // size)
            count = max(0, wanted - self.held[group])
            new.append(list(range(self.next_id, self.next_id + count)))
            self.next_id += count
            self.held[group] += count
        return tuple(new) if any(new) else None


@dataclass
class Case:
    label: str
    patched: bool
    fixture: KVCacheFixture
    impl: object = None
    # One value per round (us): the mean prefill step of the request, the
    # median decode step, the median decode step after the long prompt, and
    # the sum of all the request's steps.
    per_round: dict[str, list[float]] = field(default_factory=lambda: {key: [] for key in METRICS})
    # batch N -> DECODE_METRICS -> one value per round (us per request: the median decode step / N).
    decode_per_round: dict[int, dict[str, list[float]]] = field(default_factory=dict)

    @property
    def groups(self) -> int:
        return len(self.fixture.kv_cache_config.kv_cache_groups)


def set_patch(patched: bool) -> None:
    """Upstream (the patch reverted) or the patch applied."""
    if patched:
        state = apply_now(REGISTRY, PATCH)
        if state is not State.APPLIED:
            raise SystemExit(f"{PATCH} did not apply: {state} ({REGISTRY.record(PATCH).reason})")
    else:
        state = REGISTRY.revert(PATCH)
        if state in (State.APPLIED, State.OVERRIDDEN):
            raise SystemExit(f"{PATCH} could not be reverted for the upstream case: {state}")


def run_request(case: Case, req_id: str, prompt: list[int], prefill_chunk: int, decode_steps: int):
    """One request's life on `case`'s connector.

    Returns (prefill step ns, decode step ns, per prefill step (pickle ns, pickled bytes)).
    The metadata goes to the workers pickled (vLLM's shared-memory broadcast
    uses pickle), so its serialization is timed too, apart from the step.
    """
    impl = case.impl
    original = impl.build_connector_meta
    times: list[int] = []
    pickled: list[tuple[int, int]] = []

    def timed(scheduler_output):
        start = time.perf_counter_ns()
        result = original(scheduler_output)
        times.append(time.perf_counter_ns() - start)
        start = time.perf_counter_ns()
        size = len(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        pickled.append((time.perf_counter_ns() - start, size))
        return result

    impl.build_connector_meta = timed
    try:
        driver = RequestDriver(impl, req_id, prompt)
        blocks = BlockAllocator(case.fixture)
        done = prefill(driver, blocks, prompt, prefill_chunk)
        num_prefill = len(times)
        for i in range(decode_steps):
            done += 1
            driver.advance(1, blocks.grow_to(done), output_token=i + 1)
    finally:
        del impl.build_connector_meta  # back to the class attribute
    driver.finish()  # untimed: drops the request's tracker
    return times[:num_prefill], times[num_prefill:], pickled[:num_prefill]


def prefill(driver: RequestDriver, blocks: BlockAllocator, prompt: list[int], prefill_chunk: int) -> int:
    """Schedule `prompt` in chunked-prefill steps of `prefill_chunk` tokens; returns the tokens scheduled."""
    done = min(prefill_chunk, len(prompt))
    driver.start(done, blocks.grow_to(done))
    while done < len(prompt):
        step = min(prefill_chunk, len(prompt) - done)
        done += step
        driver.advance(step, blocks.grow_to(done))
    return done


def run_batch(case: Case, req_id: str, prompts: list[list[int]], prefill_chunk: int, decode_steps: int) -> list[int]:
    """`len(prompts)` requests on `case`'s connector, decoding together.

    Each request is prefilled in its own steps (untimed), then every decode step schedules all
    of them in one scheduler output; returns the decode steps' ns.
    """
    impl = case.impl
    original = impl.build_connector_meta
    times: list[int] = []

    def timed(scheduler_output):
        start = time.perf_counter_ns()
        result = original(scheduler_output)
        times.append(time.perf_counter_ns() - start)
        return result

    drivers = [RequestDriver(impl, f"{req_id}-{k}", prompt) for k, prompt in enumerate(prompts)]
    allocators = [BlockAllocator(case.fixture, first_id=1 + k * BLOCK_ID_STRIDE) for k in range(len(prompts))]
    done = [prefill(driver, blocks, prompt, prefill_chunk) for driver, blocks, prompt in zip(drivers, allocators, prompts)]
    # The caller keeps the collector off through the timed steps; what the untimed prefill of N
    # requests left behind is collected first, so that every case's decode steps start from a clean
    # heap: left there, it slowed the steps of the cases that leave more of it (more groups) and
    # widened their spread (docs/design-decisions.md, section 3).
    gc.collect()
    impl.build_connector_meta = timed
    try:
        for i in range(decode_steps):
            parts = []
            for k, (driver, blocks) in enumerate(zip(drivers, allocators)):
                done[k] += 1
                parts.append(driver.running(1, blocks.grow_to(done[k]), output_token=i + 1))
            step_together(impl, parts)
    finally:
        del impl.build_connector_meta  # back to the class attribute
    for driver in drivers:
        driver.finish()  # untimed: drops the requests' trackers
    return times


def batch_prompts(length: int, round_index: int, batch: int) -> list[list[int]]:
    """The prompts of a batch's requests: request k's is k % BATCH_STAGGER tokens shorter (at least 1)."""
    return [prompt_tokens(max(1, length - k % BATCH_STAGGER), round_index * 1_000_003 + k) for k in range(batch)]


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated request counts, e.g. 1,64")
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every batch must be >= 1")
    return sizes


def prompt_tokens(length: int, round_index: int) -> list[int]:
    return [(i * 31 + round_index * 7919) % 30000 + 1 for i in range(length)]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs visible"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="requests per case (interleaved)")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per chunked-prefill step")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--long-context", type=int, default=2, help="decode also after a prompt this many times longer")
    parser.add_argument(
        "--batch",
        type=batch_sizes,
        default=[1, 64],
        help="requests decoding together in one scheduler step, comma-separated (1: the request of the first table)",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "bench_tracker.json"))
    args = parser.parse_args()
    for name in ("rounds", "prompt", "prefill_chunk", "long_context"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}; allowed: >= 1")

    cases = [
        Case("upstream 1 group", False, single_group_kv_cache_config()),
        Case("ours 1 group", True, single_group_kv_cache_config()),
        Case("ours 5 groups", True, dsv4_cuda_kv_cache_config()),
        Case("ours 11 groups", True, dsv4_ascend_kv_cache_config()),
    ]
    import lmcache.integration.vllm.vllm_v1_adapter  # noqa: F401  (the target, imported before any case)

    def enter(case: Case) -> None:
        set_patch(case.patched)

    warm_prompt = prompt_tokens(2 * LMCACHE_CHUNK, -1)
    batches = [n for n in args.batch if n > 1]  # batch 1 is the first table's request
    for case in cases:  # build each connector and its layout, warm the code paths
        enter(case)
        case.impl = make_connector_impl(case.fixture, chunk_size=LMCACHE_CHUNK)
        for i in range(3):
            run_request(case, f"warm{i}", warm_prompt, LMCACHE_CHUNK, 4)
        for batch in batches:
            run_batch(case, "warm-batch", batch_prompts(len(warm_prompt), -1, batch), LMCACHE_CHUNK, 4)
        case.decode_per_round = {batch: {key: [] for key in DECODE_METRICS} for batch in args.batch}
    set_patch(False)

    long_prompt_len = args.prompt * args.long_context
    started = time.perf_counter()
    for round_index in range(args.rounds):
        prompt = prompt_tokens(args.prompt, round_index)
        long_prompt = prompt_tokens(long_prompt_len, round_index)
        shift = round_index % len(cases)
        for case in cases[shift:] + cases[:shift]:
            enter(case)
            gc.collect()
            gc.disable()
            try:
                prefill, decode, pickled = run_request(
                    case, f"r{round_index}", prompt, args.prefill_chunk, args.decode_steps
                )
                _, long_decode, _ = run_request(case, f"l{round_index}", long_prompt, long_prompt_len, args.decode_steps)
            finally:
                gc.enable()
            values = (  # in the units of METRICS: us, us, us, us, us, KiB
                statistics.fmean(prefill) / 1e3,
                statistics.median(decode) / 1e3 if decode else float("nan"),
                statistics.median(long_decode) / 1e3 if long_decode else float("nan"),
                (sum(prefill) + sum(decode)) / 1e3,
                statistics.fmean(ns for ns, _ in pickled) / 1e3,
                statistics.fmean(size for _, size in pickled) / 1024,
            )
            for key, value in zip(METRICS, values):
                case.per_round[key].append(value)
            if 1 in case.decode_per_round:
                for key, value in zip(DECODE_METRICS, values[1:3]):
                    case.decode_per_round[1][key].append(value)
        for batch in batches:
            prompts = batch_prompts(args.prompt, round_index, batch)
            long_prompts = batch_prompts(long_prompt_len, round_index, batch)
            for case in cases[shift:] + cases[:shift]:
                enter(case)
                gc.collect()
                gc.disable()
                try:
                    decode = run_batch(case, f"b{round_index}", prompts, args.prefill_chunk, args.decode_steps)
                    long_decode = run_batch(case, f"bl{round_index}", long_prompts, long_prompt_len, args.decode_steps)
                finally:
                    gc.enable()
                for key, steps in zip(DECODE_METRICS, (decode, long_decode)):
                    value = statistics.median(steps) / 1e3 / batch if steps else float("nan")
                    case.decode_per_round[batch][key].append(value)
    set_patch(False)
    elapsed = time.perf_counter() - started

    base = cases[0]
    rows = []
    for case in cases:
        row = {
            "case": case.label,
            "fixture": case.fixture.name,
            "groups": case.groups,
            "patched": case.patched,
        }
        for key in METRICS:
            values = case.per_round[key]
            q1, q2, q3 = quartiles(values)
            row[key] = {"median": q2, "q1": q1, "q3": q3, "min": min(values), "max": max(values), "n": len(values)}
        for key, metric in (("prefill_ratio", "prefill_step_us"), ("request_ratio", "request_us")):
            q1, q2, q3 = quartiles([c / b for c, b in zip(case.per_round[metric], base.per_round[metric])])
            row[key] = {"median": q2, "q1": q1, "q3": q3}
        rows.append(row)
    decode_rows = []
    for batch in args.batch:
        for case in cases:
            row = {"case": case.label, "groups": case.groups, "batch": batch}
            values = case.decode_per_round[batch]
            for key in DECODE_METRICS:
                q1, q2, q3 = quartiles(values[key])
                row[key] = {"median": q2, "q1": q1, "q3": q3, "n": len(values[key])}
                baseline = base.decode_per_round[batch][key]
                q1, q2, q3 = quartiles([c / b for c, b in zip(values[key], baseline)])
                row[key.replace("us_per_request", "ratio")] = {"median": q2, "q1": q1, "q3": q3}
            decode_rows.append(row)

    print(
        f"build_connector_meta per step, equal work: a {args.prompt}-token prompt in {args.prefill_chunk}-token "
        f"prefill steps, then {args.decode_steps} decode steps (also after a {long_prompt_len}-token prompt); "
        f"LMCache chunk {LMCACHE_CHUNK}; {args.rounds} rounds, cases interleaved"
    )
    print(f"machine: {machine()}; python {platform.python_version()}, vllm {installed_version('vllm')}, "
          f"lmcache {installed_version('lmcache')}")
    print("per round: mean prefill step, median decode step, request = sum of its steps; pickle / KiB: "
          "pickling the metadata of a prefill step (mean per round); us: median over rounds [q1-q3]; "
          "x: median of per-round ratios to upstream 1 group [q1-q3]")
    header = (
        f"{'case':<17} {'groups':>6} | {'prefill step us':>22} | {'decode step us':>18} | "
        f"{'decode@long us':>18} | {'request us':>22} | {'prefill x':>17} | {'request x':>17} | "
        f"{'pickle us':>20} | {'KiB':>6}"
    )
    print(header)
    print("-" * len(header))

    def spread(entry, digits=1, width=0):
        text = f"{entry['median']:.{digits}f} [{entry['q1']:.{digits}f}-{entry['q3']:.{digits}f}]"
        return text.rjust(width)

    for row in rows:
        print(
            f"{row['case']:<17} {row['groups']:>6} | {spread(row['prefill_step_us'], 1, 22)} | "
            f"{spread(row['decode_step_us'], 1, 18)} | {spread(row['decode_step_us_long_context'], 1, 18)} | "
            f"{spread(row['request_us'], 0, 22)} | {spread(row['prefill_ratio'], 2, 17)} | "
            f"{spread(row['request_ratio'], 2, 17)} | {spread(row['prefill_pickle_us'], 1, 20)} | "
            f"{row['prefill_meta_kib']['median']:>6.1f}"
        )
    target = 1.5
    worst = max(row["prefill_ratio"]["median"] for row in rows if row["groups"] > 1)
    verdict = "met" if worst <= target else "MISSED"
    print(f"target: multi-group prefill step <= {target}x upstream's single-group cost: {verdict} (worst {worst:.2f}x)")

    print()
    print(
        f"decode per request, N requests decoding together (one scheduler output per step; request k's prompt "
        f"k % {BATCH_STAGGER} tokens shorter): us = median decode step / N, median over rounds [q1-q3]; "
        "x: median of per-round ratios to upstream 1 group at the same N [q1-q3]"
    )
    header = (
        f"{'case':<17} {'groups':>6} {'batch':>5} | {'decode us/req':>18} | {'decode@long us/req':>18} | "
        f"{'decode x':>17} | {'decode@long x':>17}"
    )
    print(header)
    print("-" * len(header))
    for row in decode_rows:
        print(
            f"{row['case']:<17} {row['groups']:>6} {row['batch']:>5} | {spread(row['decode_us_per_request'], 2, 18)} | "
            f"{spread(row['decode_us_per_request_long_context'], 2, 18)} | {spread(row['decode_ratio'], 2, 17)} | "
            f"{spread(row['decode_ratio_long_context'], 2, 17)}"
        )
    decode_target = 1.2
    worst_decode = {
        batch: max(row["decode_ratio"]["median"] for row in decode_rows if row["groups"] > 1 and row["batch"] == batch)
        for batch in args.batch
    }
    print(
        f"target: multi-group decode step per request <= {decode_target}x upstream's single-group at the same batch: "
        + ", ".join(
            f"batch {batch} {'met' if ratio <= decode_target else 'MISSED'} (worst {ratio:.2f}x)"
            for batch, ratio in worst_decode.items()
        )
        + f"; {elapsed:.1f}s"
    )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_tracker",
                "what": "LMCacheConnectorV1Impl.build_connector_meta per step, same request stream in every case",
                "args": vars(args),
                "lmcache_chunk_size": LMCACHE_CHUNK,
                "machine": machine(),
                "python": platform.python_version(),
                "vllm": installed_version("vllm"),
                "lmcache": installed_version("lmcache"),
                "rows": rows,
                "target_prefill_ratio": target,
                "worst_multi_group_prefill_ratio": worst,
                "decode_batch_stagger_tokens": BATCH_STAGGER,
                "decode_rows": decode_rows,
                "target_decode_ratio": decode_target,
                "worst_multi_group_decode_ratio": {str(batch): ratio for batch, ratio in worst_decode.items()},
                "seconds": elapsed,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
