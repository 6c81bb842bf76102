"""The log says at start which chunk hash is in force and which KV-cache groups move.

LMCache's real token database (patched by ``lmcache-stable-token-hash``): where the
overlay's stable hash takes over, LMCache's stale advice to set PYTHONHASHSEED (and its
per-process chain start) is not logged and one line names the hash in force; with a
fixed PYTHONHASHSEED LMCache's own hash and its own messages stay.  The worker's
registration (LMCache's real adapter, patched) logs one start line naming the overlay's
version, the hash and the groups moved and skipped.
"""

from __future__ import annotations

import logging

import pytest

from lmcache_ascend.patches import State, registry
from tests.e2e.test_adapter_worker_path import (  # noqa: F401  (fixtures used by name)
    _engine,
    _worker,
    fixture_backend_dims,
    patches,
    pipeline_group,
)
from tests.fixtures.kv_cache_configs import dsv4_ascend_kv_cache_config
from tests.fixtures.kv_caches import dsv4_ascend_kv_caches
from tests.patching import apply_now

REGISTRY = registry.process_registry()
HASH_PATCH = "lmcache-stable-token-hash"


class Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def collected():
    """Records of LMCache's token-database and adapter loggers (they do not propagate to the root)."""
    from lmcache.integration.vllm import vllm_v1_adapter
    from lmcache.v1 import token_database

    handler = Collected()
    loggers = [token_database.logger, logging.getLogger(vllm_v1_adapter.__name__)]
    saved = [(log, log.level) for log in loggers]
    for log in loggers:
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    yield handler
    for log, level in saved:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
def hash_patch():
    assert apply_now(REGISTRY, HASH_PATCH) is State.APPLIED, REGISTRY.record(HASH_PATCH).reason
    yield
    REGISTRY.revert(HASH_PATCH)


def _token_database():
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.token_database import ChunkedTokenDatabase

    return ChunkedTokenDatabase(LMCacheEngineConfig.from_defaults(chunk_size=256), None)


def test_stale_seed_advice_is_replaced_by_the_hash_in_force(hash_patch, collected, monkeypatch):
    from lmcache_ascend.token_hash import stable_token_hash

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    database = _token_database()
    assert database.hash_func is stable_token_hash
    assert not any("PYTHONHASHSEED=0" in m or "MUST set" in m or "NONE_HASH" in m for m in collected.messages), collected.messages
    assert [m for m in collected.messages if "lmcache-stable-token-hash" in m] == [
        "lmcache-ascend: chunks are keyed by lmcache-stable-token-hash, the same in every process: PYTHONHASHSEED is "
        "not needed (LMCache's own hash would be Python's salted hash())"
    ]
    assert any("Using hash algorithm" in m for m in collected.messages)  # other lines still pass


def test_with_a_fixed_seed_lmcache_keeps_its_hash_and_its_messages(hash_patch, collected, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    database = _token_database()
    assert database.hash_func is hash
    assert any("Using builtin hash" in m for m in collected.messages), collected.messages
    assert any("NONE_HASH" in m for m in collected.messages), collected.messages
    assert not any("lmcache-stable-token-hash" in m for m in collected.messages)


def test_registration_logs_one_start_line(patches, hash_patch, collected, monkeypatch):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    import lmcache_ascend
    from lmcache_ascend.connector import install

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(install, "_started", [])
    config, engine = _engine()
    try:
        for _ in range(2):  # a second registration in the process logs nothing more
            _worker(dsv4_ascend_kv_cache_config(), config, engine).register_kv_caches(
                dsv4_ascend_kv_caches("zeros").kv_caches
            )
        lines = [m for m in collected.messages if m.startswith("lmcache-ascend ")]
        assert len(lines) == 1, collected.messages
        line = lines[0]
        assert line.startswith(
            f"lmcache-ascend {lmcache_ascend.__version__} active: chunk keys by lmcache-stable-token-hash (SHA-256, "
            "the same in every process); KV-cache groups moved: 0 C4AttnKV (block 512, compress ratio 4), "
            "1 C128AttnKV (block 16384, compress ratio 128), 2 C1AttnKV (block 128), 3 C4IndexerKV "
        ), line
        # The compressor-state groups are moved by default: nothing is skipped.
        assert "4 C4AttnKVState (block 128), " in line
        assert "8 C128SlidingWindowKV (block 16384, compress ratio 128, window 128), " in line
        assert "10 C128AttnScoreState (block 128); skipped: none; " in line
        assert line.endswith("transfers by lmcache-ascend's MultiGroupGPUConnector")
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")
