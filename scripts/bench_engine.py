"""What a user gains, measured in vLLM's real engine: time to first token and KV capacity.

Three configurations of the same model serve the same prompts, each an engine of
its own (``vllm.LLM`` with its engine core and worker processes), all alive at
once and asked in turn, so every configuration meets the same machine state:

* ``vllm``: vLLM alone, no KV connector (the hybrid KV-cache manager on);
* ``upstream``: LMCache in process (``LMCacheConnectorV1``) with the overlay off
  (``LMCACHE_ASCEND_PATCHES=0``): vLLM turns its hybrid manager off for a
  connector that is not ``SupportsHMA``; ``PYTHONHASHSEED`` is fixed for it so
  that its chunk keys can match at all;
* ``overlay``: LMCache in process with lmcache-ascend (the hybrid manager kept).

vLLM's own prefix cache is off everywhere: every reuse comes from LMCache. Per
prefix length (shared prefix, then a new tail) each repeat draws a new prefix; the
cold prompt (prefix + tail 1) goes to every engine, then the warm one (prefix +
tail 2), the engines' order rotating per repeat. Measured per request: vLLM's
time to first token (``RequestOutput.metrics.first_token_latency``), prompt
tokens per second of it, and the tokens LMCache supplied (``num_cached_tokens``).
Capacity is vLLM's own report at start (``cache_config.kv_cache_size_tokens``,
``kv_cache_max_concurrency`` for requests of ``max_model_len`` tokens, blocks) at
one ``VLLM_CPU_KVCACHE_SPACE``. Every prompt's greedy tokens must be equal in all
three configurations (logprobs within 1e-4): checked, the exit code says.

Models: the engine tests' random-weight Gemma-3-style hybrid (sliding + full
layers, two KV-cache groups) and their full-attention control (one group; no
capacity difference expected). ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set and
recorded: a sweep with 1, and one length with vLLM's default (on x86 it reserves
one more core whenever a KV connector is configured).

    .venvs/stack-d/bin/python scripts/bench_engine.py            # the full run
    .venvs/stack-d/bin/python scripts/bench_engine.py --quick    # a small one
    ... --write-docs    # also fill docs/engine-benchmark.md with this run's table

Writes results/bench_engine.json, results/bench_engine.png (TTFT vs prefix length,
capacity per configuration), results/bench_engine.md (the docs table) and prints
the table. ``--device cuda`` runs the same on a GPU build of vLLM (the KV-cache
size then goes through ``kv_cache_memory_bytes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.engine.harness import engine_environment, ipc_reclaimed, stop_group  # noqa: E402
from tests.engine.models import MODELS, build  # noqa: E402

CHUNK = 256
CONFIGS = ("vllm", "upstream", "overlay")
LOGPROB_TOLERANCE = 1e-4
START_TIMEOUT_S = 1200
REQUEST_TIMEOUT_S = 600
DOCS = REPO_ROOT / "docs" / "engine-benchmark.md"
DOCS_BEGIN = "<!-- bench_engine.py --write-docs: begin -->"
DOCS_END = "<!-- bench_engine.py --write-docs: end -->"


# ---------------------------------------------------------------- the engine side


def serve(spec_path: str) -> None:
    """One engine behind a loopback connection: ``bench_engine.py --serve SPEC``."""
    from multiprocessing.connection import Listener

    started = time.monotonic()
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    from tests.engine.runner import llm_options, output_record, worker_report

    llm = LLM(**llm_options(spec))
    vllm_config = llm.llm_engine.vllm_config
    cache = vllm_config.cache_config
    ready = {
        "start_s": time.monotonic() - started,
        "num_blocks": cache.num_gpu_blocks,
        "kv_cache_size_tokens": cache.kv_cache_size_tokens,
        "max_concurrency": cache.kv_cache_max_concurrency,
        "max_model_len": vllm_config.model_config.max_model_len,
        "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "hybrid_manager": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "workers": llm.collective_rpc(worker_report),
    }
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0, detokenize=False)
    with Listener(("127.0.0.1", 0), authkey=bytes.fromhex(spec["authkey"])) as listener:
        address = Path(spec["address_file"])
        address.with_suffix(".tmp").write_text(json.dumps(listener.address))
        address.with_suffix(".tmp").rename(address)
        with listener.accept() as connection:
            connection.send(ready)
            while True:
                message = connection.recv()
                if message["op"] == "stop":
                    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
                    connection.send({"metrics": {k: v for k, v in metrics.items() if "prefix_cache" in k},
                                     "workers": llm.collective_rpc(worker_report)})
                    return
                begun = time.perf_counter()
                (output,) = llm.generate([{"prompt_token_ids": message["prompt"]}], sampling, use_tqdm=False)
                wall = time.perf_counter() - begun
                latency = getattr(output.metrics, "first_token_latency", None) or None
                connection.send({**output_record(output), "ttft_s": latency, "wall_s": wall})


# ---------------------------------------------------------------- the driver side


class Engine:
    """An engine process of its own process group, asked over a loopback connection."""

    def __init__(self, name: str, spec: dict, env: dict[str, str], scratch: Path):
        self.name = name
        self.log_path = scratch / f"{name}.log"
        spec = {**spec, "authkey": secrets.token_hex(16), "address_file": str(scratch / f"{name}.address")}
        self.spec = spec
        spec_path = scratch / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve", str(spec_path)],
                cwd=REPO_ROOT, env=engine_environment(env), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # engine core and workers in its group: one kill ends them all
            )
        self.connection = None
        self.ready: dict | None = None

    def _fail(self, what: str) -> RuntimeError:
        tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
        return RuntimeError(f"engine {self.name!r}: {what}; log tail:\n{tail}")

    def wait_ready(self, deadline: float) -> dict:
        from multiprocessing.connection import Client

        address = Path(self.spec["address_file"])
        while not address.exists():
            if self.process.poll() is not None:
                raise self._fail(f"exited {self.process.returncode} while starting")
            if time.monotonic() > deadline:
                raise self._fail(f"not ready after {START_TIMEOUT_S} s")
            time.sleep(0.5)
        self.connection = Client(tuple(json.loads(address.read_text())), authkey=bytes.fromhex(self.spec["authkey"]))
        self.ready = self._receive(deadline)
        return self.ready

    def _receive(self, deadline: float):
        while not self.connection.poll(1.0):
            if self.process.poll() is not None:
                raise self._fail(f"exited {self.process.returncode}")
            if time.monotonic() > deadline:
                raise self._fail("no answer before the deadline")
        return self.connection.recv()

    def generate(self, prompt: list[int]) -> dict:
        self.connection.send({"op": "generate", "prompt": prompt})
        return self._receive(time.monotonic() + REQUEST_TIMEOUT_S)

    def finish(self) -> dict:
        self.connection.send({"op": "stop"})
        return self._receive(time.monotonic() + REQUEST_TIMEOUT_S)

    def kill(self) -> None:
        if self.connection is not None:
            self.connection.close()
        stop_group(self.process)


def config_env(config: str, args, reserved: str) -> tuple[dict, dict[str, str]]:
    """(spec fields, environment) of one configuration."""
    spec = {"lmcache": config != "vllm"}
    env: dict[str, str] = {}
    if args.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
        if reserved != "default":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
    if config != "vllm":
        env.update(LMCACHE_CHUNK_SIZE=str(CHUNK), LMCACHE_LOCAL_CPU="True",
                   LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.lmcache_cpu_gb))
    if config == "upstream":
        env.update(LMCACHE_ASCEND_PATCHES="0", PYTHONHASHSEED="0")
    return spec, env


def run_group(model_name: str, lengths: list[int], repeats: int, reserved: str, args, scratch: Path) -> dict:
    """All three configurations of one model alive at once; the prompts asked in turn."""
    model = MODELS[model_name]
    max_model_len = -(-(max(lengths) + args.tail + args.max_tokens) // CHUNK) * CHUNK
    # The tests' models know 4096 positions; the benchmark's prompts may be longer.
    long_model = dataclasses.replace(model, name=f"{model.name}-bench",
                                     config={**model.config, "max_position_embeddings": max(max_model_len, 4096)})
    path = str(build(long_model, args.models_dir))
    base_spec = {
        "model": path, "max_model_len": max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_tokens": args.max_tokens, "disable_hybrid_kv_cache_manager": None,  # vLLM decides, as for a user
        "kv_cache_memory_bytes": None if args.device == "cpu" else args.kv_space_gib << 30,
    }
    label = f"{model_name}, reserved CPUs {reserved}"
    print(f"[{label}] starting {', '.join(CONFIGS)} (max_model_len {max_model_len})", flush=True)
    engines: dict[str, Engine] = {}
    draw = random.Random(f"{model_name}-{reserved}-{args.seed}")

    def tokens(count: int) -> list[int]:
        return [draw.randrange(3, model.config["vocab_size"] - 12) for _ in range(count)]

    try:
        for config in CONFIGS:
            extra, env = config_env(config, args, reserved)
            engines[config] = Engine(config, {**base_spec, **extra}, env, scratch / f"{model_name}-{reserved}")
        deadline = time.monotonic() + START_TIMEOUT_S
        ready = {config: engine.wait_ready(deadline) for config, engine in engines.items()}
        for config, report in ready.items():
            print(f"[{label}] {config}: {report['kv_cache_size_tokens']} KV tokens, "
                  f"{report['max_concurrency']:.2f}x requests of {report['max_model_len']}, "
                  f"hybrid manager {'on' if report['hybrid_manager'] else 'off'}, "
                  f"{report['workers'][0]['omp_threads']} worker threads, prefill chunk {report['max_num_batched_tokens']}, "
                  f"started in {report['start_s']:.0f} s", flush=True)
        # Throwaway requests: first-call costs (a first store, a first load) are not a configuration's.
        warmup = tokens(max(lengths) + args.tail)
        for engine in engines.values():
            engine.generate(warmup)
            engine.generate(warmup)
        requests = []
        for repeat in range(repeats):
            order = list(CONFIGS[repeat % 3:] + CONFIGS[:repeat % 3])
            for length in lengths:
                prefix = tokens(length)
                prompts = {"cold": prefix + tokens(args.tail), "warm": prefix + tokens(args.tail)}
                for kind, prompt in prompts.items():
                    for config in order:
                        answer = engines[config].generate(prompt)
                        requests.append({"config": config, "repeat": repeat, "length": length, "kind": kind,
                                         "prompt_tokens": len(prompt), **answer})
                        print(f"[{label}] repeat {repeat + 1}/{repeats}, prefix {length}, {kind:4} {config:8}: "
                              f"TTFT {_ms(answer['ttft_s'])}, LMCache supplied {answer['num_cached_tokens']}", flush=True)
        final = {config: engine.finish() for config, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.kill()
    return {"model": model_name, "groups_expected": list(model.expected_groups), "reserved_cpus": reserved,
            "lengths": lengths, "repeats": repeats, "tail": args.tail, "max_model_len": max_model_len,
            "capacity": ready,  # vLLM's report at start, per configuration
            "final": final, "requests": requests}


# ---------------------------------------------------------------- summaries


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def check_outputs(group: dict) -> dict:
    """Every prompt's greedy tokens equal across the configurations; the largest logprob gap."""
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for request in group["requests"]:
        by_prompt.setdefault((request["repeat"], request["length"], request["kind"]), {})[request["config"]] = request
    unequal, worst = [], 0.0
    for key, answers in by_prompt.items():
        reference = answers["vllm"]
        for config, answer in answers.items():
            if answer["tokens"] != reference["tokens"]:
                unequal.append({"prompt": list(key), "config": config})
                continue
            gap = max(abs(a - b) for a, b in zip(answer["logprobs"], reference["logprobs"], strict=True))
            worst = max(worst, gap)
    return {"prompts": len(by_prompt), "unequal": unequal, "max_logprob_diff": worst,
            "equal": not unequal and worst <= LOGPROB_TOLERANCE}


