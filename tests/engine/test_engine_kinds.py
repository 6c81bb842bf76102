"""The real engine per model kind: where reuse cannot be exact, LMCache supplies nothing.

Stack D (vLLM's CPU build + LMCache 0.5.6). Beside the attention models of
`test_engine_reuse`, kinds whose prefix LMCache must not supply here:

- MLA (DeepSeek-V2 style) on vLLM's reference CPU_MLA backend (asked for by name:
  on a CPU with AMX vLLM would pick AMX_MLA): vLLM's CPU platform turns its own
  prefix caching off for it (its computation over a cached prefix gives other
  tokens), so the overlay supplies no external prefix either;
- state-space hybrids (GraniteMoeHybrid, NemotronH: Mamba2 and attention
  layers; Falcon-H1: both in every layer; Qwen3-Next: gated delta-net beside
  attention, bfloat16) and a pure state-space model (Mamba2): such a layer's
  state is the state after a request's last token, not per-token KV, so no
  prefix can be restored exactly.

Each kind runs once without a connector and once with LMCache in process, on
rounds of one prompt each (vLLM's CPU MLA output depends on batching): A cold,
C (A with the second 256-token chunk of its 512-token chunk-aligned prefix redrawn: a
random-weight state-space layer forgets a prompt's first tokens), A warm, B (A's first 600 tokens + others).
LMCache must supply 0 tokens (vLLM's counters), load and store nothing (the
connector's counts of tokens, where the model's groups go through it), and every
output must equal the no-connector run;
C's output must differ from A's where the model's output follows that chunk (MLA).
With the overlay off (``LMCACHE_ASCEND_PATCHES=0``, vLLM choosing the hybrid
manager itself) each kind either gives the same outputs with nothing supplied
or does not start, as LMCache alone does on this stack.

Where vLLM keeps its own prefix caching for MLA (its AMX_MLA backend, on a CPU
with AMX tiles, bfloat16), LMCache supplies the prefix, and its reuse must give
exactly the tokens and logprobs of vLLM's own reuse of the same prefix: prompts
whose shared prefixes are whole chunks (256) and whole blocks (128), so both
caches supply the same tokens and the rest is computed in the same steps.
"""

from __future__ import annotations

import dataclasses
import platform

import pytest

from tests.engine.harness import EngineRunError, run_engine
from tests.engine.kv_oracle import assert_loaded_blocks_were_computed
from tests.engine.models import KIND_MODELS, MODELS, build
from tests.engine.test_engine_reuse import (  # noqa: F401 - model_dir is a fixture
    LMCACHE_ENV,
    LOGPROB_TOLERANCE,
    _assert_same_outputs,
    _groups,
    model_dir,
    token_drawer,
)


def _rounds(seed: int = 11) -> list[list[list[int]]]:
    tokens = token_drawer(seed)
    a = tokens(700)
    b = a[:600] + tokens(100)
    # A chunk LMCache would supply: the second of the two 256-token chunks A's prefix holds.
    control = a[:256] + tokens(256) + a[512:]
    return [[a], [control], [a], [b]]


ROUNDS = _rounds()
KINDS = list(KIND_MODELS)


# vLLM gives Qwen3-Next's attention group 640-token blocks (a page as large as its state
# group's); the connector refuses 256-token chunks there at start and names 640.
CHUNK_SIZES = {"qwen3-next": 640}


def _spec(model_dir, name: str, *, lmcache: bool, env: dict | None = None) -> dict:
    model = KIND_MODELS[name]
    spec = {"model": str(build(model, model_dir)), "rounds": ROUNDS, "lmcache": lmcache, "max_tokens": 8}
    if model.attention_backend:
        spec["attention_backend"] = model.attention_backend
    if model.dtype != "float32":
        spec["dtype"] = model.dtype
    if lmcache:
        chunk = {"LMCACHE_CHUNK_SIZE": str(CHUNK_SIZES[name])} if name in CHUNK_SIZES else {}
        spec["env"] = {**LMCACHE_ENV, **chunk, **(env or {})}
    return spec


