"""CPU end to end: a real LMCacheEngine (local CPU backend) behind the multi-group connector.

The DeepSeek-V4-like model of `tests.fixtures` (11 real vLLM KV-cache groups;
MLA pairs, DSA, MERGED, an int8 blob with dtype views, DSA-C8, state groups)
stores a 3-chunk prompt from random caches and retrieves it into zeroed ones.
Every byte of every registered tensor is compared with an expectation computed
here from the slot mappings alone: moved rows (the state groups' too, moved by
default) equal the source, everything else (null-block rows, sliding-window
rows before each chunk's tail, unused blocks) stays zero.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lmcache_ascend.patches import State, registry
from tests.fixtures.kv_cache_configs import DSV4_ASCEND_STATE_GROUPS, dsv4_ascend_kv_cache_config
from tests.fixtures.kv_caches import (
    ROWS_PER_BLOCK,
    assert_bytes_equal,
    dsv4_ascend_kv_caches,
    expected_after_roundtrip,
)
from tests.patching import apply_now

REGISTRY = registry.process_registry()
CHUNK = 256
NUM_TOKENS = 3 * CHUNK
METADATA_PATCH = "lmcache-metadata-chunk-bytes"
_instance_ids = itertools.count()

# Block ids per scheduler group (block 0 is vLLM's null block: its rows are -1). The state
# groups (4-7, 9, 10: one row per token, 128-token blocks) are moved by default, so they have tables too.
BLOCK_IDS = {
    0: [0, 5], 1: [3], 2: [7, 2, 5, 1, 6, 4], 3: [6, 2], 8: [4],
    4: [1, 2, 3, 4, 5, 6], 5: [6, 5, 4, 3, 2, 1], 6: [2, 4, 6, 1, 3, 5], 7: [7, 6, 5, 4, 3, 2],
    9: [3, 1, 4, 7, 5, 2], 10: [5, 7, 1, 2, 6, 3],
}


@pytest.fixture
def metadata_patch():
    assert apply_now(REGISTRY, METADATA_PATCH) is State.APPLIED, REGISTRY.record(METADATA_PATCH).reason
    yield
    REGISTRY.revert(METADATA_PATCH)


@pytest.fixture(scope="module")
def config_and_groups():
    from lmcache_ascend.multigroup.specs import kv_groups_from_config
    from lmcache_ascend.multigroup.state_skip import StateGroupPolicy

    fixture = dsv4_ascend_kv_cache_config()
    return fixture.kv_cache_config, kv_groups_from_config(
        fixture.kv_cache_config, fixture.vllm_block_size, StateGroupPolicy()
    )


def _engine(connector, **config):
    """A real LMCache engine (local CPU backend unless `config` says otherwise) and its instance id."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    instance_id = f"ascend-e2e-{next(_instance_ids)}"
    config = LMCacheEngineConfig.from_defaults(
        **{"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.05, "lmcache_instance_id": instance_id,
           **config}
    )
    metadata = LMCacheMetadata(
        model_name="dsv4-like",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(1, 1, CHUNK, 1, 1),
        chunk_size=CHUNK,
    )
    engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata, connector, None, None)
    engine.post_init()
    return instance_id, engine


def _slot_mappings(kv_groups) -> dict[int, torch.Tensor]:
    from tests.multigroup.cpu_slots import raw_slot_mapping_for_group

    return {
        group: raw_slot_mapping_for_group(kv_groups.groups[group], ids, NUM_TOKENS) for group, ids in BLOCK_IDS.items()
    }


def _plan(engine, caches, kv_cache_config, kv_groups, bundle=True):
    from lmcache_ascend.connector.install import plan_for_engine
    from lmcache_ascend.kv_worker.registration import plane_groups_from_layer_names

    plane_groups = plane_groups_from_layer_names(
        [group.layer_names for group in kv_cache_config.kv_cache_groups], caches.kv_caches
    )
    return plan_for_engine(
        engine,
        caches.kv_caches,
        plane_groups,
        kv_groups.groups_by_index(),
        bundle_multi_spec=bundle,
        backend_dims=caches.backend_dims,
    )