def summarize(group: dict) -> dict:
    rows = []
    for config in CONFIGS:
        for length in group["lengths"]:
            picked = {kind: sorted((r for r in group["requests"]
                                    if r["config"] == config and r["length"] == length and r["kind"] == kind),
                                   key=lambda r: r["repeat"])
                      for kind in ("cold", "warm")}
            if not picked["cold"] or any(r["ttft_s"] is None for k in picked for r in picked[k]):
                continue
            row = {"config": config, "length": length}
            for kind, requests in picked.items():
                row[f"{kind}_ttft_s"] = _spread([r["ttft_s"] for r in requests])
                row[f"{kind}_tok_per_s"] = _spread([r["prompt_tokens"] / r["ttft_s"] for r in requests])
                row[f"{kind}_supplied"] = _spread([r["num_cached_tokens"] for r in requests])
            # Paired per repeat: the same prefix, cold then warm, on the same engine.
            row["warm_over_cold"] = _spread([w["ttft_s"] / c["ttft_s"] for c, w in zip(picked["cold"], picked["warm"])])
            rows.append(row)
    capacity = group["capacity"]
    ratio = None
    if capacity["upstream"]["kv_cache_size_tokens"]:
        ratio = capacity["overlay"]["kv_cache_size_tokens"] / capacity["upstream"]["kv_cache_size_tokens"]
    return {"rows": rows, "capacity_overlay_over_upstream": ratio, "outputs": check_outputs(group)}


