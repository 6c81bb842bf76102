"""The real engine: vLLM with LMCache reusing KV gives the tokens vLLM gives alone.

Stack D (vLLM's CPU build + LMCache 0.5.6).  Each model runs once without a KV
connector (the baseline) and once with LMCache in process (``LMCacheConnectorV1``,
local CPU backend, 256-token chunks, vLLM's own prefix caching off), on the same
rounds of prompts:

1. cold: A (700 tokens), B (A's first 600 + 100 others), L (1400 tokens, more
   than ten 128-token windows), C (A with its first token changed), one batch;
2. warm: the same four again, each now found in LMCache;
3. shared prefixes: A's first 600 and L's first 300 tokens under new tails.

Every output token must equal the baseline's (logprobs within 1e-4), and vLLM's
own counters must show LMCache supplying exactly the chunk-aligned prefixes.
Control C proves the models see every cached token: its output differs from A's.
"""

from __future__ import annotations

import math
import random

import pytest

from tests.engine.harness import run_engine
from tests.engine.kv_oracle import assert_loaded_blocks_were_computed
from tests.engine.models import MODELS, build

CHUNK = 256
LOGPROB_TOLERANCE = 1e-4


def token_drawer(seed: int):
    """`tokens(count)`: `count` random token ids of the tiny models' vocabulary, from `seed`."""
    draw = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [draw.randrange(3, 500) for _ in range(count)]

    return tokens


def _prompts(seed: int = 7) -> list[list[list[int]]]:
    tokens = token_drawer(seed)
    a, long = tokens(700), tokens(1400)
    b = a[:600] + tokens(100)
    control = [(a[0] + 1) % 500 or 3] + a[1:]
    return [[a, b, long, control], [a, b, long, control], [a[:600] + tokens(150), long[:300] + tokens(400)]]


