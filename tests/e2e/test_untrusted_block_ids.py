"""A block id the worker's cache does not have is refused before anything moves.

The scheduler's block ids reach the worker as data; one past the cache's end, a negative
one, or one so large that ``id * rows_per_block`` wraps would make the kernels skip those
rows: a store then persisted a chunk with stale rows, and a later load wrote those bytes
into the cache.  Here LMCache's real in-process adapter (patched) stores and loads on
DeepSeek-V4-like caches of `NUM_BLOCKS` blocks: the call fails naming request, group and
id, nothing is stored, and a load leaves every byte of a poisoned cache as it was.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcache_ascend.kv_worker import KVCacheShapeError
from tests.e2e.test_adapter_worker_path import (  # noqa: F401  (fixtures used by name)
    BLOCK_IDS,
    CHUNK,
    PROMPT_TOKENS,
    _engine,
    _forward_context,
    _worker,
    fixture_backend_dims,
    patches,
    pipeline_group,
)
from tests.fixtures.kv_cache_configs import dsv4_ascend_kv_cache_config
from tests.fixtures.kv_caches import NUM_BLOCKS, assert_bytes_equal, dsv4_ascend_kv_caches
from tests.multigroup.scheduler_driver import RequestDriver, make_connector_impl

# Group 2 (full attention, 128-token blocks; the three stored chunks need its first 6): its 4th id replaced.
BAD_IDS = {"past-the-end": NUM_BLOCKS, "negative": -3, "wrapping": 2**61}


def _store_meta(req_id: str, tokens: list[int], bad_id: int | None):
    block_ids = list(BLOCK_IDS)
    if bad_id is not None:
        block_ids[2] = block_ids[2][:3] + [bad_id] + block_ids[2][4:]
    scheduler = make_connector_impl(dsv4_ascend_kv_cache_config(), chunk_size=CHUNK)
    return RequestDriver(scheduler, req_id, tokens).start(PROMPT_TOKENS, tuple(block_ids))


@pytest.mark.parametrize("bad_id", list(BAD_IDS.values()), ids=list(BAD_IDS))
def test_store_with_a_foreign_block_id_is_refused_and_stores_nothing(patches, pipeline_group, bad_id):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    fixture = dsv4_ascend_kv_cache_config()
    tokens = list(range(4000, 4000 + PROMPT_TOKENS))
    config, engine = _engine()
    try:
        saver = _worker(fixture, config, engine)
        saver.register_kv_caches(dsv4_ascend_kv_caches("random", seed=11).kv_caches)
        saver._parent._connector_metadata = _store_meta("req-bad", tokens, bad_id)
        with pytest.raises(KVCacheShapeError) as raised:
            saver.wait_for_save()
        assert str(raised.value).startswith(
            f"request 'req-bad', KV-cache group 2: block id {bad_id} (position 3 of its 6) is not a block of "
            f"this worker's cache, which has {NUM_BLOCKS} blocks (allowed ids 0..{NUM_BLOCKS - 1}); nothing was moved"
        ), raised.value
        assert engine.gpu_connector.launches == 0
        assert engine.lookup(tokens) == 0
        # Control: the same request with its own ids stores its three chunks.
        saver._parent._connector_metadata = _store_meta("req-good", tokens, None)
        saver.wait_for_save()
        assert engine.lookup(tokens) == 3 * CHUNK
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")


@pytest.mark.parametrize("bad_id", list(BAD_IDS.values()), ids=list(BAD_IDS))
def test_load_with_a_foreign_block_id_is_refused_and_moves_nothing(patches, pipeline_group, bad_id):
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata, LoadSpec
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from lmcache_ascend.multigroup.attachments import STEP_BLOCK_IDS

    fixture = dsv4_ascend_kv_cache_config()
    tokens = list(range(5000, 5000 + PROMPT_TOKENS))
    config, engine = _engine()
    try:
        saver = _worker(fixture, config, engine)
        saver.register_kv_caches(dsv4_ascend_kv_caches("random", seed=12).kv_caches)
        saver._parent._connector_metadata = _store_meta("req-store", tokens, None)
        saver.wait_for_save()
        assert engine.lookup(tokens) == 3 * CHUNK

        def load_meta(req_id: str, bad: int | None):
            (request,) = _store_meta(req_id, tokens, bad).requests
            load = dataclasses.replace(
                request, save_spec=None,
                load_spec=LoadSpec(vllm_cached_tokens=0, lmcache_cached_tokens=3 * CHUNK, can_load=True),
            )
            STEP_BLOCK_IDS.set(load, STEP_BLOCK_IDS.get(request))
            return LMCacheConnectorMetadata(requests=[load])

        target = dsv4_ascend_kv_caches("poison")
        untouched = {name: tensor.clone() for name, tensor in target.storages.items()}
        loader = _worker(fixture, config, engine)
        loader.register_kv_caches(target.kv_caches)
        loader._parent._connector_metadata = load_meta("req-load", bad_id)
        with pytest.raises(KVCacheShapeError, match=rf"^request 'req-load', KV-cache group 2: block id {bad_id} "):
            loader.start_load_kv(_forward_context())
        assert_bytes_equal(target.storages, untouched)  # every byte of every cache still the poison
        # Control: the same load with the request's own ids writes into the cache.
        loader._parent._connector_metadata = load_meta("req-load-good", None)
        loader.start_load_kv(_forward_context())
        assert any(not torch.equal(target.storages[name], untouched[name]) for name in untouched)
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")


def test_slot_mappings_given_whole_are_checked_against_the_cache_rows():
    """`slot_mappings_by_group` / `slot_mapping` (LMCache hands them over as given): -1 skips, anything
    outside the group's rows is refused naming request, group, slot and position."""
    from lmcache_ascend.kv_worker.device_slots import DeviceSlots
    from lmcache_ascend.multigroup.specs import KVGroupSpec

    groups = {0: KVGroupSpec(0, "Full", 4), 1: KVGroupSpec(1, "C4", 16, 4)}
    rows = {(0, 1): 32, (1, 4): 16}  # per slot mapping: (group, compress ratio)
    cpu = torch.device("cpu")
    fine = DeviceSlots.upload({0: torch.tensor([-1, 0, 31]), 1: [15, -1]}, groups, cpu, slot_rows=rows, request="r")
    assert fine.slots.tolist() == [-1, 0, 31, 15, -1]
    for group, slots, bad, position in ((0, [0, 32, 1], 32, 1), (1, [3, -2], -2, 1), (0, [2**62], 2**62, 0)):
        with pytest.raises(KVCacheShapeError, match=rf"^request 'r', KV-cache group {group}: slot {bad} \(position {position}\)"):
            DeviceSlots.upload({group: slots}, groups, cpu, slot_rows=rows, request="r")
