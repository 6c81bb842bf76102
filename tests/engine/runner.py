"""One engine run in a process of its own: ``python -m tests.engine.runner SPEC OUT``.

SPEC (JSON) names the model checkpoint, whether LMCache is the KV connector, its
environment, and rounds of prompts (token ids); each round is one
``LLM.generate`` call, so the prompts of a round are batched together
(``wait_for_stores``: before each round after the first, wait until every
store the worker's LMCache MP adapter submitted is answered by the server and
its copy has ended, so that what the round looks up is what earlier rounds
stored, however slow the machine).  OUT gets,
per round and prompt, the greedy tokens with their logprobs and vLLM's
``num_cached_tokens``; vLLM's prefix-cache counters; the KV-cache groups the
worker really allocated; what lmcache-ascend's connector moved; and, with
``kv_oracle``, digests of each prompt's KV blocks (`tests.engine.kv_oracle`); with
``skip_groups`` (KV-cache group indices; ``skip_fill``, a float, NaN unless given), the
cached-prefix blocks of those groups overwritten before a warm request's first step
(`tests.engine.skipped_groups`); with ``poison_between_rounds`` (a float), before each round
after the first (its stores waited for) vLLM's prefix cache emptied and every block of every
KV cache filled with it, for connectors that load before that first step. With
``faults`` (round index -> fault) and ``fault_store``, each such round's first load (or
store) meets that fault of the shared store (`tests.engine.faults`), a killed server is
restarted (a removed folder made again, an MP adapter waited for until it finds the
server again) before the next round, and OUT says which faults a load met and how many chunks
failed their seal check. ``crash_after_round``: the run's whole process group is killed
right after that round (a crashed engine, its writes in flight). ``cold_rounds``: round indices
whose prompts read nothing of vLLM's own prefix cache (``skip_reading_prefix_cache``: their cold
computation in the same engine); ``reset_prefix_cache_rounds``: before each such round vLLM's own
prefix cache is emptied (a KV connector's store is kept), so that what it reuses comes from the
connector. ``mamba_cache_mode`` (``"align"``: vLLM's prefix caching of state-space layers, with
``enable_prefix_caching``) and ``max_num_seqs`` go to ``vllm.LLM`` as they are.

The engine runs as shipped: engine core and worker processes of their own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def worker_report(worker) -> dict:
    """Runs inside each vLLM worker (through ``LLM.collective_rpc``)."""
    import torch

    config = worker.model_runner.kv_cache_config
    groups = [
        {"spec": type(group.kv_cache_spec).__name__, "layers": list(group.layer_names),
         "block_size": group.kv_cache_spec.block_size,
         "sliding_window": getattr(group.kv_cache_spec, "sliding_window", None)}
        for group in config.kv_cache_groups
    ]
    moved = None
    kv_connector = None
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            connector = get_kv_transfer_group()
            kv_connector = f"{type(connector).__module__}.{type(connector).__qualname__}"
            impl = getattr(connector, "_lmcache_engine", None)
            engine = getattr(impl, "lmcache_engine", None)
            gpu_connector = getattr(engine, "gpu_connector", None)
            moved = {
                "connector": type(gpu_connector).__name__ if gpu_connector is not None else None,
                "launches": getattr(gpu_connector, "launches", None),
                "tokens_stored": getattr(gpu_connector, "tokens_stored", None),
                "tokens_loaded": getattr(gpu_connector, "tokens_loaded", None),
                "plan": chunk_plan(getattr(gpu_connector, "planner", None)),
            }
    except Exception as error:  # the report must not hide the outputs
        moved = {"error": repr(error)}
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    caches = {}  # registered KV cache per layer: shape, strides (elements), dtype, whether contiguous
    for name in (name for group in config.kv_cache_groups for name in group.layer_names):
        cache = getattr(context.get(name), "kv_cache", None)
        cache = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
        if isinstance(cache, torch.Tensor):
            caches[name] = [list(cache.shape), list(cache.stride()), str(cache.dtype), cache.is_contiguous()]
    return {"groups": groups, "connector": moved, "kv_connector": kv_connector, "omp_threads": torch.get_num_threads(),
            "caches": caches}


def chunk_plan(planner) -> list[dict] | None:
    """What lmcache-ascend's connector moves per full chunk: per layer group its layers and, per plane,
    the KV-cache group, compress ratio and rows (None where another connector moves the KV)."""
    if planner is None:
        return None
    plan = []
    for group, region in zip(planner.layer_groups, planner.full_plan.regions):
        planes = [{"group": key[0], "ratio": key[1], "rows": rows, "row_bytes": identity.row_bytes}
                  for identity, rows in zip(group.planes, region.plane_rows)
                  for key in (planner.row_key(identity),)]
        plan.append({"layers": list(group.member_names), "planes": planes})
    return plan


def stores_in_flight(worker) -> int:
    """Runs inside each vLLM worker: stores its LMCache MP adapter submitted that are not complete.

    A future is complete once the server answered and the copy's event has
    fired; the server commits a chunk (makes it visible to lookups) when that
    copy ends, never before.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    adapter = getattr(get_kv_transfer_group(), "worker_adapter", None)
    futures = list(getattr(adapter, "store_futures", {}).values())
    return sum(not future.query() for future in futures)


