"""A real LMCache engine over its two file stores (``fs://``, LMCache's file connector, a remote
backend; and its local disk backend): sealed chunks round-trip byte-exactly, damaged ones are
misses, never bytes in the caches.

The DeepSeek-V4-like caches of `tests.fixtures` are stored as three chunks through the
one store (no local CPU cache: every load reads the files). Then one
chunk file is damaged on disk (bytes flipped, cut short, or removed) and the same tokens
are retrieved into caches poisoned with 0x5A: the chunks before the damaged one arrive
byte-exact, the damaged one and those after it are not loaded (every byte of their
slots keeps the poison) and lookups stop at it from then on. With the seal patch off
(the control), the flipped chunk is loaded as if whole.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
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
from tests.patching import apply_now

# A real Redis server, and redis-py for LMCache's Redis connector (LMCache installs it only with its full set).

REGISTRY = registry.process_registry()
NEEDS_REDIS = pytest.mark.skipif(
    shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None,
    reason="no redis-server on PATH, or no redis-py in this stack (LMCache's Redis connector needs it)",
)
SEAL_PATCHES = {"fs": "lmcache-remote-chunk-seal", "disk": "lmcache-disk-chunk-seal"}
# Each store's engine settings, and how it names a chunk's file after the chunk's key.
STORES = {
    "fs": (lambda folder: {"remote_url": f"fs://host:0/{folder}", "remote_serde": "naive"},
           lambda key: key.to_string().replace("/", "-SEP-") + ".data"),
    "disk": (lambda folder: {"local_disk": f"file://{folder}/", "max_local_disk_size": 0.1},
             lambda key: key.to_string().replace("/", "-") + ".pt"),
}


@pytest.fixture(params=list(STORES))
def store(request):
    return request.param


@pytest.fixture
def seal_patch(store):
    name = SEAL_PATCHES[store]
    assert apply_now(REGISTRY, name) is State.APPLIED, REGISTRY.record(name).reason
    yield
    REGISTRY.revert(name)


def _store_engine(store, tmp_path):
    return _engine(None, local_cpu=False, max_local_cpu_size=0.05, **STORES[store][0](tmp_path))


def _wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s} s")
        time.sleep(0.05)


@contextlib.contextmanager
def stored_over_redis(config_and_groups, source, slot_mappings, tokens):
    """A real LMCache engine over a fresh Redis server (LMCache's Redis connector, no local CPU cache)
    that has stored `tokens` of `source` and whose chunks are all written; yields the engine, a
    client of the server and its port."""
    import redis
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from tests.engine.harness import redis_server

    kv_cache_config, kv_groups = config_and_groups
    with redis_server() as port:
        client = redis.Redis(host="127.0.0.1", port=port)
        instance_id, engine = _engine(None, local_cpu=False, max_local_cpu_size=0.05,
                                      remote_url=f"redis://127.0.0.1:{port}", remote_serde="naive")
        try:
            _plan(engine, source, kv_cache_config, kv_groups)
            engine.store(tokens, slot_mappings_by_group=slot_mappings)
            _wait_for(lambda: len(client.keys(b"*kv_bytes")) == NUM_TOKENS // CHUNK
                      and engine.lookup(tokens) == NUM_TOKENS, "the three chunks were not written")
            yield engine, client, port
        finally:
            # LMCache 0.5.6's Redis connector shuts its job queue down from the event loop it then
            # waits on, which hangs: the remote backend is left open until the process ends.
            engine.storage_manager.storage_backends.pop("RemoteBackend", None)
            LMCacheEngineBuilder.destroy(instance_id)


def _chunk_files(tmp_path) -> list:
    return [path for path in tmp_path.rglob("*") if path.suffix in (".data", ".pt")]


def _file_of_chunk(store, engine, tokens, tmp_path, index: int):
    """The file the store keeps the `index`-th chunk of `tokens` in (its name holds the key)."""
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
    (path,) = [path for path in _chunk_files(tmp_path) if path.name == STORES[store][1](keys[index])]
    return path


def _store_and_reload(store, tmp_path, config_and_groups, damage):
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
    instance_id, engine = _store_engine(store, tmp_path)
    try:
        _plan(engine, source, kv_cache_config, kv_groups)
        engine.store(tokens, slot_mappings_by_group=slot_mappings)
        _wait_for(lambda: len(_chunk_files(tmp_path)) == NUM_TOKENS // CHUNK and engine.lookup(tokens) == NUM_TOKENS,
                  "the three chunks were not written")
        damage(_file_of_chunk(store, engine, tokens, tmp_path, 1))
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
def test_a_damaged_chunk_is_a_miss_and_never_reaches_the_caches(metadata_patch, store, seal_patch, config_and_groups,
                                                                tmp_path, damage):
    retrieved, found_after, first_chunk_only, target = _store_and_reload(store, tmp_path, config_and_groups, damage)
    assert retrieved == CHUNK, f"retrieved {retrieved} tokens; only the chunk before the damaged one is whole"
    assert found_after == CHUNK, f"the lookup after the failed load finds {found_after} tokens, not {CHUNK}"
    # Every byte: the first chunk's slots hold the source's, every other byte the poison.
    assert_bytes_equal(target.storages, first_chunk_only)


def test_a_store_whose_folder_is_removed_gives_nothing_and_forgets_it(metadata_patch, store, seal_patch,
                                                                     config_and_groups, tmp_path):
    """Every file gone at once (the folder removed under the engine): nothing is loaded, every byte
    keeps the poison, and the next lookup finds nothing (on LMCache 0.4.5 the disk backend's own
    removal of a key whose file is gone kept its lock, and the next read waited forever)."""
    retrieved, found_after, _, target = _store_and_reload(store, tmp_path, config_and_groups,
                                                          lambda path: shutil.rmtree(path.parent))
    assert (retrieved, found_after) == (0, 0)
    assert_bytes_equal(target.storages, dsv4_ascend_kv_caches("poison").storages)


def test_without_the_seal_flipped_bytes_reach_the_caches(metadata_patch, store, config_and_groups, tmp_path):
    assert REGISTRY.record(SEAL_PATCHES[store]).state is not State.APPLIED
    retrieved, *_ = _store_and_reload(store, tmp_path, config_and_groups, _flip)
    assert retrieved == NUM_TOKENS, "with the check off the damaged chunk is loaded as if whole"


@NEEDS_REDIS
def test_unreadable_redis_metadata_is_a_miss_and_its_key_goes(metadata_patch, config_and_groups):
    """A chunk whose metadata key holds nothing: LMCache's Redis get raised (the remote backend then
    cancelled the chunk's other gets, each ending a worker of the connector's job queue); with
    ``lmcache-redis-get-releases`` it is a miss, the chunks before it arrive byte-exact, the rest
    keep the poison, and the unreadable key is deleted."""
    name = "lmcache-redis-get-releases"
    assert apply_now(REGISTRY, name) is State.APPLIED, REGISTRY.record(name).reason
    kv_cache_config, kv_groups = config_and_groups
    source, target = dsv4_ascend_kv_caches("random", seed=4), dsv4_ascend_kv_caches("poison")
    slot_mappings = _slot_mappings(kv_groups)
    first_chunk_only = expected_after_roundtrip(source, dsv4_ascend_kv_caches("poison"), slot_mappings,
                                                kv_groups, kv_cache_config, CHUNK, CHUNK)
    tokens = torch.arange(NUM_TOKENS)
    try:
        with stored_over_redis(config_and_groups, source, slot_mappings, tokens) as (engine, client, _):
            keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
            metadata_key = keys[1].to_string() + "metadata"
            client.set(metadata_key, b"")
            _plan(engine, target, kv_cache_config, kv_groups)
            retrieved = int(engine.retrieve(tokens, slot_mappings_by_group=slot_mappings).sum())
            gone = not client.exists(metadata_key)
    finally:
        REGISTRY.revert(name)
    assert retrieved == CHUNK, f"retrieved {retrieved} tokens; only the chunk before the unreadable one is whole"
    assert gone, "the unreadable metadata key was kept"
    assert_bytes_equal(target.storages, first_chunk_only)
