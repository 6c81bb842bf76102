"""A shared KV store that loses, truncates or damages chunks never kills the engine or its outputs.

Stack D (vLLM's CPU build + LMCache 0.5.6), LMCache in process with no local CPU
backend: every chunk comes from a real Redis server (LMCache's Redis connector) or
LMCache's own server (``lm://``), vLLM's own prefix caching off (so every reuse is
LMCache's) and ``kv_load_failure_policy: recompute``. Round 0 stores the first round
of `test_engine_reuse` (A, B, L, C); every later round asks the same prompts again,
and its first load meets a fault done to the store after the scheduler looked the
chunks up (`tests.engine.faults`): a flush, a deleted chunk, values truncated (with
the metadata's length kept, or made to agree), every byte flipped, the server killed
(and restarted, empty, before the next round; LMCache's server also at a store).

For every round: the engine answers (it is alive after each fault), every output
equals the no-connector engine's (tokens exact, logprobs as in the other engine
tests), and the fault was met. Damaged values are caught by the seal check (counted in
the worker); with the check off (the control), flipped values reach vLLM's cache and
the outputs differ, so the check is what keeps them right. Models: the Gemma-style
hybrid with the hybrid manager on (two KV-cache groups) and off (one), the 3:1 sliding
model (four groups), the full-attention control; and Redis evicting under ``maxmemory``
with no fault injected.
"""

from __future__ import annotations

import shutil

import pytest

from tests.engine.harness import redis_server, remote_server, run_engine
from tests.engine.test_engine_reuse import (  # noqa: F401 - model_dir is a fixture
    LOGPROB_TOLERANCE,
    ROUNDS,
    _spec,
    model_dir,
)

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="no redis-server on PATH (Debian's redis-server package; scripts/test installs it as root)",
)

PROMPTS = ROUNDS[0]
REDIS_FAULTS = ("flushall", "delete-one", "truncate", "truncate-consistent", "xor", "kill")
# A fault whose bytes reach vLLM's cache without the seal check. (Values cut short with their
# metadata's length cut too are caught the same way, but without the check what fills the rest
# of the buffer is whatever LMCache's allocator held, often the same chunk read before.)
DAMAGING = ("xor",)
# Distinct chunk prefixes of `PROMPTS` (A and B share their first two chunks, L, C): a round of
# damaged values fails at least the first chunk of each.
PREFIX_FAMILIES = 3


def _fault_run(model_dir, model: str, store: dict, faults: tuple, **options) -> dict:
    """One engine asked `PROMPTS` once per entry of `faults` (None: no fault in that round)."""
    env = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_REMOTE_SERDE": "naive",
           "LMCACHE_REMOTE_URL": f"redis://127.0.0.1:{store['redis']}" if "redis" in store
           else f"lm://127.0.0.1:{store['lm']}",
           **options.pop("env", {})}
    spec = _spec(model_dir, model, lmcache=True, env=env, rounds=[PROMPTS] * len(faults),
                 kv_load_failure_policy="recompute", kv_oracle=False,
                 faults={str(index): fault for index, fault in enumerate(faults) if fault}, fault_store=store, **options)
    return run_engine(spec)


def _baseline(model_dir, model: str) -> list[dict]:
    """The no-connector engine's outputs for `PROMPTS` (the reuse tests' baseline run, shared)."""
    return run_engine(_spec(model_dir, model, lmcache=False))["rounds"][0]


def _differences(baseline: list[dict], outputs: list[dict]) -> list[int]:
    """Indices of the prompts whose tokens differ from the baseline's, or whose logprobs stray."""
    return [index for index, (expected, got) in enumerate(zip(baseline, outputs, strict=True))
            if got["tokens"] != expected["tokens"]
            or max(abs(a - b) for a, b in zip(got["logprobs"], expected["logprobs"])) > LOGPROB_TOLERANCE]


def _assert_survived_every_fault(run: dict, baseline: list[dict], faults: tuple) -> None:
    injected = [fault for fault in faults if fault]
    assert run["faults_met"] == [True] * len(injected), f"a fault met no load: {dict(zip(injected, run['faults_met']))}"
    for index, (fault, outputs) in enumerate(zip(faults, run["rounds"], strict=True)):
        assert _differences(baseline, outputs) == [], f"round {index} ({fault}): outputs differ from the no-connector engine"