def _tolerance(name: str) -> float:
    """Logprob tolerance. Two no-connector runs of the bfloat16 Qwen3-Next model were bitwise
    equal, but its runs with LMCache in process were not repeatable among themselves: logprobs
    1.1e-4 and 3.9e-3 from the baseline in two runs, tokens equal, while LMCache supplied and
    loaded nothing (so no reused byte entered them; the cause was not isolated)."""
    return LOGPROB_TOLERANCE if KIND_MODELS[name].dtype == "float32" else 2e-2


def _hits(run: dict) -> list[int]:
    return [output["num_cached_tokens"] for round_ in run["rounds"] for output in round_]


@pytest.mark.parametrize("name", KINDS)
def test_groups_vllm_makes(model_dir, name):
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    run = run_engine(_spec(model_dir, name, lmcache=True))
    expected = list(KIND_MODELS[name].expected_groups)
    assert _groups(baseline) == expected
    assert _groups(run) == expected, "LMCache must not change the KV-cache groups vLLM makes"


# The control needs a model whose output follows a cacheable prefix chunk. Two random-weight
# state-space models do not show it (GraniteMoeHybrid and Mamba2 gave the same tokens with that
# chunk redrawn): for them the evidence is that LMCache supplied and loaded nothing.
PREFIX_SENSITIVE_KINDS = ["deepseek-v2-mla", "nemotron-h", "falcon-h1", "qwen3-next"]


@pytest.mark.parametrize("name", PREFIX_SENSITIVE_KINDS)
def test_model_output_follows_a_cacheable_chunk(model_dir, name):
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    a, control = baseline["rounds"][0][0], baseline["rounds"][1][0]
    assert a["tokens"] != control["tokens"], f"{name}: output does not depend on a cacheable chunk of the prompt"


@pytest.mark.parametrize("name", KINDS)
def test_no_prefix_supplied_and_baseline_outputs(model_dir, name):
    baseline = run_engine(_spec(model_dir, name, lmcache=False))
    run = run_engine(_spec(model_dir, name, lmcache=True))
    (worker,) = run["workers"]
    assert worker["kv_connector"] is not None, "the run had no KV connector: it would prove nothing"
    assert _hits(run) == [0] * len(ROUNDS), f"LMCache supplied a prefix: {_hits(run)}"
    assert run["metrics"].get("vllm:external_prefix_cache_hits", 0) == 0
    connector = worker["connector"] or {}
    assert not connector.get("tokens_loaded"), f"KV was loaded into the paged cache: {connector}"
    assert not connector.get("tokens_stored"), f"chunks no engine can reuse were stored: {connector}"
    _assert_same_outputs(baseline, run, _tolerance(name))


# LMCache without the overlay: vLLM turns its hybrid manager off for a connector that is
# not SupportsHMA, and a model mixing state-space and attention layers then cannot start.
OVERLAY_OFF_REFUSED = {
    name: "Failed to promote local KV cache specs to one unified type"
    for name in ("granite-hybrid", "nemotron-h", "falcon-h1", "qwen3-next")
}


@pytest.mark.parametrize("name", KINDS)
def test_overlay_off_as_lmcache_alone(model_dir, name):
    spec = _spec(model_dir, name, lmcache=True, env={"LMCACHE_ASCEND_PATCHES": "0"})
    spec["disable_hybrid_kv_cache_manager"] = None  # vLLM's choice, as a user's engine makes it
    if name in OVERLAY_OFF_REFUSED:
        with pytest.raises(EngineRunError, match=OVERLAY_OFF_REFUSED[name]):
            run_engine(spec)
        return
    run = run_engine(spec)
    assert _hits(run) == [0] * len(ROUNDS), f"LMCache alone supplied {_hits(run)}"
    _assert_same_outputs(run_engine(_spec(model_dir, name, lmcache=False)), run, _tolerance(name))


def _amx_tiles() -> bool:
    import torch

    return platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()


