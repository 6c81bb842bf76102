"""Real LMCache engines: chunk keys name the chunk layout and the model.

The DeepSeek-V4-like caches of `tests.fixtures` are planned into real
``LMCacheEngine``s (local CPU backend) through `plan_for_engine`, as the worker
adapter patch does. The model name in LMCache's metadata, which its token
database puts into every ``CacheEngineKey``, must carry the digest of the plan
and the model: equal for equal engines, different for bundled vs exploded
planes and for other weights; a store under one layout is never found by an
engine of another layout sharing the same backend objects.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.kv_worker.chunk_identity import KEY_SEPARATOR
from lmcache_ascend.patches import State, registry
from tests.e2e.test_engine_roundtrip import (  # noqa: F401 - fixtures
    CHUNK,
    NUM_TOKENS,
    _engine,
    _plan,
    _slot_mappings,
    metadata_patch,
    config_and_groups,
)
from tests.fixtures.kv_caches import dsv4_ascend_kv_caches
from tests.patching import apply_now

REGISTRY = registry.process_registry()
STABLE_HASH_PATCH = "lmcache-stable-token-hash"


@pytest.fixture
def stable_hash_patch():
    """Armed as the product arms it: without it, LMCache 0.4's builtin-hash fallback draws a new
    chain start for every engine created in a process, so even two engines of one layout would
    key chunks apart and the control below could not hold."""
    assert apply_now(REGISTRY, STABLE_HASH_PATCH) is State.APPLIED, REGISTRY.record(STABLE_HASH_PATCH).reason
    yield
    REGISTRY.revert(STABLE_HASH_PATCH)


def _planned_engine(caches, kv_cache_config, kv_groups, bundle=True):
    instance_id, engine = _engine(None)
    _plan(engine, caches, kv_cache_config, kv_groups, bundle)
    return instance_id, engine


def _destroy(*instance_ids):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    for instance_id in instance_ids:
        LMCacheEngineBuilder.destroy(instance_id)


def test_keys_carry_the_layout_digest(metadata_patch, config_and_groups):
    kv_cache_config, kv_groups = config_and_groups
    caches = dsv4_ascend_kv_caches("zeros")
    ids = []
    try:
        first_id, first = _planned_engine(caches, kv_cache_config, kv_groups)
        ids.append(first_id)
        twin_id, twin = _planned_engine(dsv4_ascend_kv_caches("zeros"), kv_cache_config, kv_groups)
        ids.append(twin_id)
        exploded_id, exploded = _planned_engine(caches, kv_cache_config, kv_groups, bundle=False)
        ids.append(exploded_id)

        name = first.metadata.model_name
        assert name.startswith("dsv4-like" + KEY_SEPARATOR)
        assert twin.metadata.model_name == name, "identical engines must key chunks alike"
        assert exploded.metadata.model_name != name, "bundled and exploded planes lay bytes out differently"

        # The key LMCache builds for a chunk carries it, and survives LMCache's string form.
        from lmcache.utils import CacheEngineKey

        (_, _, key), *_ = first.token_database.process_tokens(tokens=torch.arange(NUM_TOKENS))
        assert key.model_name == name
        assert CacheEngineKey.from_string(key.to_string()) == key

        # Re-planning the same engine (caches registered again) re-keys it, never nests digests.
        _plan(first, caches, kv_cache_config, kv_groups, False)
        assert first.metadata.model_name == exploded.metadata.model_name
    finally:
        _destroy(*ids)


def test_a_store_under_another_layout_is_not_found(metadata_patch, stable_hash_patch, config_and_groups):
    """Two engines over one storage (the bundled one's local CPU backend): no cross-layout hit."""
    kv_cache_config, kv_groups = config_and_groups
    source = dsv4_ascend_kv_caches("random", seed=3)
    slot_mappings = _slot_mappings(kv_groups)
    tokens = torch.arange(NUM_TOKENS)
    ids, borrowed = [], []

    def share_storage(engine, owner):
        borrowed.append((engine, engine.storage_manager, engine.retrieve_locations))
        engine.storage_manager = owner.storage_manager  # one store, as a shared remote backend is
        engine.retrieve_locations = owner.retrieve_locations

    try:
        bundled_id, bundled = _planned_engine(source, kv_cache_config, kv_groups)
        ids.append(bundled_id)
        bundled.store(tokens, slot_mappings_by_group=slot_mappings)
        assert bundled.lookup(tokens) == NUM_TOKENS

        exploded_id, exploded = _planned_engine(source, kv_cache_config, kv_groups, bundle=False)
        ids.append(exploded_id)
        share_storage(exploded, bundled)
        assert exploded.lookup(tokens) == 0
        target = dsv4_ascend_kv_caches("zeros")
        _plan(exploded, target, kv_cache_config, kv_groups, False)
        assert int(exploded.retrieve(tokens, slot_mappings_by_group=slot_mappings).sum()) == 0
        assert all(int(storage.count_nonzero()) == 0 for storage in target.storages.values()), "nothing may be loaded"

        # Control: an engine of the bundled layout over the same storage finds every chunk.
        twin_id, twin = _planned_engine(dsv4_ascend_kv_caches("zeros"), kv_cache_config, kv_groups)
        ids.append(twin_id)
        share_storage(twin, bundled)
        assert twin.lookup(tokens) == NUM_TOKENS
    finally:
        for engine, storage_manager, locations in borrowed:
            engine.storage_manager, engine.retrieve_locations = storage_manager, locations
        _destroy(*ids)
