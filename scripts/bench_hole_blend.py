#!/usr/bin/env python3
"""Hole-mode vs standard CacheBlend vs random recomputation, at EQUAL recompute budget.

On the tiny deterministic RoPE transformer (``tests/blend/reference``), for
RAG prompts of 6-10 documents with 1, 2 or 3 missing documents ("holes") at
the start / middle / end, every mode recomputes exactly the same number of
tokens from the check layer on: what standard CacheBlend spends at recompute
ratio 0.15 / 0.3 / 0.5 (every token from its first miss on, separators, and
the top-k share of its cached prefix). With that budget

- ``standard``: LMCache's CacheBlend (blend the leading cached run, prefill
  from the first miss on);
- ``hole``: hole mode: recompute every token without cached KV, spend the
  rest on the cached tokens whose K deviates most, split over the stretches
  of cached documents in proportion to their size;
- ``random``: hole mode's structure, but the cached tokens drawn uniformly at
  random (several seeds: the spread says how much choosing by K deviation is
  worth).

Per row (holes, placement, budget) it reports the error against full prefill
of the prompt's KV cache (all layers, K and V), of the question's final hidden
states and the KL divergence of the next-token distribution, each averaged
over the row's prompts (random: median over seeds of that average, with the
min-max over seeds), and in how many prompts hole mode's KV error is below
standard's. A row where hole and standard mode recompute the same tokens in
every prompt (holes at the end: nothing cached follows the first miss, so the
two are the same algorithm) is equal by construction and left out; the table
says how many were dropped.

    python scripts/bench_hole_blend.py [--seeds 3] [--random-seeds 5] [--out results/bench_hole_blend.json]

Prints a table and writes JSON (rows plus the configuration).
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

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("LMCACHE_ASCEND_AUTOLOAD", "0")

import torch  # noqa: E402

from tests.blend.reference.model import TinyModelConfig, TinyRopeTransformer  # noqa: E402
from tests.blend.reference.scenarios import (  # noqa: E402
    ScenarioSpec,
    build_scenario,
    run_at_budget,
    run_mode,
    standard_budget,
)

METRICS = ("kv_relative_error", "question_hidden_relative_error", "last_token_kl")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="prompts per (documents, holes, placement)")
    parser.add_argument("--random-seeds", type=int, default=5, help="draws of the random baseline per prompt")
    parser.add_argument("--documents", type=int, nargs="+", default=[6, 8, 10])
    parser.add_argument("--holes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--placements", nargs="+", default=["start", "middle", "end"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3, 0.5],
                        help="standard CacheBlend's recompute ratio; it sets every mode's budget")
    parser.add_argument("--check-layer", type=int, default=1)
    parser.add_argument("--out", default=str(REPO_ROOT / "results" / "bench_hole_blend.json"))
    args = parser.parse_args()
    for name in ("seeds", "random_seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}; allowed: >= 1")
    for ratio in args.ratios:
        if not 0.0 < ratio <= 1.0:
            parser.error(f"--ratios contains {ratio}; allowed: in (0, 1]")
    return args


def metrics_of(result) -> dict[str, float]:
    return {metric: getattr(result, metric) for metric in METRICS}


def spread_over_seeds(per_prompt: list[dict], key: str, metric: str, seeds: int) -> dict[str, float]:
    """Median and min-max over the random seeds of the mean over prompts."""
    by_seed = [statistics.fmean(p[key][s][metric] for p in per_prompt) for s in range(seeds)]
    return {"median": statistics.median(by_seed), "min": min(by_seed), "max": max(by_seed)}


def ratio_text(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}" if denominator > 0 else "-"


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    config = TinyModelConfig()
    model = TinyRopeTransformer(config)
    started = time.perf_counter()
    rows = []
    dropped = []
    for num_holes in args.holes:
        for placement in args.placements:
            prompts = []
            for num_documents in args.documents:
                for seed in range(args.seeds):
                    scenario = build_scenario(model, ScenarioSpec(num_documents, num_holes, placement, seed=seed))
                    prompts.append((scenario, model.prefill(scenario.tokens)))
            for ratio in args.ratios:
                per_prompt = []
                for scenario, truth in prompts:
                    budget = standard_budget(scenario, ratio)
                    standard = run_at_budget(model, scenario, "standard", budget, args.check_layer, truth)
                    hole = run_at_budget(model, scenario, "hole", budget, args.check_layer, truth)
                    randoms = [
                        metrics_of(run_at_budget(model, scenario, "random", budget, args.check_layer, truth, seed=s))
                        for s in range(args.random_seeds)
                    ]
                    shipped_hole = run_mode(model, scenario, "hole", ratio, args.check_layer, truth)
                    shipped_budget = int(shipped_hole.outcome.recomputed.numel())
                    randoms_at_shipped = [
                        metrics_of(
                            run_at_budget(model, scenario, "random", shipped_budget, args.check_layer, truth, seed=s)
                        )
                        for s in range(args.random_seeds)
                    ]
                    count = scenario.tokens.shape[0]
                    per_prompt.append(
                        {
                            "tokens": count,
                            "budget_fraction": budget / count,
                            "uncached_fraction_hole_mode": 1 - scenario.lookup.num_cached_tokens / count,
                            "same_tokens": torch.equal(standard.outcome.recomputed, hole.outcome.recomputed),
                            "standard": metrics_of(standard),
                            "hole": metrics_of(hole),
                            "random": randoms,
                            "shipped_hole": {**metrics_of(shipped_hole), "budget_fraction": shipped_budget / count},
                            "random_at_shipped": randoms_at_shipped,
                        }
                    )
                key = {"holes": num_holes, "placement": placement, "ratio": ratio}
                if all(p["same_tokens"] for p in per_prompt):
                    dropped.append(key)
                    continue
                row = dict(key, prompts=len(per_prompt))
                row["mean_tokens"] = statistics.fmean(p["tokens"] for p in per_prompt)
                row["budget_fraction"] = statistics.fmean(p["budget_fraction"] for p in per_prompt)
                row["uncached_fraction_hole_mode"] = statistics.fmean(p["uncached_fraction_hole_mode"] for p in per_prompt)
                for metric in METRICS:
                    row[f"standard.{metric}"] = statistics.fmean(p["standard"][metric] for p in per_prompt)
                    row[f"hole.{metric}"] = statistics.fmean(p["hole"][metric] for p in per_prompt)
                    row[f"random.{metric}"] = spread_over_seeds(per_prompt, "random", metric, args.random_seeds)
                    row[f"shipped_hole.{metric}"] = statistics.fmean(p["shipped_hole"][metric] for p in per_prompt)
                    row[f"random_at_shipped.{metric}"] = spread_over_seeds(
                        per_prompt, "random_at_shipped", metric, args.random_seeds
                    )
                row["shipped_hole.budget_fraction"] = statistics.fmean(p["shipped_hole"]["budget_fraction"] for p in per_prompt)
                row["shipped_hole_kv_below_random_median"] = sum(
                    p["shipped_hole"]["kv_relative_error"]
                    < statistics.median(r["kv_relative_error"] for r in p["random_at_shipped"])
                    for p in per_prompt
                )
                row["hole_kv_below_standard"] = sum(
                    p["hole"]["kv_relative_error"] < p["standard"]["kv_relative_error"] for p in per_prompt
                )
                row["hole_kv_below_random_median"] = sum(
                    p["hole"]["kv_relative_error"] < statistics.median(r["kv_relative_error"] for r in p["random"])
                    for p in per_prompt
                )
                rows.append(row)
    elapsed = time.perf_counter() - started

    print(
        f"A. equal recompute budget = what standard CacheBlend recomputes at the ratio; check layer "
        f"{args.check_layer}; {len(args.documents) * args.seeds} prompts per row; errors relative to full "
        f"prefill, means over prompts; random: median [min-max] over {args.random_seeds} seeds"
    )
    header = (
        f"{'holes':>5} {'where':>6} {'ratio':>5} {'budget':>6} | "
        f"{'KV err std / hole / random':>36} {'h/s':>5} {'h<s':>5} {'h/r':>5} {'h<r':>5} | "
        f"{'question err std / hole / random':>36} | {'KL std / hole / random':>36}"
    )
    print(header)
    print("-" * len(header))

    def triple(row: dict, metric: str, digits: int) -> str:
        rand = row[f"random.{metric}"]
        return (
            f"{row[f'standard.{metric}']:.{digits}f} / {row[f'hole.{metric}']:.{digits}f} / "
            f"{rand['median']:.{digits}f} [{rand['min']:.{digits}f}-{rand['max']:.{digits}f}]"
        ).rjust(36)

    for row in rows:
        kv_hole = row["hole.kv_relative_error"]
        print(
            f"{row['holes']:>5} {row['placement']:>6} {row['ratio']:>5.2f} {row['budget_fraction']:>6.3f} | "
            f"{triple(row, 'kv_relative_error', 3)} {ratio_text(kv_hole, row['standard.kv_relative_error']):>5} "
            f"{row['hole_kv_below_standard']:>2}/{row['prompts']:<2} "
            f"{ratio_text(kv_hole, row['random.kv_relative_error']['median']):>5} "
            f"{row['hole_kv_below_random_median']:>2}/{row['prompts']:<2} | "
            f"{triple(row, 'question_hidden_relative_error', 3)} | {triple(row, 'last_token_kl', 4)}"
        )
    print(
        f"dropped as equal by construction (hole and standard recompute the same tokens in every prompt): "
        f"{len(dropped)} rows ({', '.join(sorted({d['placement'] for d in dropped})) or 'none'})"
    )

    print(
        f"\nB. hole mode as shipped (ratio rule) vs random at hole mode's own budget, same rows"
    )
    header = (
        f"{'holes':>5} {'where':>6} {'ratio':>5} {'budget':>6} {'std':>6} | "
        f"{'KV err hole / random':>29} {'h/r':>5} {'h<r':>5} | {'question err hole / random':>29}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        rand = row["random_at_shipped.kv_relative_error"]
        question = row["random_at_shipped.question_hidden_relative_error"]
        print(
            f"{row['holes']:>5} {row['placement']:>6} {row['ratio']:>5.2f} {row['shipped_hole.budget_fraction']:>6.3f} "
            f"{row['budget_fraction']:>6.3f} | "
            f"{row['shipped_hole.kv_relative_error']:.3f} / {rand['median']:.3f} [{rand['min']:.3f}-{rand['max']:.3f}]".rjust(29)
            + f" {ratio_text(row['shipped_hole.kv_relative_error'], rand['median']):>5} "
            f"{row['shipped_hole_kv_below_random_median']:>2}/{row['prompts']:<2} | "
            + f"{row['shipped_hole.question_hidden_relative_error']:.3f} / {question['median']:.3f} "
            f"[{question['min']:.3f}-{question['max']:.3f}]".rjust(29)
        )

    summary = {}
    if rows:
        total = sum(r["prompts"] for r in rows)
        summary = {
            "equal_budget_kv_error": {
                mode: statistics.fmean(r[f"{mode}.kv_relative_error"] for r in rows) for mode in ("standard", "hole")
            }
            | {"random": statistics.fmean(r["random.kv_relative_error"]["median"] for r in rows)},
            "prompts_hole_kv_below_standard": [sum(r["hole_kv_below_standard"] for r in rows), total],
            "prompts_hole_kv_below_random": [sum(r["hole_kv_below_random_median"] for r in rows), total],
            "shipped_budget_kv_error": {
                "hole": statistics.fmean(r["shipped_hole.kv_relative_error"] for r in rows),
                "random": statistics.fmean(r["random_at_shipped.kv_relative_error"]["median"] for r in rows),
            },
            "prompts_shipped_hole_kv_below_random": [sum(r["shipped_hole_kv_below_random_median"] for r in rows), total],
            "mean_budget_fraction": {
                "standard": statistics.fmean(r["budget_fraction"] for r in rows),
                "shipped_hole": statistics.fmean(r["shipped_hole.budget_fraction"] for r in rows),
            },
        }
        eq, sh = summary["equal_budget_kv_error"], summary["shipped_budget_kv_error"]
        print(
            f"\nmean over rows, A (budget {summary['mean_budget_fraction']['standard']:.3f} of the prompt): KV error "
            f"std {eq['standard']:.3f} hole {eq['hole']:.3f} random {eq['random']:.3f}; hole below standard in "
            f"{summary['prompts_hole_kv_below_standard'][0]}/{total} prompts, below random in "
            f"{summary['prompts_hole_kv_below_random'][0]}/{total}"
        )
        print(
            f"mean over rows, B (budget {summary['mean_budget_fraction']['shipped_hole']:.3f}): KV error hole "
            f"{sh['hole']:.3f} random {sh['random']:.3f}; hole below random in "
            f"{summary['prompts_shipped_hole_kv_below_random'][0]}/{total} prompts; {elapsed:.1f}s"
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_hole_blend",
                "model": config.__dict__,
                "check_layer": args.check_layer,
                "documents": args.documents,
                "seeds": args.seeds,
                "random_seeds": args.random_seeds,
                "budget": "every mode recomputes exactly the tokens standard CacheBlend recomputes at the ratio",
                "modes": {
                    "standard": "LMCache CacheBlend: blend the leading cached run, prefill from the first miss on",
                    "hole": "hole mode: every token without cached KV, then top-k cached tokens by K deviation, "
                    "split over the cached stretches in proportion to their size",
                    "random": "hole mode's uncached tokens, then cached tokens drawn uniformly at random",
                    "shipped_hole": "hole mode with the shipped ratio rule at the same ratio (table B; its "
                    "budget is its own, below standard's)",
                    "random_at_shipped": "random at the shipped hole mode's budget (table B)",
                },
                "machine": platform.machine(),
                "torch": torch.__version__,
                "rows": rows,
                "dropped_equal_by_construction": dropped,
                "summary": summary,
                "seconds": elapsed,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