def _damaged(run: dict) -> int:
    return sum(worker["damaged_chunks"] for worker in run["fault_counts"] or [{"damaged_chunks": 0}])


@pytest.fixture(scope="module")
def redis_runs(model_dir):
    """The hybrid model's engine through every Redis fault, one engine per configuration; then the control."""
    runs = {}
    with redis_server() as port:  # (its last fault kills it: the restarted server ends with that engine)
        runs["hybrid"] = _fault_run(model_dir, "gemma3-sliding128", {"redis": port}, (None, *REDIS_FAULTS))
    with redis_server() as port:
        runs["seal off"] = _fault_run(model_dir, "gemma3-sliding128", {"redis": port}, (None, *DAMAGING),
                                      env={"LMCACHE_ASCEND_CHUNK_SEAL": "0"})
    with redis_server() as port:
        runs["hybrid off"] = _fault_run(model_dir, "gemma3-sliding128", {"redis": port},
                                        (None, "flushall", "xor", "truncate"), disable_hybrid_kv_cache_manager=True)
    return runs


def test_a_hybrid_model_survives_every_redis_fault_with_exact_outputs(model_dir, redis_runs):
    run = redis_runs["hybrid"]
    assert len(run["workers"][0]["groups"]) == 2, "the hybrid manager kept one group: the multi-group path was not run"
    _assert_survived_every_fault(run, _baseline(model_dir, "gemma3-sliding128"), (None, *REDIS_FAULTS))
    assert run["metrics"]["vllm:num_preemptions"] > 0, "no request was computed again after a failed load"
    damaging_rounds = sum(fault in ("truncate-consistent", "xor") for fault in REDIS_FAULTS)
    assert _damaged(run) >= damaging_rounds * PREFIX_FAMILIES, \
        f"{_damaged(run)} chunks failed their seal check: some truncated or flipped values went unseen"


def test_without_the_seal_damaged_chunks_reach_the_outputs(model_dir, redis_runs):
    """The control: the same damage with the check off gives other outputs, so the test above can fail."""
    run = redis_runs["seal off"]
    baseline = _baseline(model_dir, "gemma3-sliding128")
    assert _damaged(run) == 0
    for fault, outputs in zip(DAMAGING, run["rounds"][1:], strict=True):
        assert _differences(baseline, outputs), f"'{fault}' with the check off still gave the baseline's outputs"


def test_one_kv_cache_group_survives_through_vllms_own_recompute(model_dir, redis_runs):
    run = redis_runs["hybrid off"]
    assert len(run["workers"][0]["groups"]) == 1
    _assert_survived_every_fault(run, _baseline(model_dir, "gemma3-sliding128"), (None, "flushall", "xor", "truncate"))


@pytest.mark.parametrize("model", ["gemma3-sliding64-3to1", "llama-full"])
def test_other_layouts_survive_a_flush_and_flipped_bytes(model_dir, model):
    faults = (None, "flushall", "xor")
    with redis_server() as port:
        run = _fault_run(model_dir, model, {"redis": port}, faults)
    _assert_survived_every_fault(run, _baseline(model_dir, model), faults)


def test_redis_evicting_under_maxmemory_gives_exact_outputs(model_dir):
    """``allkeys-lru`` with room for a few chunks: Redis evicts while the engine stores and loads
    (a chunk's two keys apart, too), as a shared cache under memory pressure does."""
    import redis

    faults = (None, None, None)
    with redis_server("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru") as port:
        run = _fault_run(model_dir, "gemma3-sliding128", {"redis": port}, faults)
        evicted = redis.Redis(host="127.0.0.1", port=port).info("stats")["evicted_keys"]
    assert evicted > 0, "Redis evicted nothing: the store was not under pressure"
    _assert_survived_every_fault(run, _baseline(model_dir, "gemma3-sliding128"), faults)


def test_lmcache_server_killed_while_loading_and_while_storing(model_dir):
    """LMCache's own server killed at a warm round's first load, then at the next round's first
    store; restarted empty after each."""
    faults = (None, "kill", "kill@store", None)
    with remote_server() as port:
        run = _fault_run(model_dir, "gemma3-sliding128", {"lm": port}, faults)
    _assert_survived_every_fault(run, _baseline(model_dir, "gemma3-sliding128"), faults)