# vLLM's CPU worker reserves one more core where a KV connector is configured, so the engine with
# LMCache would compute with fewer OpenMP threads than the one without, which changes float
# rounding (tokens stay equal, logprobs move by about 1e-5) before any reuse: one reserved core
# for both, as the README's CPU launch sets, makes every output comparable bit for bit.
SAME_THREADS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def _own_reuse_rounds(redrawn_chunk: int, seed: int = 11) -> list[list[list[int]]]:
    """A (600 tokens: vLLM's cache and LMCache both hold 512 of it), C (A with one 256-token chunk
    of that prefix redrawn), A, B (A's 512 + others)."""
    tokens = token_drawer(seed)
    a = tokens(600)
    start = redrawn_chunk * 256
    control = a[:start] + tokens(256) + a[start + 256:]
    return [[a], [control], [a], [a[:512] + tokens(150)]]


def _assert_reuse_equals_vllms_own(model_dir, model, rounds, expected_hits, **options) -> int:
    """LMCache's reuse (vLLM's own caching off) against vLLM's own reuse (no connector) of the
    same prefixes: the same tokens supplied, and bitwise the same tokens and logprobs; returns
    how many loaded blocks the KV oracle found equal to vLLM's own computation."""
    spec = {"model": str(build(model, model_dir)), "rounds": rounds, "max_tokens": 8, "dtype": "bfloat16", **options}
    own = run_engine({**spec, "lmcache": False, "enable_prefix_caching": True, "env": SAME_THREADS})
    run = run_engine({**spec, "lmcache": True, "env": {**LMCACHE_ENV, **SAME_THREADS}, "kv_oracle": True})
    assert own["workers"][0]["omp_threads"] == run["workers"][0]["omp_threads"]
    own_hits = _hits(own)
    assert own_hits == expected_hits, f"vLLM's own cache supplied {own_hits}: the prompts no longer fit the test"
    assert _hits(run) == own_hits, "LMCache must supply the prefixes vLLM's own cache supplies"
    assert run["metrics"]["vllm:external_prefix_cache_hits"] == sum(own_hits)
    (worker,) = run["workers"]
    assert worker["connector"]["tokens_loaded"] == sum(own_hits), worker["connector"]
    outputs = [output for round_ in run["rounds"] for output in round_]
    references = [output for round_ in own["rounds"] for output in round_]
    assert references[0]["tokens"] != references[1]["tokens"], "the output does not follow the redrawn chunk"
    for index, (output, reference) in enumerate(zip(outputs, references, strict=True)):
        assert output["tokens"] == reference["tokens"], f"prompt {index}: tokens differ from vLLM's own reuse"
        assert output["logprobs"] == reference["logprobs"], f"prompt {index}: logprobs differ from vLLM's own reuse"
    prompts = [prompt for round_ in rounds for prompt in round_]
    (records,) = run["kv_oracle"]
    return assert_loaded_blocks_were_computed(records, prompts, _hits(run))


AMX_MLA = dataclasses.replace(KIND_MODELS["deepseek-v2-mla"], attention_backend="AMX_MLA")


@pytest.mark.skipif(not _amx_tiles(), reason="vLLM's AMX_MLA backend (the one keeping prefix caching on) needs AMX tiles")
def test_mla_reuse_equals_vllms_own_where_vllm_keeps_it(model_dir):
    checked = _assert_reuse_equals_vllms_own(model_dir, AMX_MLA, _own_reuse_rounds(redrawn_chunk=1), [0, 256, 512, 512],
                                             attention_backend="AMX_MLA")
    assert checked == 2 * (256 + 512 + 512) // 128  # two layers, every 128-token block supplied


def test_bfloat16_hybrid_reuse_equals_vllms_own(model_dir):
    """The Gemma-style hybrid (two KV-cache groups) in bfloat16, the dtype users serve in: where
    both caches supply the same prefix, LMCache's reuse gives vLLM's own reuse's outputs exactly.

    vLLM keeps a sliding-window group's blocks cached at the latest boundary of a prompt only, so
    its own cache supplies no part of a prompt that leaves A after 256 tokens: the control redraws
    A's first chunk instead, and neither cache supplies anything for it."""
    checked = _assert_reuse_equals_vllms_own(model_dir, MODELS["gemma3-sliding128"],
                                             _own_reuse_rounds(redrawn_chunk=0), [0, 0, 512, 512])
    assert checked > 0
