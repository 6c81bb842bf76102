"""A real LMCache engine over a real remote backend (``fs://``, LMCache's file connector):
sealed chunks round-trip byte-exactly, damaged ones are misses, never bytes in the caches.

The DeepSeek-V4-like caches of `tests.fixtures` are stored as three chunks through the
engine's remote backend only (no local CPU cache: every load reads the files). Then one
chunk file is damaged on disk (bytes flipped, cut short, or removed) and the same tokens
are retrieved into caches poisoned with 0x5A: the chunks before the damaged one arrive
byte-exact, the damaged one and those after it are not loaded (every byte of their
slots keeps the poison) and lookups stop at it from then on. With the seal patch off
(the control), the flipped chunk is loaded as if whole.
"""

from __future__ import annotations

import time

import pytest
import torch

from lmcache_ascend.patches import State, registry
from tests.e2e.test_engine_roundtrip import (  # noqa: F401 - fixtures
    CHUNK,
    NUM_TOKENS,
    _engine,
    _plan,
    _slot_mappings,
    config_and_groups,
    metadata_patch,
)
from tests.fixtures.kv_caches import assert_bytes_equal, dsv4_ascend_kv_caches, expected_after_roundtrip

SEAL_PATCH = "lmcache-remote-chunk-seal"


@pytest.fixture
def seal_patch():
    assert registry.apply_now(SEAL_PATCH) is State.APPLIED, registry.record(SEAL_PATCH).reason
    yield
    registry.revert(SEAL_PATCH)


def _remote_engine(tmp_path):
    return _engine(None, local_cpu=False, max_local_cpu_size=0.05, remote_url=f"fs://host:0/{tmp_path}",
                   remote_serde="naive")


def _wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s} s")
        time.sleep(0.05)


def _chunk_files(tmp_path) -> list:
    return list(tmp_path.rglob("*.data"))


def _file_of_chunk(engine, tokens, tmp_path, index: int):
    """The file LMCache's file connector keeps the `index`-th chunk of `tokens` in (its name holds the key)."""
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
    (path,) = [path for path in _chunk_files(tmp_path) if keys[index].to_string() in path.name.replace("-SEP-", "/")]
    return path


def _store_and_reload(tmp_path, config_and_groups, damage):
    """Store three chunks, damage one file with `damage(path)`, retrieve into poisoned caches:
    (tokens retrieved, tokens the lookup finds after, the target's bytes expected had only the
    first chunk been loaded, the target caches)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    kv_cache_config, kv_groups = config_and_groups
    source = dsv4_ascend_kv_caches("random", seed=3)
    target = dsv4_ascend_kv_caches("poison")
    first_chunk_only = expected_after_roundtrip(source, dsv4_ascend_kv_caches("poison"), _slot_mappings(kv_groups),
                                                kv_groups, kv_cache_config, CHUNK, CHUNK)
    slot_mappings = _slot_mappings(kv_groups)
    tokens = torch.arange(NUM_TOKENS)
    instance_id, engine = _remote_engine(tmp_path)
    try:
        _plan(engine, source, kv_cache_config, kv_groups)
        engine.store(tokens, slot_mappings_by_group=slot_mappings)
        _wait_for(lambda: len(_chunk_files(tmp_path)) == NUM_TOKENS // CHUNK and engine.lookup(tokens) == NUM_TOKENS,
                  "the three chunks were not written")
        damage(_file_of_chunk(engine, tokens, tmp_path, 1))
        _plan(engine, target, kv_cache_config, kv_groups)
        retrieved = int(engine.retrieve(tokens, slot_mappings_by_group=slot_mappings).sum())
        found_after = engine.lookup(tokens)
        return retrieved, found_after, first_chunk_only, target
    finally:
        LMCacheEngineBuilder.destroy(instance_id)


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(byte ^ 0xFF for byte in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _cut(path) -> None:
    path.write_bytes(path.read_bytes()[:-4096])


@pytest.mark.parametrize("damage", [_flip, _cut, lambda path: path.unlink()], ids=["flipped", "cut-short", "removed"])
def test_a_damaged_chunk_is_a_miss_and_never_reaches_the_caches(metadata_patch, seal_patch, config_and_groups,
                                                                tmp_path, damage):
    retrieved, found_after, first_chunk_only, target = _store_and_reload(tmp_path, config_and_groups, damage)
    assert retrieved == CHUNK, f"retrieved {retrieved} tokens; only the chunk before the damaged one is whole"
    assert found_after == CHUNK, f"the lookup after the failed load finds {found_after} tokens, not {CHUNK}"
    # Every byte: the first chunk's slots hold the source's, every other byte the poison.
    assert_bytes_equal(target.storages, first_chunk_only)


def test_without_the_seal_flipped_bytes_reach_the_caches(metadata_patch, config_and_groups, tmp_path):
    assert registry.record(SEAL_PATCH).state is not State.APPLIED
    retrieved, *_ = _store_and_reload(tmp_path, config_and_groups, _flip)
    assert retrieved == NUM_TOKENS, "with the check off the damaged chunk is loaded as if whole"