def wait_for_stores(llm, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(llm.collective_rpc(stores_in_flight)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"LMCache MP stores still in flight after {timeout_s} s")
        time.sleep(0.05)


def llm_options(spec: dict) -> dict:
    """``vllm.LLM`` keyword arguments for `spec` (the engine tests' settings; the benchmark's too).

    ``disable_hybrid_kv_cache_manager: null`` leaves the choice to vLLM (it turns the
    hybrid manager off for a connector that is not ``SupportsHMA``);
    ``kv_cache_memory_bytes: null`` leaves the KV-cache size to vLLM (on the CPU,
    ``VLLM_CPU_KVCACHE_SPACE``); ``max_num_batched_tokens: null`` takes vLLM's default.
    """
    options = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        # Every reuse must come from LMCache, unless the spec asks for vLLM's own (its reference).
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 2048),
        seed=0,
        gpu_memory_utilization=0.05,
        disable_log_stats=False,
        disable_hybrid_kv_cache_manager=spec.get("disable_hybrid_kv_cache_manager", False),
        enforce_eager=spec.get("enforce_eager", False),
    )
    if spec.get("load_format"):
        options["load_format"] = spec["load_format"]
    if spec.get("mamba_cache_mode"):  # "align": vLLM's prefix caching of state-space layers (needs it on)
        options["mamba_cache_mode"] = spec["mamba_cache_mode"]
    if spec.get("attention_backend"):
        options["attention_backend"] = spec["attention_backend"]
    if spec.get("max_num_seqs"):
        options["max_num_seqs"] = spec["max_num_seqs"]
    for key, default in (("max_num_batched_tokens", 2048), ("kv_cache_memory_bytes", 256 << 20)):
        value = spec.get(key, default)
        if value is not None:
            options[key] = value
    if spec.get("lmcache"):
        from vllm.config import KVTransferConfig

        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec.get("kv_connector", "LMCacheConnectorV1"),
            kv_role="kv_both",
            kv_connector_extra_config=spec.get("kv_connector_extra_config", {}),
            **({"kv_load_failure_policy": spec["kv_load_failure_policy"]} if spec.get("kv_load_failure_policy") else {}),
        )
    return options


def output_record(output) -> dict:
    """A finished request's greedy tokens, their logprobs and vLLM's ``num_cached_tokens``."""
    completion = output.outputs[0]
    return {
        "tokens": list(completion.token_ids),
        "logprobs": [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)],
        "num_cached_tokens": output.num_cached_tokens,
    }


