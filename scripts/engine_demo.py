"""The main job: a tiny hybrid model through vLLM + LMCache + lmcache-ascend, on the CPU.

Builds the random-weight Gemma-3-style model of the engine tests (sliding and
full attention layers, two KV-cache groups), runs the same prompts through vLLM
without a KV connector and with LMCache in process (twice: cold, then warm),
and prints the KV-cache groups vLLM allocated, the tokens LMCache stored and
supplied, and whether every output token equals the no-connector baseline.
Writes the numbers to results/engine_demo.json.

    .venvs/stack-d/bin/python scripts/engine_demo.py [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine import test_engine_reuse as cases  # noqa: E402  (the prompts and settings of the tests)
from tests.engine.harness import run_engine  # noqa: E402
from tests.engine.models import MODELS, build  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-sliding128", choices=sorted(MODELS))
    args = parser.parse_args()
    model = MODELS[args.model]
    with tempfile.TemporaryDirectory(prefix="lmcache-ascend-demo-") as scratch:
        path = str(build(model, Path(scratch)))
        started = time.monotonic()
        baseline = run_engine({"model": path, "rounds": cases.ROUNDS, "lmcache": False})
        reuse = run_engine({"model": path, "rounds": cases.ROUNDS, "lmcache": True, "env": cases.LMCACHE_ENV})
        wall = time.monotonic() - started
    (worker,) = reuse["workers"]
    groups = [f"{g['spec']}(block {g['block_size']}, window {g['sliding_window']})" for g in worker["groups"]]
    equal = [
        [a["tokens"] == b["tokens"] for a, b in zip(base_round, run_round)]
        for base_round, run_round in zip(baseline["rounds"], reuse["rounds"])
    ]
    worst = max(
        abs(x - y)
        for base_round, run_round in zip(baseline["rounds"], reuse["rounds"])
        for a, b in zip(base_round, run_round)
        for x, y in zip(a["logprobs"], b["logprobs"])
    )
    supplied = [[output["num_cached_tokens"] for output in round_] for round_ in reuse["rounds"]]
    print(f"model: {model.name} (random weights, {len(model.config['layer_types'])} layers), LMCache chunk {cases.CHUNK}")
    print(f"KV-cache groups (hybrid manager kept): {', '.join(groups)}")
    print(f"LMCache device connector: {worker['connector']['connector']}, "
          f"{worker['connector']['tokens_stored']} tokens stored, {worker['connector']['tokens_loaded']} loaded, "
          f"{worker['connector']['launches']} kernel launches")
    print(f"tokens LMCache supplied per prompt (vLLM num_cached_tokens): cold {supplied[0]}, warm {supplied[1]}, "
          f"shared prefixes {supplied[2]}; vLLM external_prefix_cache_hits = "
          f"{reuse['metrics'].get('vllm:external_prefix_cache_hits')}")
    same = all(all(round_) for round_ in equal)
    print(f"outputs equal to the no-connector baseline: {'YES' if same else 'NO'} {equal} "
          f"(largest logprob difference {worst:.1e}); {wall:.0f} s for both engines")
    Path("results").mkdir(exist_ok=True)
    Path("results/engine_demo.json").write_text(json.dumps(
        {"model": model.name, "groups": worker["groups"], "connector": worker["connector"], "supplied": supplied,
         "metrics": reuse["metrics"], "equal": equal, "max_logprob_diff": worst, "wall_s": wall}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
