"""Configurations the overlay cannot serve exactly stop the real engine at start, naming the setting.

Stack D.  Each case is one engine start that fails before any prompt runs (no
baseline run is needed), so the cases cost an engine start each, not a round.
"""

from __future__ import annotations

import pytest

from tests.engine.harness import EngineRunError, run_engine
from tests.engine.models import MODELS, build


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-models-refusals")


def test_chunk_size_that_ends_inside_a_block_stops_the_engine_before_its_weights_load(model_dir):
    """LMCache chunk_size 200 against vLLM's 128-token blocks, hybrid manager off (LMCache's one-group path).

    Loads not ending on a block boundary gave other tokens than vLLM alone. vLLM's CPU platform
    fixes the block size while vLLM builds its config, so the refusal comes then, in the process
    that builds it: once, with no weights loaded and no engine process started.
    """
    spec = {
        "model": str(build(MODELS["gemma3-sliding128"], model_dir)),
        "rounds": [[[5] * 300]],
        "lmcache": True,
        "disable_hybrid_kv_cache_manager": True,
        "env": {"LMCACHE_CHUNK_SIZE": "200", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
                "VLLM_LOGGING_LEVEL": "INFO"},
    }
    with pytest.raises(EngineRunError) as raised:
        run_engine(spec)
    log = raised.value.log
    assert "LMCache chunk_size=200 does not fit the KV-cache block sizes 128" in log, log[-3000:]
    assert "set chunk_size to 128 or 256" in log, log[-3000:]
    assert log.count("does not fit the KV-cache block sizes") == 1, log[-6000:]
    # What vLLM logs at INFO once its weights are in, and as its engine core process starts.
    assert "Loading weights took" not in log and "EngineCore" not in log, log[-6000:]


def test_a_bad_flag_stops_an_llm_script_that_uses_lmcache(model_dir):
    """``LMCACHE_ASCEND_BUNDLE_MULTI_SPEC=2`` with LMCache's connector configured: the script's
    ``vllm.LLM(...)`` raises naming the flag, its value and what is allowed, when the worker first
    imports LMCache's connector; it never runs without the overlay (which would store and find
    nothing, each request waiting on LMCache)."""
    spec = {
        "model": str(build(MODELS["gemma3-sliding128"], model_dir)),
        "rounds": [[[5] * 300]],
        "lmcache": True,
        "env": {"LMCACHE_ASCEND_BUNDLE_MULTI_SPEC": "2"},
    }
    with pytest.raises(EngineRunError) as raised:
        run_engine(spec)
    log = raised.value.log
    assert ("FlagError: invalid lmcache-ascend flag: LMCACHE_ASCEND_BUNDLE_MULTI_SPEC='2' is not a boolean; "
            "allowed: 1/0, true/false, yes/no, on/off") in log, log[-4000:]
    assert "No supported cpu connector found" not in log, "LMCache started without the overlay"