def main(spec_path: str, out_path: str) -> None:
    started = time.monotonic()
    with open(spec_path) as handle:
        spec = json.load(handle)
    os.environ.update(spec.get("env", {}))

    from vllm import LLM, SamplingParams

    from tests.engine import faults

    options = llm_options(spec)
    if spec.get("engine_core") == "in-driver":
        # vLLM's engine core (the scheduler, the connector's scheduler side) in this process; the
        # worker keeps its own, which vLLM's CPU build needs for its OpenMP binding.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        options["distributed_executor_backend"] = "mp"
    llm = LLM(**options)
    if spec.get("kv_oracle"):
        from tests.engine import kv_oracle

        llm.collective_rpc(kv_oracle.install)
    if spec.get("skip_groups"):
        from tests.engine import skipped_groups

        llm.collective_rpc(skipped_groups.install, args=(spec["skip_groups"], float(spec.get("skip_fill", "nan"))))
    ready = time.monotonic()
    greedy = dict(temperature=0.0, max_tokens=spec.get("max_tokens", 12), logprobs=0, detokenize=False)
    sampling = SamplingParams(**greedy)
    # ``cold_rounds``: round indices whose prompts read nothing from vLLM's own prefix cache (their
    # cold computation in the same engine, for comparison with a warm round of the same prompts).
    cold = SamplingParams(**greedy, skip_reading_prefix_cache=True)
    rounds = []
    faults_met = []
    poisoned = []  # per round after the first, with poison_between_rounds: the caches filled
    for index, prompts in enumerate(spec["rounds"]):
        if index and spec.get("wait_for_stores"):
            wait_for_stores(llm)
        if index and spec.get("poison_between_rounds") is not None:
            from tests.engine import skipped_groups

            llm.reset_prefix_cache()
            poisoned.append(sum(llm.collective_rpc(skipped_groups.poison, args=(float(spec["poison_between_rounds"]),))))
        if index and spec.get("faults"):
            # The round before's remote writes complete first: a round after a server's restart
            # must find what the round before stored, however slow the machine is.
            llm.collective_rpc(faults.settle)
        fault = (spec.get("faults") or {}).get(str(index))
        if fault:
            llm.collective_rpc(faults.arm, args=(fault, spec["fault_store"]))
        if index in spec.get("reset_prefix_cache_rounds", ()):
            # vLLM's own prefix cache emptied (a KV connector's store kept): what this round reuses
            # comes from the connector alone.
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        params = cold if index in spec.get("cold_rounds", ()) else sampling
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        rounds.append([output_record(output) for output in outputs])
        if spec.get("crash_after_round") == index:  # a crash, writes in flight: the whole process group at once
            os.killpg(0, signal.SIGKILL)
        if fault:
            faults_met.append(all(llm.collective_rpc(faults.disarm)))
            if fault.partition("@")[0] in ("kill", "rmdir"):
                faults.restart(spec["fault_store"])
                llm.collective_rpc(faults.wait_until_healthy)
    metrics = {metric.name: metric.value for metric in llm.get_metrics() if hasattr(metric, "value")}
    workers = llm.collective_rpc(worker_report)
    result = {
        "rounds": rounds,
        "metrics": {name: value for name, value in metrics.items() if "prefix_cache" in name or "preemption" in name},
        "faults_met": faults_met,
        "fault_counts": llm.collective_rpc(faults.worker_counts) if spec.get("faults") else None,
        "workers": workers,
        "kv_oracle": llm.collective_rpc(kv_oracle.report) if spec.get("kv_oracle") else None,
        "skipped_groups": llm.collective_rpc(skipped_groups.report) if spec.get("skip_groups") else None,
        "poisoned": poisoned,
        "seconds": {"start": ready - started, "total": time.monotonic() - started},
    }
    with open(out_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # The result is written: skip vLLM's shutdown, which waits seconds for its
    # engine core to exit; the harness kills the run's process group anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
