"""A KV store that loses, truncates or damages chunks never kills the engine or its outputs.

Stack D (vLLM's CPU build + LMCache 0.5.6), LMCache in process with no local CPU
backend: every chunk comes from a real Redis server (LMCache's Redis connector),
LMCache's own server (``lm://``), LMCache's file connector (``fs://``) or its local
disk backend; vLLM's own prefix caching off (so every reuse is LMCache's) and
``kv_load_failure_policy: recompute``. Round 0 stores the first round of
`test_engine_reuse` (A, B, L, C); every later round asks the same prompts again, and
its first load meets a fault done to the store after the scheduler looked the chunks
up (`tests.engine.faults`): a flush, a deleted chunk, values truncated (with the
metadata's length kept, or made to agree), every byte flipped, a chunk's metadata
emptied, the server killed (and restarted, empty, before the next round; LMCache's
server also at a store); files deleted, cut short, altered, the folder removed.
LMCache's MP server, through LMCache's own MP connector, is killed at a load and at a
store.

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
import threading

import pytest

from tests.engine.faults import REDIS_FAULTS
from tests.engine.harness import EngineRunError, mp_server, redis_server, remote_server, run_engine
from tests.engine.test_engine_mp import CONNECTORS, MP_LOGPROB_TOLERANCE
from tests.engine.test_engine_reuse import (  # noqa: F401 - model_dir is a fixture
    CHUNK,
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
# The hybrid engine's rounds over Redis: one before the faults, one per fault, and two after the
# last (the server killed): the restarted server gets the first's stores and supplies the second.
HYBRID_ROUNDS = (None, *REDIS_FAULTS, None, None)
# A fault whose bytes reach vLLM's cache without the seal check. (Values cut short with their
# metadata's length cut too are caught the same way, but without the check what fills the rest
# of the buffer is whatever LMCache's allocator held, often the same chunk read before.)
DAMAGING = ("xor",)


def _store_environment(store: dict) -> dict:
    """LMCache's settings for one store of `tests.engine.faults`."""
    if "disk" in store:
        return {"LMCACHE_LOCAL_DISK": f"file://{store['disk']}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    url = {"redis": "redis://127.0.0.1:{}", "lm": "lm://127.0.0.1:{}", "fs": "fs://localhost:0{}"}  # (0.5.6 needs a host and port, unused)
    kind = next(kind for kind in url if kind in store)
    return {"LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_REMOTE_URL": url[kind].format(store[kind])}


def _fault_run(model_dir, model: str, store: dict, faults: tuple, **options) -> dict:
    """One engine asked `PROMPTS` once per entry of `faults` (None: no fault in that round)."""
    env = {"LMCACHE_LOCAL_CPU": "False", **_store_environment(store), **options.pop("env", {}),
           # LMCache's health monitor turns a remote backend off for 300 s after 10 failed gets in one
           # 30-s check; these rounds fail more, and each of them must meet a load.
           "LMCACHE_EXTRA_CONFIG": '{"get_blocking_failed_threshold": 1000000}'}
    spec = _spec(model_dir, model, lmcache=True, env=env, rounds=[PROMPTS] * len(faults),
                 kv_load_failure_policy="recompute", kv_oracle=False,
                 faults={str(index): fault for index, fault in enumerate(faults) if fault}, fault_store=store, **options)
    return run_engine(spec)


def _baseline(model_dir, model: str) -> list[dict]:
    """The no-connector engine's outputs for `PROMPTS` (the reuse tests' baseline run, shared)."""
    return run_engine(_spec(model_dir, model, lmcache=False))["rounds"][0]


def _differences(baseline: list[dict], outputs: list[dict], tolerance: float = LOGPROB_TOLERANCE) -> list[int]:
    """Indices of the prompts whose tokens differ from the baseline's, or whose logprobs stray."""
    return [index for index, (expected, got) in enumerate(zip(baseline, outputs, strict=True))
            if got["tokens"] != expected["tokens"]
            or max(abs(a - b) for a, b in zip(got["logprobs"], expected["logprobs"])) > tolerance]


def _assert_survived_every_fault(run: dict, baseline: list[dict], faults: tuple,
                                 tolerance: float = LOGPROB_TOLERANCE) -> None:
    injected = [fault for fault in faults if fault]
    assert run["faults_met"] == [True] * len(injected), f"a fault met no load: {dict(zip(injected, run['faults_met']))}"
    for index, (fault, outputs) in enumerate(zip(faults, run["rounds"], strict=True)):
        assert _differences(baseline, outputs, tolerance) == [], \
            f"round {index} ({fault}): outputs differ from the no-connector engine"


def _damaged(run: dict) -> int:
    return sum(worker["damaged_chunks"] for worker in run["fault_counts"] or [{"damaged_chunks": 0}])


@pytest.fixture(scope="module")
def redis_runs(model_dir):
    """The hybrid model's engine through every Redis fault, one engine per configuration; then the control."""
    runs = {}
    with redis_server() as port:
        runs["hybrid"] = _fault_run(model_dir, "gemma3-sliding128", {"redis": port}, HYBRID_ROUNDS)
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
    _assert_survived_every_fault(run, _baseline(model_dir, "gemma3-sliding128"), HYBRID_ROUNDS)
    # The round after the restart stores every prompt's chunks in the new server (through connections
    # made again), and the last round loads them: every prompt of it is supplied.
    assert all(output["num_cached_tokens"] for output in run["rounds"][-1]), \
        "after the restart LMCache did not supply every prompt again: stores or lookups of the new server were lost"
    assert run["metrics"]["vllm:num_preemptions"] > 0, "no request was computed again after a failed load"
    # Each damaging round fails the first chunk of every prefix family it loads; a family whose key
    # still counts as failed from the round before (its store again not yet complete) is a miss there
    # and loads nothing, so a round may find fewer. Bytes that passed would have changed the outputs
    # (the control), and the outputs are equal.
    damaging_rounds = sum(fault in ("truncate-consistent", "xor") for fault in REDIS_FAULTS)
    assert _damaged(run) >= damaging_rounds, \
        f"{_damaged(run)} chunks failed their seal check: a round of truncated or flipped values went unseen"


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



# Each file store's faults, and those of them whose damage only the seal check finds (LMCache's file
# connector refuses a short file itself: it reads a length header first).
FILE_STORE_FAULTS = {"fs": (None, "delete-one", "truncate", "xor", "wipe", "rmdir", None),
                     "disk": (None, "delete-one", "truncate", "xor", "wipe", "rmdir", None)}
SEALS_FIND = {"fs": ("xor",), "disk": ("truncate", "xor")}


@pytest.mark.parametrize("kind", list(FILE_STORE_FAULTS))
def test_file_stores_survive_lost_damaged_and_removed_files(model_dir, tmp_path, kind):
    """``fs://`` (a remote backend) and LMCache's local disk backend, files damaged under the engine:
    one deleted, all cut short, all with bytes flipped, all deleted, the folder removed (made again,
    empty, before the last round)."""
    faults = FILE_STORE_FAULTS[kind]
    run = _fault_run(model_dir, "gemma3-sliding128", {kind: str(tmp_path / "chunks")}, faults)
    _assert_survived_every_fault(run, _baseline(model_dir, "gemma3-sliding128"), faults)
    assert run["metrics"]["vllm:num_preemptions"] > 0, "no request was computed again after a failed load"
    assert _damaged(run) >= len(SEALS_FIND[kind]), \
        f"{_damaged(run)} chunks failed their seal check: a round of cut or flipped files went unseen"


def test_lmcache_mp_server_killed_while_loading_and_while_storing(model_dir):
    """LMCache's MP server (its own connector, LMCache-driven transfer) killed at a round's first
    load, then at the next round's first store (the restarted server is empty: that round stores);
    restarted empty after each. The last round finds what the one before stored on the server
    restarted last: the adapter came back to it."""
    faults = (None, "kill", "kill@store", None, None)
    with mp_server(CHUNK) as port:
        spec = _spec(model_dir, "gemma3-sliding128", lmcache=False, rounds=[PROMPTS] * len(faults))
        spec.update(lmcache=True, kv_connector="LMCacheMPConnector", kv_load_failure_policy="recompute",
                    # (a heartbeat a second: the adapter finds the restarted server within a round)
                    kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                               "lmcache.mp.heartbeat_interval": 1.0},
                    env={"LMCACHE_MP_TRANSFER_MODE": "lmcache_driven", **CONNECTORS["lmcache"][1]},
                    wait_for_stores=True, faults={str(index): fault for index, fault in enumerate(faults) if fault},
                    fault_store={"mp": port, "chunk_size": CHUNK})
        run = run_engine(spec)
    _assert_survived_every_fault(run, _baseline(model_dir, "gemma3-sliding128"), faults, MP_LOGPROB_TOLERANCE)
    assert any(output["num_cached_tokens"] for output in run["rounds"][-1]), \
        "the restarted server supplied nothing: the engine never came back to it"