def _fmt(spread: dict, scale: float = 1.0, digits: int = 0) -> str:
    return (f"{spread['median'] * scale:.{digits}f} "
            f"({spread['min'] * scale:.{digits}f}-{spread['max'] * scale:.{digits}f})")


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        *(["**A `--quick` check** (short prefixes, few repeats): it shows the script works, it is not the "
           "measurement.", ""] if meta.get("quick") else []),
        f"Run: `{meta['command']}`" + (f", {meta['wall_s'] / 60:.0f} minutes" if "wall_s" in meta else "") + "  ",
        f"Commit `{meta['commit']}`, {meta['date']}; machine: {meta['machine']}; device {meta['device']}; "
        f"vLLM {meta['versions']['vllm']}, LMCache {meta['versions']['lmcache']}, torch {meta['versions']['torch']}.  ",
        f"KV cache: `VLLM_CPU_KVCACHE_SPACE={meta['kv_space_gib']}` (GiB) per engine; LMCache: local CPU backend, "
        f"{CHUNK}-token chunks, {meta['lmcache_cpu_gb']} GB; vLLM's prefix cache off; tails of {meta['tail']} new "
        f"tokens; medians (min-max) over the repeats; TTFT is vLLM's `first_token_latency`.",
        "",
    ]
    for group in result["groups"]:
        summary = group["summary"]
        capacity = group["capacity"]
        lines += [f"### {group['model']}, `VLLM_CPU_NUM_OF_RESERVED_CPU={group['reserved_cpus']}`, "
                  f"{group['repeats']} repeats", ""]
        lines += ["| configuration | hybrid manager | KV-cache groups | worker threads | prefill chunk | KV tokens | "
                  f"requests of {group['max_model_len']} tokens | blocks |", "|---|---|---|---|---|---|---|---|"]
        for config in CONFIGS:
            report = capacity[config]
            groups = ", ".join(g["spec"] for g in report["workers"][0]["groups"])
            lines.append(f"| {config} | {'on' if report['hybrid_manager'] else 'off'} | {groups} | "
                         f"{report['workers'][0]['omp_threads']} | {report['max_num_batched_tokens']} | "
                         f"{report['kv_cache_size_tokens']:,} | "
                         f"{report['max_concurrency']:.2f} | {report['num_blocks']:,} |")
        ratio = summary["capacity_overlay_over_upstream"]
        lines += ["", f"Capacity overlay / upstream: **{ratio:.2f}x** (vLLM's allocator report: the same at every "
                      "run, no spread)." if ratio else "", ""]
        lines += ["| configuration | prefix | cold TTFT ms | warm TTFT ms | warm / cold | cold tok/s | warm tok/s | "
                  "LMCache supplied (warm) |", "|---|---|---|---|---|---|---|---|"]
        for row in summary["rows"]:
            lines.append(
                f"| {row['config']} | {row['length']} | {_fmt(row['cold_ttft_s'], 1000)} | "
                f"{_fmt(row['warm_ttft_s'], 1000)} | **{_fmt(row['warm_over_cold'], 1, 2)}** | "
                f"{_fmt(row['cold_tok_per_s'])} | {_fmt(row['warm_tok_per_s'])} | {_fmt(row['warm_supplied'])} |")
        outputs = summary["outputs"]
        lines += ["", f"Outputs: {outputs['prompts']} prompts, greedy tokens equal in all three configurations: "
                      f"**{'yes' if outputs['equal'] else 'NO'}** (largest logprob difference "
                      f"{outputs['max_logprob_diff']:.1e}"
                      + (f"; unequal: {outputs['unequal']}" if outputs["unequal"] else "") + ").", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [g for g in result["groups"] if len(g["lengths"]) > 1] or result["groups"]
    figure, axes = plt.subplots(1, len(sweeps) + 1, figsize=(5.2 * (len(sweeps) + 1), 4.2))
    colors = {"vllm": "tab:gray", "upstream": "tab:red", "overlay": "tab:blue"}
    for axis, group in zip(axes, sweeps):
        for config in CONFIGS:
            rows = [r for r in group["summary"]["rows"] if r["config"] == config]
            for kind, style in (("cold", "--"), ("warm", "-")):
                xs = [r["length"] for r in rows]
                ys = [r[f"{kind}_ttft_s"]["median"] * 1000 for r in rows]
                low = [y - r[f"{kind}_ttft_s"]["min"] * 1000 for y, r in zip(ys, rows)]
                high = [r[f"{kind}_ttft_s"]["max"] * 1000 - y for y, r in zip(ys, rows)]
                axis.errorbar(xs, ys, yerr=[low, high], linestyle=style, marker="o", capsize=3,
                              color=colors[config], label=f"{config} {kind}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("shared prefix (tokens), new tail of %d" % group["tail"])
        axis.set_ylabel("time to first token (ms, log scale)")
        axis.set_title(f"{group['model']} (reserved CPUs {group['reserved_cpus']})", fontsize=10)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    capacity_axis = axes[-1]
    models = [g for g in result["groups"] if g["reserved_cpus"] == result["groups"][0]["reserved_cpus"]]
    width = 0.8 / len(CONFIGS)
    for index, config in enumerate(CONFIGS):
        values = [g["capacity"][config]["kv_cache_size_tokens"] / 1000 for g in models]
        bars = capacity_axis.bar([m + index * width for m in range(len(models))], values, width,
                                 color=colors[config], label=config)
        capacity_axis.bar_label(bars, fmt="%.0f", fontsize=7)
    capacity_axis.set_xticks([m + width for m in range(len(models))],
                             [f"{g['model']}\n(requests of {g['max_model_len']})" for g in models], fontsize=8)
    capacity_axis.set_ylabel("KV tokens vLLM's cache holds (thousands)")
    capacity_axis.set_title(f"KV capacity at VLLM_CPU_KVCACHE_SPACE={result['meta']['kv_space_gib']} GiB", fontsize=10)
    capacity_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_docs(table: str, picture: Path | None) -> None:
    """This run's table between the docs page's markers, its plot beside the page."""
    text = DOCS.read_text()
    begin, end = text.index(DOCS_BEGIN) + len(DOCS_BEGIN), text.index(DOCS_END)
    DOCS.write_text(text[:begin] + "\n" + table + "\n" + text[end:])
    if picture is not None:
        DOCS.with_suffix(".png").write_bytes(picture.read_bytes())


def _meta(args) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def find(*names: str) -> str:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return "absent"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "command": "scripts/bench_engine.py " + " ".join(sys.argv[1:]),
        "commit": commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else ""),
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu}, {len(os.sched_getaffinity(0))} CPUs, {memory:.0f} GiB, load {os.getloadavg()[0]:.1f} at start",
        "device": args.device, "quick": args.quick,
        "versions": {"vllm": find("vllm", "vllm-cpu"), "lmcache": find("lmcache"), "torch": find("torch")},
        "kv_space_gib": args.kv_space_gib, "lmcache_cpu_gb": args.lmcache_cpu_gb, "tail": args.tail,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="short prompts, 2 repeats (a check, not a measurement)")
    parser.add_argument("--models", default="gemma3-sliding128,llama-full",
                        help="comma-separated, of: " + ", ".join(sorted(MODELS)))
    parser.add_argument("--lengths", help="shared prefix lengths, multiples of %d (default 1024,2048,4096,8192)" % CHUNK)
    parser.add_argument("--repeats", type=int, help="new prefixes per length (default 5)")
    parser.add_argument("--tail", type=int, default=128, help="new tokens after the shared prefix")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (compared)")
    parser.add_argument("--reserved-default-length", type=int,
                        help="prefix length measured with vLLM's default VLLM_CPU_NUM_OF_RESERVED_CPU "
                             "(first model; 0 skips; default 2048)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="vLLM's prefill chunk (default: vLLM's own; a sliding-window group holds the window "
                             "plus this many tokens per request, so it bounds what the hybrid manager saves)")
    parser.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of every engine")
    parser.add_argument("--lmcache-cpu-gb", type=float, help="LMCACHE_MAX_LOCAL_CPU_SIZE (default 2, --quick 0.5)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results", help="folder for bench_engine.{json,png,md}")
    parser.add_argument("--write-docs", action="store_true", help=f"put the table into {DOCS.relative_to(REPO_ROOT)}")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0

    lengths = args.lengths or ("512,1024" if args.quick else "1024,2048,4096,8192")
    try:
        args.lengths = [int(value) for value in lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths {lengths!r}: comma-separated integers, multiples of {CHUNK}")
    bad = [value for value in args.lengths if value <= 0 or value % CHUNK]
    if bad:
        parser.error(f"--lengths {lengths!r}: {bad} are not positive multiples of the chunk size {CHUNK}")
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.lmcache_cpu_gb = args.lmcache_cpu_gb or (0.5 if args.quick else 2.0)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    models = args.models.split(",")
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        parser.error(f"--models {args.models!r}: unknown {unknown}; allowed: {', '.join(sorted(MODELS))}")
    default_length = args.reserved_default_length
    if default_length is None:
        default_length = args.lengths[0] if args.quick else 2048
    if default_length % CHUNK:
        parser.error(f"--reserved-default-length {default_length}: a multiple of {CHUNK} (0 skips)")
    if args.kv_space_gib < 1:
        parser.error(f"--kv-space-gib {args.kv_space_gib}: at least 1 (VLLM_CPU_KVCACHE_SPACE is whole GiB)")
    if args.tail < 1 or args.max_tokens < 1:
        parser.error(f"--tail {args.tail} / --max-tokens {args.max_tokens}: at least 1")

    out = REPO_ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = {"meta": _meta(args), "groups": []}
    plan = [(name, args.lengths, args.repeats, "1") for name in models]
    if default_length and args.device == "cpu":
        plan.append((models[0], [default_length], args.repeats, "default"))
    with tempfile.TemporaryDirectory(prefix="lmcache-ascend-bench-engine-") as scratch, ipc_reclaimed():
        args.models_dir = Path(scratch) / "models"
        for name, lengths_, repeats, reserved in plan:
            (Path(scratch) / f"{name}-{reserved}").mkdir()
            group = run_group(name, lengths_, repeats, reserved, args, Path(scratch))
            group["summary"] = summarize(group)
            result["groups"].append(group)
    result["meta"]["wall_s"] = time.monotonic() - started
    table = markdown(result)
    (out / "bench_engine.json").write_text(json.dumps(result, indent=1))
    (out / "bench_engine.md").write_text(table + "\n")
    print()
    print(table)
    picture = out / "bench_engine.png"
    try:
        plot(result, picture)
        print(f"\nwrote {out / 'bench_engine.json'}, {out / 'bench_engine.md'}, {picture}")
    except ImportError as error:
        picture = None
        print(f"\nno plot: {error} (matplotlib is pinned in requirements/stack-d.txt)")
    if args.write_docs:
        write_docs(table, picture)
        print(f"wrote the table into {DOCS}" + (f" and the plot beside it" if picture else ""))
    return 0 if all(group["summary"]["outputs"]["equal"] for group in result["groups"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
