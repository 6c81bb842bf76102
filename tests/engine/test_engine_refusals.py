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


def test_chunk_size_that_ends_inside_a_block_stops_the_engine(model_dir):
    """LMCache chunk_size 200 against vLLM's 128-token blocks, hybrid manager off (LMCache's one-group path).

    Loads not ending on a block boundary gave other tokens than vLLM alone; the connector refuses to start.
    """
    spec = {
        "model": str(build(MODELS["gemma3-sliding128"], model_dir)),
        "rounds": [[[5] * 300]],
        "lmcache": True,
        "disable_hybrid_kv_cache_manager": True,
        "env": {"LMCACHE_CHUNK_SIZE": "200", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"},
    }
    with pytest.raises(EngineRunError) as raised:
        run_engine(spec)
    log = str(raised.value)
    assert "LMCache chunk_size=200 does not fit the KV-cache block sizes 128" in log, log[-3000:]
    assert "set chunk_size to 128 or 256" in log, log[-3000:]
