#!/usr/bin/env python3
"""Hole-mode CacheBlend vs standard CacheBlend vs plain reuse, without weights.

On the tiny deterministic RoPE transformer (`tests.blend.reference.model`),
for RAG prompts of 6-10 documents with 1, 2 or 3 missing documents ("holes")
at the start / middle / end and recompute ratios 0.15 / 0.3 / 0.5, it reports
per mode: the fraction of prompt tokens recomputed (from the check layer on),
the relative error of the prompt's KV cache against full prefill (whole prompt,
and on the prefix standard CacheBlend reuses), the relative error of the
question's final hidden states, and the KL divergence of the next-token
distribution.  Each row averages over document counts and seeds.

    python scripts/bench_hole_blend.py [--seeds 3] [--out results/bench_hole_blend.json]

Prints a table and writes JSON (rows plus the configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LMCACHE_ASCEND_AUTOLOAD", "0")

from tests.blend.reference.scenarios import ScenarioSpec, build_scenario, run_mode  # noqa: E402
from tests.blend.reference.model import TinyModelConfig, TinyRopeTransformer  # noqa: E402

MODES = ("standard", "hole", "reuse")
METRICS = (
    "recomputed_fraction",
    "kv_relative_error",
    "prefix_kv_relative_error",
    "question_hidden_relative_error",
    "last_token_kl",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="prompts per (documents, holes, placement)")
    parser.add_argument("--documents", type=int, nargs="+", default=[6, 8, 10])
    parser.add_argument("--holes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--placements", nargs="+", default=["start", "middle", "end"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3, 0.5])
    parser.add_argument("--check-layer", type=int, default=1)
    parser.add_argument("--out", default="results/bench_hole_blend.json")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds={args.seeds}; allowed: >= 1")
    for ratio in args.ratios:
        if not 0.0 < ratio <= 1.0:
            parser.error(f"--ratios contains {ratio}; allowed: in (0, 1]")
    return args


def main() -> int:
    args = parse_args()
    config = TinyModelConfig()
    model = TinyRopeTransformer(config)
    started = time.perf_counter()
    rows = []
    for num_holes in args.holes:
        for placement in args.placements:
            samples: dict[tuple[float, str], list[dict[str, float]]] = {}
            shapes = []
            for num_documents in args.documents:
                for seed in range(args.seeds):
                    spec = ScenarioSpec(num_documents, num_holes, placement, seed=seed)
                    scenario = build_scenario(model, spec)
                    truth = model.prefill(scenario.tokens)
                    count = scenario.tokens.shape[0]
                    hole_fraction = 1 - scenario.lookup.num_cached_tokens / count
                    shapes.append((count, hole_fraction))
                    reuse = run_mode(model, scenario, "reuse", 0.0, args.check_layer, truth)
                    for ratio in args.ratios:
                        for mode in MODES:
                            result = reuse if mode == "reuse" else run_mode(
                                model, scenario, mode, ratio, args.check_layer, truth
                            )
                            entry = {metric: getattr(result, metric) for metric in METRICS}
                            entry["target_fraction"] = hole_fraction + ratio * (1 - hole_fraction)
                            samples.setdefault((ratio, mode), []).append(entry)
            for ratio in args.ratios:
                row = {
                    "holes": num_holes,
                    "placement": placement,
                    "ratio": ratio,
                    "prompts": len(shapes),
                    "mean_tokens": statistics.mean(c for c, _ in shapes),
                    "hole_fraction": statistics.mean(h for _, h in shapes),
                }
                row["target_hole_mode_fraction"] = statistics.mean(
                    e["target_fraction"] for e in samples[(ratio, "hole")]
                )
                for mode in MODES:
                    for metric in METRICS:
                        row[f"{mode}.{metric}"] = statistics.mean(e[metric] for e in samples[(ratio, mode)])
                row["hole_over_standard_recomputed"] = (
                    row["hole.recomputed_fraction"] / row["standard.recomputed_fraction"]
                )
                rows.append(row)
    elapsed = time.perf_counter() - started

    header = (
        f"{'holes':>5} {'where':>6} {'ratio':>5} {'holeFr':>6} {'target':>6} | "
        f"{'recomputed std/hole/reuse':>25} {'h/s':>5} | {'KV rel.err std/hole/reuse':>25} | "
        f"{'prefix err std/hole':>19} | {'question err std/hole/reuse':>27} | {'KL std/hole/reuse':>23}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        def triple(metric: str, width: int = 7, digits: int = 3) -> str:
            return "/".join(f"{row[f'{mode}.{metric}']:.{digits}f}" for mode in MODES).rjust(width)

        print(
            f"{row['holes']:>5} {row['placement']:>6} {row['ratio']:>5.2f} {row['hole_fraction']:>6.3f} "
            f"{row['target_hole_mode_fraction']:>6.3f} | {triple('recomputed_fraction', 25)} "
            f"{row['hole_over_standard_recomputed']:>5.2f} | {triple('kv_relative_error', 25)} | "
            f"{row['standard.prefix_kv_relative_error']:.4f}/{row['hole.prefix_kv_relative_error']:.4f}".rjust(19)
            + f" | {triple('question_hidden_relative_error', 27)} | {triple('last_token_kl', 23, 4)}"
        )
    overall = {
        f"{mode}.{metric}": statistics.mean(row[f"{mode}.{metric}"] for row in rows)
        for mode in MODES
        for metric in METRICS
    }
    print(
        f"\nmean over rows: recomputed std {overall['standard.recomputed_fraction']:.3f} "
        f"hole {overall['hole.recomputed_fraction']:.3f} reuse {overall['reuse.recomputed_fraction']:.3f} "
        f"(hole/std {overall['hole.recomputed_fraction'] / overall['standard.recomputed_fraction']:.2f}); "
        f"KV error std {overall['standard.kv_relative_error']:.3f} hole {overall['hole.kv_relative_error']:.3f} "
        f"reuse {overall['reuse.kv_relative_error']:.3f}; {elapsed:.1f}s"
    )
    worse_prefix = [
        row for row in rows
        if row["hole.prefix_kv_relative_error"] > row["standard.prefix_kv_relative_error"] + 1e-9
    ]
    print(f"rows where hole mode's prefix error exceeds standard's: {len(worse_prefix)}")

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
                "modes": {
                    "standard": "LMCache CacheBlend: blend the leading cached run, prefill from the first miss on",
                    "hole": "hole mode: blend every cached document, prefill only holes/separators/question",
                    "reuse": "every cached document's KV as is (re-rotated), no blending",
                },
                "rows": rows,
                "overall": overall,
                "rows_with_worse_prefix_error": len(worse_prefix),
                "seconds": elapsed,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