def test_two_engines_share_one_redis_while_one_crashes_and_restarts(model_dir):
    """Two engines of the hybrid model on one Redis at once: one asks `PROMPTS` round after round;
    the other asks them twice and is killed right after (its remote writes possibly in flight),
    starts again and asks them twice more. Both store the same chunks, each over the other's.
    Every output of both equals the no-connector engine's, and the restarted engine is supplied
    from what the two stored."""
    baseline = _baseline(model_dir, "gemma3-sliding128")  # (it builds the checkpoint the two threads read)
    steady: dict = {}
    with redis_server() as port:
        store = {"redis": port}
        def serve_steadily():
            try:
                steady["run"] = _fault_run(model_dir, "gemma3-sliding128", store, (None,) * 40)
            except BaseException as error:  # re-raised below, in the test's own thread
                steady["error"] = error

        thread = threading.Thread(target=serve_steadily)
        thread.start()
        try:
            with pytest.raises(EngineRunError, match="exited -9"):
                _fault_run(model_dir, "gemma3-sliding128", store, (None, None), crash_after_round=1)
            restarted = _fault_run(model_dir, "gemma3-sliding128", store, (None, None))
        finally:
            thread.join()
    if "error" in steady:
        raise steady["error"]
    _assert_survived_every_fault(steady["run"], baseline, (None,) * 40)
    _assert_survived_every_fault(restarted, baseline, (None, None))
    assert all(output["num_cached_tokens"] for output in restarted["rounds"][0]), \
        "the restarted engine's first round was not supplied from Redis"
