"""vLLM 0.26 on a CUDA GPU with LMCache in process and the overlay, against vLLM alone.

Run by `run.sh` on the device machine once `stage.py receive` has installed the
wheels. For each model (the engine tests' tiny random-weight models, bfloat16,
their position range raised to hold 16K-token prompts) one engine process per arm,
one after another:

  vllm            vLLM alone, its prefix cache off: the no-connector reference
  vllm-prefix     vLLM alone, its prefix cache on (as users run it)
  overlay         LMCache in process (CPU backend, 256-token chunks) with the
                  overlay, vLLM's prefix cache off: every reused token is LMCache's
  overlay-prefix  the same with vLLM's prefix cache on

Each engine answers, after one untimed warm-up request: (1) outputs, with the byte
oracle (`tests.engine.kv_oracle`) recording: per prompt length a prompt cold, the
same prompt warm, and a control whose first token differs; (2) time to first
token, the oracle stopped: fresh prompts, each cold then warm, lengths
interleaved. The parent compares every arm's outputs with the reference's, checks
the oracle, prints the tables and writes them as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ARMS = ("vllm", "vllm-prefix", "overlay", "overlay-prefix")
CHUNK = 256
VOCAB = 512  # the tiny models' vocabulary


# Models of real size, weights drawn by vLLM (load_format "dummy"): the tiny models prefill 16K
# tokens in about 2 ms on an H200, so only a model of real size shows what reuse saves.
REAL_SHAPES = {
    # Llama-3-8B's shape: full attention, one KV-cache group.
    "llama-8b-shape": ("LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=500000.0)),
    # Gemma-3-4B's shape: 1024-token sliding window on five layers of six, full attention on the sixth.
    "gemma3-4b-shape": ("Gemma3ForCausalLM", dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4)),
}


def _model(name: str, lengths: list[int]):
    from tests.engine.models import MODELS, TinyModel

    positions = 1 << (max(lengths) + 64).bit_length()
    if name in REAL_SHAPES:
        architecture, config = REAL_SHAPES[name]
        return TinyModel(name=name, architecture=architecture, config={**config, "max_position_embeddings": positions},
                         seed=0, expected_groups=(), sliding_window=config.get("sliding_window"), dtype="bfloat16",
                         load_format="dummy")
    base = MODELS[name]
    return dataclasses.replace(base, name=f"{name}-{positions}", dtype="bfloat16",
                               config={**base.config, "max_position_embeddings": positions})


def _write(model, folder: Path) -> Path:
    """The tiny models' checkpoints as the engine tests write them; a real shape's config alone."""
    from tests.engine.models import build

    if model.load_format != "dummy":
        return build(model, folder)
    import transformers

    target = folder / model.name
    target.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, model.architecture).config_class(**model.config)
    config.architectures = [model.architecture]
    config.save_pretrained(target)
    return target


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def _ttft(output) -> float | None:
    metrics = getattr(output, "metrics", None)
    latency = getattr(metrics, "first_token_latency", None)
    return latency or None


def engine(model_name: str, arm: str, lengths: list[int], repeats: int, backend: str, memory: float,
           out: Path) -> None:
    """One engine process: the outputs pass, then the timing pass; JSON to `out`."""
    if arm.startswith("overlay"):
        import lmcache_ascend  # noqa: F401  (arms the overlay in this process, where the worker runs)
    from tests.engine import kv_oracle
    from tests.engine.runner import llm_options, output_record, worker_report

    model = _model(model_name, lengths)
    spec = {"model": str(_write(model, Path("/tmp/gpu-engine/models"))), "dtype": model.dtype,
            "load_format": model.load_format,
            "enable_prefix_caching": arm.endswith("prefix"), "lmcache": arm.startswith("overlay"),
            "max_model_len": max(lengths) + 64, "enforce_eager": True,
            "max_num_batched_tokens": None, "kv_cache_memory_bytes": None}
    options = llm_options(spec)
    options.update(gpu_memory_utilization=memory)
    if backend:
        options["attention_config"] = {"backend": backend}
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(**options)
    start_s = time.monotonic() - started
    llm.collective_rpc(kv_oracle.install)
    outputs_sampling = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, detokenize=False, ignore_eos=True)
    first_token = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)

    def generate(tokens, sampling):
        began = time.monotonic()
        (result,) = llm.generate([{"prompt_token_ids": tokens}], sampling, use_tqdm=False)
        return result, time.monotonic() - began

    warm_up = random.Random(1)
    for tokens in (_prompt(warm_up, 2 * CHUNK + 5),) * 2:  # cold then warm: compiles every path
        generate(tokens, outputs_sampling)

    rng = random.Random(0)
    requests = []
    for length in lengths:
        prompt = _prompt(rng, length)
        control = [prompt[0] % (VOCAB - 1) + 1] + prompt[1:]
        for label, tokens in (("cold", prompt), ("warm", prompt), ("control", control)):
            result, _ = generate(tokens, outputs_sampling)
            requests.append({"length": length, "label": label, "prompt": tokens, **output_record(result)})
    records = llm.collective_rpc(kv_oracle.report)
    llm.collective_rpc(kv_oracle.record, args=(False,))

    timings = []
    for _ in range(repeats):
        for length in lengths:
            prompt = _prompt(rng, length)
            for label in ("cold", "warm"):
                result, wall = generate(prompt, first_token)
                timings.append({"length": length, "label": label, "ttft_s": _ttft(result), "wall_s": wall,
                                "num_cached_tokens": result.num_cached_tokens})
    (worker,) = llm.collective_rpc(worker_report)
    listing = None
    if arm.startswith("overlay"):
        import torch

        from lmcache_ascend.kernels.dispatch import select_backend
        from lmcache_ascend.op_surface.moves import transfer_backend
        from lmcache_ascend.patches.__main__ import main as list_patches

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        worker["transfer_backend"] = f"{transfer_backend()} -> {select_backend(device, transfer_backend())} on {device}"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # this process's patches, as the listing CLI shows them
            list_patches([])
        listing = printed.getvalue()
    result = {"model": model.name, "arm": arm, "start_s": start_s, "requests": requests, "timings": timings,
              "oracle": records, "worker": worker, "listing": listing}
    out.write_text(json.dumps(result))


def _summary(runs: dict, lengths: list[int]) -> dict:
    """Outputs against the reference arm, the oracle, and TTFT per arm, length and label."""
    from tests.engine.kv_oracle import assert_loaded_blocks_were_computed

    reference = runs["vllm"]
    rows = []
    for arm, run in runs.items():
        checked = None
        if run["arm"].startswith("overlay"):
            (records,) = run["oracle"]
            checked = assert_loaded_blocks_were_computed(
                records, [r["prompt"] for r in run["requests"]], [r["num_cached_tokens"] for r in run["requests"]])
        for got, want in zip(run["requests"], reference["requests"], strict=True):
            gap = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
            rows.append({"arm": arm, "length": got["length"], "label": got["label"], "cached": got["num_cached_tokens"],
                         "tokens_equal": got["tokens"] == want["tokens"], "max_logprob_gap": gap})
        for length in lengths:
            cold, control = (next(r for r in run["requests"] if r["length"] == length and r["label"] == label)
                             for label in ("cold", "control"))
            rows.append({"arm": arm, "length": length, "label": "control differs",
                         "tokens_differ": cold["tokens"] != control["tokens"],
                         "logprobs_differ": cold["logprobs"] != control["logprobs"]})
        run["oracle_blocks_checked"] = checked
    ttft = []
    for arm, run in runs.items():
        for length in lengths:
            for label in ("cold", "warm"):
                samples = [t for t in run["timings"] if t["length"] == length and t["label"] == label]
                values = sorted(t["ttft_s"] or t["wall_s"] for t in samples)
                ttft.append({"arm": arm, "length": length, "label": label, "median_ms": 1e3 * statistics.median(values),
                             "min_ms": 1e3 * values[0], "max_ms": 1e3 * values[-1], "n": len(values),
                             "cached": sorted({t["num_cached_tokens"] for t in samples})})
    return {"outputs": rows, "ttft": ttft,
            "oracle_blocks_checked": {arm: run["oracle_blocks_checked"] for arm, run in runs.items()}}


def _print(model: str, summary: dict, runs: dict) -> None:
    print(f"\n== {model}")
    for arm, run in runs.items():
        worker = run["worker"]
        print(f"  {arm:15} start {run['start_s']:.1f} s  connector {worker.get('connector')}"
              f"  backend {worker.get('transfer_backend')}  oracle blocks {summary['oracle_blocks_checked'][arm]}")
    print("  arm             length  label            cached  tokens equal  max |dlogprob|")
    for row in summary["outputs"]:
        if "tokens_equal" in row:
            print(f"  {row['arm']:15} {row['length']:>6}  {row['label']:15}  {row['cached']:>6}  "
                  f"{row['tokens_equal']!s:12}  {row['max_logprob_gap']:.2e}")
        else:
            print(f"  {row['arm']:15} {row['length']:>6}  control differs: tokens {row['tokens_differ']}, "
                  f"logprobs {row['logprobs_differ']}")
    print("  arm             length  label  TTFT median ms (min-max, n)  cached")
    for row in summary["ttft"]:
        print(f"  {row['arm']:15} {row['length']:>6}  {row['label']:5}  {row['median_ms']:8.1f} "
              f"({row['min_ms']:.1f}-{row['max_ms']:.1f}, {row['n']})  {row['cached']}")


def main() -> None:
    parser = argparse.ArgumentParser(description="vLLM on a CUDA GPU with LMCache and the overlay, against vLLM alone")
    parser.add_argument("--models", default="gemma3-sliding128,llama-full")
    parser.add_argument("--lengths", default="4096,16384", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed prompts per length and arm")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--attention-backend", default="FLASH_ATTN", help="vLLM attention backend ('': vLLM's choice)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="vLLM's share of device memory (on vLLM's CPU build: of host memory)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON")
    parser.add_argument("--engine", nargs=2, metavar=("MODEL", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from tests.engine.models import MODELS

    try:
        lengths = [int(value) for value in args.lengths.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        parser.error(f"--lengths={args.lengths!r}: give positive token counts, comma-separated (e.g. 4096,16384)")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization={args.gpu_memory_utilization}: allowed: above 0, at most 1")
    known = sorted({*MODELS, *REAL_SHAPES})
    unknown = [name for name in args.models.split(",") if name not in known]
    if unknown:
        parser.error(f"--models={args.models!r}: {', '.join(unknown)} unknown; allowed: {', '.join(known)}")
    wrong_arms = [arm for arm in args.arms.split(",") if arm not in ARMS]
    if wrong_arms:
        parser.error(f"--arms={args.arms!r}: {', '.join(wrong_arms)} unknown; allowed: {', '.join(ARMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine:
        engine(*args.engine, lengths, args.repeats, args.attention_backend, args.gpu_memory_utilization, args.out / f"{args.engine[0]}.{args.engine[1]}.json")
        sys.stdout.flush()
        os._exit(0)  # vLLM's shutdown of an in-process engine core can hang; the result is written
    arms = args.arms.split(",")
    if arms[0] != "vllm":
        raise SystemExit(f"--arms={args.arms}: the first arm must be 'vllm', the reference the others are compared with")
    for model in args.models.split(","):
        runs = {}
        for arm in arms:
            command = [sys.executable, __file__, "--engine", model, arm, "--out", str(args.out),
                       "--lengths", args.lengths, "--repeats", str(args.repeats),
                       "--attention-backend", args.attention_backend,
                       "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            subprocess.run(command, check=True, timeout=300)
            runs[arm] = json.loads((args.out / f"{model}.{arm}.json").read_text())
        summary = _summary(runs, lengths)
        _print(model, summary, runs)
        (args.out / f"{model}.summary.json").write_text(json.dumps(summary, indent=1))
        if runs.get("overlay") and runs["overlay"]["listing"]:
            print(runs["overlay"]["listing"])


if __name__ == "__main__":
    main()