ROUNDS = _prompts()
# vLLM computes at least the last prompt token itself, so LMCache serves at most
# floor((len - 1) / chunk) chunks of a prompt it holds whole.
EXPECTED_WARM_HITS = [[(len(p) - 1) // CHUNK * CHUNK for p in ROUNDS[1]], [512, 256]]

LMCACHE_ENV = {
    "LMCACHE_CHUNK_SIZE": str(CHUNK),
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models")


def _spec(model_dir, name: str, *, lmcache: bool, env: dict | None = None, **options) -> dict:
    spec = {"model": str(build(MODELS[name], model_dir)), "rounds": ROUNDS, "lmcache": lmcache, **options}
    if lmcache:
        spec["env"] = {**LMCACHE_ENV, **(env or {})}
        spec.setdefault("kv_oracle", True)
        spec.setdefault("engine_core", "process")  # the layout users run: scheduler and worker apart
    return spec


def _assert_same_outputs(baseline: dict, run: dict, tolerance: float = LOGPROB_TOLERANCE) -> None:
    for round_index, (expected_round, got_round) in enumerate(zip(baseline["rounds"], run["rounds"], strict=True)):
        for prompt_index, (expected, got) in enumerate(zip(expected_round, got_round, strict=True)):
            where = f"round {round_index + 1}, prompt {prompt_index}"
            assert got["tokens"] == expected["tokens"], f"{where}: tokens differ from the no-connector baseline"
            worst = max(abs(x - y) for x, y in zip(got["logprobs"], expected["logprobs"], strict=True))
            assert worst <= tolerance, f"{where}: logprobs differ by {worst:.2e}"


def _hits(run: dict, round_index: int) -> list[int]:
    return [output["num_cached_tokens"] for output in run["rounds"][round_index]]


def _groups(run: dict) -> list[str]:
    (worker,) = run["workers"]
    return [group["spec"] for group in worker["groups"]]


MODEL_NAMES = list(MODELS)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_sees_every_cached_token(model_dir, name):
    """Control: A with only its first token changed gives other tokens."""
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    a, control = baseline["rounds"][0][0], baseline["rounds"][0][3]
    assert a["tokens"] != control["tokens"], f"{name}: output does not depend on the first prompt token"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_lmcache_reuse_gives_baseline_tokens(model_dir, name):
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    run = run_engine(_spec(model_dir, name, lmcache=True))
    assert sum(_hits(run, 1)) > 0, "nothing was reused: the comparison would prove nothing"
    _assert_same_outputs(baseline, run)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loaded_kv_is_what_vllm_computed(model_dir, name):
    """Every block LMCache filled holds the bytes vLLM computed for the same tokens (`kv_oracle`)."""
    run = run_engine(_spec(model_dir, name, lmcache=True))
    prompts = [prompt for round_ in ROUNDS for prompt in round_]
    supplied = [hit for index in range(len(ROUNDS)) for hit in _hits(run, index)]
    (records,) = run["kv_oracle"]
    checked = assert_loaded_blocks_were_computed(records, prompts, supplied)
    layers = {name for group in run["workers"][0]["groups"] for name in group["layers"]}
    assert checked >= len(layers) * 3, f"only {checked} loaded blocks were checked"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_lmcache_supplies_the_chunk_aligned_prefix(model_dir, name):
    run = run_engine(_spec(model_dir, name, lmcache=True))
    cold = _hits(run, 0)
    # Cold: only B can hit, on A's first two chunks, when vLLM scheduled B's
    # lookup after A's store (both orders are vLLM's to choose).
    assert cold[0] == cold[2] == cold[3] == 0 and cold[1] in (0, 512), cold
    assert _hits(run, 1) == EXPECTED_WARM_HITS[0]
    assert _hits(run, 2) == EXPECTED_WARM_HITS[1]
    # vLLM's own counter of tokens supplied by the KV connector agrees.
    assert run["metrics"]["vllm:external_prefix_cache_hits"] == sum(cold + EXPECTED_WARM_HITS[0] + EXPECTED_WARM_HITS[1])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_hybrid_manager_kept_with_lmcache(model_dir, name):
    model = MODELS[name]
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    run = run_engine(_spec(model_dir, name, lmcache=True))
    assert _groups(baseline) == list(model.expected_groups)
    assert _groups(run) == list(model.expected_groups), "LMCache must not turn vLLM's hybrid KV-cache manager off"
    (worker,) = run["workers"]
    assert worker["connector"]["launches"] > 0


def test_hybrid_manager_disabled(model_dir):
    """With vLLM's hybrid manager off every layer is one full-attention group."""
    name = "gemma3-sliding128"
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    run = run_engine(_spec(model_dir, name, lmcache=True, disable_hybrid_kv_cache_manager=True))
    assert _groups(run) == ["FullAttentionSpec"]
    assert _hits(run, 1) == EXPECTED_WARM_HITS[0]
    _assert_same_outputs(baseline, run)


def test_eviction_under_a_tiny_buffer(model_dir):
    """A 3 MB LMCache buffer holds 8 of the 384 KiB chunks; the cold round stores 9.

    The least recently used (A's first chunk) is evicted: A is recomputed, L's
    chunks (looked up before the warm round stores anything) are still reused,
    and every token still equals the baseline.
    """
    name = "gemma3-sliding128"
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    full = run_engine(_spec(model_dir, name, lmcache=True))
    tiny = run_engine(_spec(model_dir, name, lmcache=True, env={"LMCACHE_MAX_LOCAL_CPU_SIZE": "0.003"}))
    reused = sum(_hits(tiny, 1))
    assert 0 < reused < sum(_hits(full, 1)), f"tiny buffer reused {reused} tokens"
    _assert_same_outputs(baseline, tiny)


def test_reuse_while_the_storing_request_still_runs(model_dir):
    """B loads A's chunks while A is still decoding in the same batch.

    With 700 batched tokens per step vLLM prefills A alone, stores its chunks,
    then schedules B (which finds 512 tokens) beside A's first decode step.  The
    64-token window fills half of a 128-token block: a load of the window's rows
    alone left the block's other rows as another request had left them, and B's
    output went wrong (found on this model; fixed by loading whole blocks).
    """
    name = "gemma3-sliding64-3to1"
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    a, b = ROUNDS[0][0], ROUNDS[0][1]
    spec = _spec(model_dir, name, lmcache=True, max_num_batched_tokens=700)
    spec["rounds"] = [[a, b]]
    run = run_engine(spec)
    assert _hits(run, 0) == [0, 512]
    expected = {"rounds": [baseline["rounds"][0][:2]]}
    _assert_same_outputs(expected, run)