@pytest.mark.parametrize("bundle", [True, False], ids=["bundled", "exploded"])
def test_store_then_retrieve_every_group_byte_exact(metadata_patch, config_and_groups, bundle):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    kv_cache_config, kv_groups = config_and_groups
    source = dsv4_ascend_kv_caches("random", seed=1)
    target = dsv4_ascend_kv_caches("zeros")
    slot_mappings = _slot_mappings(kv_groups)
    # The null block rows really are -1, so the test covers skipped rows.
    assert (slot_mappings[0][:ROWS_PER_BLOCK] == -1).all()

    instance_id, engine = _engine(None)
    try:
        connector = _plan(engine, source, kv_cache_config, kv_groups, bundle)
        tokens = torch.arange(NUM_TOKENS)
        engine.store(tokens, slot_mappings_by_group=slot_mappings)
        launches_per_store = connector.launches
        # One launch per layer group moves the store's 3 chunks; bundled, the 11 scheduler groups
        # (state groups included) give 11 layer groups; exploded, each distinct plane identity is its own (17).
        assert connector.tokens_stored == 3 * connector.chunk_size
        assert launches_per_store == len(connector.planner.layer_groups)
        assert len(connector.planner.layer_groups) == (11 if bundle else 17)
        assert set(connector.planner.scheduler_groups_in_use()) == set(range(11))

        _plan(engine, target, kv_cache_config, kv_groups, bundle)  # register the zeroed caches
        retrieved = engine.retrieve(tokens, slot_mappings_by_group=slot_mappings)
        assert int(retrieved.sum()) == NUM_TOKENS

        zero = dsv4_ascend_kv_caches("zeros")
        expected = expected_after_roundtrip(source, zero, slot_mappings, kv_groups, kv_cache_config, NUM_TOKENS, CHUNK)
        assert_bytes_equal(target.storages, expected)
    finally:
        LMCacheEngineBuilder.destroy(instance_id)


def test_state_groups_are_skipped_and_window_holds_only_its_tail(metadata_patch, config_and_groups):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache_ascend.multigroup.specs import kv_groups_from_config
    from lmcache_ascend.multigroup.state_skip import StateGroupPolicy

    kv_cache_config, _ = config_and_groups
    # Skipping is an opt-in (a resumed prefill reads DeepSeek-V4's compressor state): asked for here.
    kv_groups = kv_groups_from_config(
        kv_cache_config, dsv4_ascend_kv_cache_config().vllm_block_size, StateGroupPolicy(skip_state_groups=True)
    )
    source = dsv4_ascend_kv_caches("random", seed=2)
    slot_mappings = _slot_mappings(kv_groups)
    # Give the state groups slots too: they must still not be stored.
    for group, _ in DSV4_ASCEND_STATE_GROUPS:
        slot_mappings[group] = torch.arange(NUM_TOKENS, dtype=torch.long) % (8 * ROWS_PER_BLOCK)
    instance_id, engine = _engine(None)
    try:
        connector = _plan(engine, source, kv_cache_config, kv_groups)
        in_use = set(connector.planner.scheduler_groups_in_use())
        assert in_use == {0, 1, 2, 3, 8}
        assert not in_use & {group for group, _ in DSV4_ASCEND_STATE_GROUPS}
        # Sliding-window group 8 (window 128, compress 128): its window is one row, widened
        # to the paged block holding it (2 rows: 256-token blocks), i.e. the chunk.
        plan = connector.planner.full_plan
        (swa_region,) = [
            region
            for region, group in zip(plan.regions, connector.planner.layer_groups)
            if group.scheduler_groups[0] == 8
        ]
        assert swa_region.plane_rows == (2, 2, 2, 2)
        shape = engine.metadata.get_shapes(CHUNK)[0]
        assert engine.metadata.get_dtypes() == [torch.uint8]
        assert shape[2] == CHUNK and shape[0] * shape[1] * shape[2] * shape[3] >= plan.total_bytes
    finally:
        LMCacheEngineBuilder.destroy(instance_id)
