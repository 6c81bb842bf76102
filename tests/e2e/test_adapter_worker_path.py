"""The whole in-process path on CPU: scheduler metadata -> patched worker adapter -> engine -> caches.

Scheduler side: LMCache's real ``LMCacheConnectorV1Impl`` with the
``lmcache-adapter-multigroup`` patch builds ``ReqMeta`` objects carrying
per-group slot mappings (driven by `tests.multigroup.scheduler_driver`).
Worker side: another real ``LMCacheConnectorV1Impl`` (worker state set the
way upstream's ``_init_connector_state`` sets it; LMCache's service manager,
which would start network services, is replaced by its two members the worker
uses) with the worker patches; its engine is a real ``LMCacheEngine`` whose
connector comes from the patched ``CreateGPUConnector``. ``wait_for_save``
stores a 3-chunk prompt from random DeepSeek-V4-like caches;
``start_load_kv`` loads it into zeroed caches; every byte is checked.
"""

from __future__ import annotations

import dataclasses
import socket
import types

import pytest
import torch

from lmcache_ascend.patches import State, registry
from tests.fixtures.kv_cache_configs import dsv4_ascend_kv_cache_config
from tests.fixtures.kv_caches import assert_bytes_equal, dsv4_ascend_kv_caches, expected_after_roundtrip
from tests.multigroup.scheduler_driver import RequestDriver, make_connector_impl
from tests.patching import apply_now

REGISTRY = registry.process_registry()
CHUNK = 256
PROMPT_TOKENS = 3 * CHUNK + 32  # the partial last chunk is not stored
PATCHES = (
    "lmcache-adapter-multigroup",
    "lmcache-metadata-chunk-bytes",
    "lmcache-gpu-connector-npu",
    "lmcache-adapter-worker-multigroup",
)
# Block ids per scheduler group (11 groups).
BLOCK_IDS = (
    [6, 5],
    [3],
    [7, 2, 5, 1, 6, 4, 3],
    [6, 2],
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7],
    [4],
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7],
)


@pytest.fixture(scope="module")
def pipeline_group():
    """vLLM's pipeline-parallel group of one rank (wait_for_save asks whether it is the last stage)."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    if parallel_state._PP is not None:
        yield
        return
    started = not dist.is_initialized()
    if started:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    parallel_state._PP = parallel_state.GroupCoordinator(
        group_ranks=[[0]], local_rank=0, torch_distributed_backend="gloo", use_device_communicator=False, group_name="pp"
    )
    yield
    parallel_state._PP = None
    if started:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fixture_backend_dims(monkeypatch):
    """The worker asks vLLM's attention layers for each single tensor's layout; no
    model is loaded here, so the fixture's own (documented) layouts answer."""
    import lmcache_ascend.connector.attention_backends as backend_dims

    dims_by_layer = dsv4_ascend_kv_caches("zeros").backend_dims
    monkeypatch.setattr(
        backend_dims, "describe_kv_caches", lambda vllm_config, kv_caches: {n: dims_by_layer[n] for n in kv_caches if n in dims_by_layer}
    )


@pytest.fixture
def patches():
    for name in PATCHES:
        assert apply_now(REGISTRY, name) is State.APPLIED, (name, REGISTRY.record(name).reason)
    yield
    for name in reversed(PATCHES):
        REGISTRY.revert(name)


def _engine():
    from lmcache.utils import EngineType
    from lmcache.v1 import gpu_connector as factory
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, lmcache_instance_id="ascend-adapter-e2e"
    )
    metadata = LMCacheMetadata(
        model_name="dsv4-like", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(1, 1, CHUNK, 1, 1), chunk_size=CHUNK,
    )
    connector = factory.CreateGPUConnector(config, metadata, EngineType.VLLM)
    assert isinstance(connector, MultiGroupGPUConnector)  # CPU build: LMCache has no connector of its own
    engine = LMCacheEngineBuilder.get_or_create("ascend-adapter-e2e", config, metadata, connector, None, None)
    return config, engine


def _worker(fixture, config, engine):
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
    from lmcache.observability import LMCStatsMonitor

    parent = object.__new__(LMCacheConnectorV1Dynamic)
    parent._kv_cache_config = fixture.kv_cache_config
    worker = object.__new__(LMCacheConnectorV1Impl)
    parent._lmcache_engine = worker
    worker._parent = parent
    worker.config = config
    worker._manager = types.SimpleNamespace(lmcache_engine=engine, post_init=engine.post_init)
    worker.kv_role = "kv_both"
    worker.use_layerwise = False
    worker.enable_blending = False
    worker.async_loading = False
    worker.kv_caches = {}
    worker.device = "cpu"
    worker._block_size = fixture.vllm_block_size
    worker._lmcache_chunk_size = CHUNK
    worker._discard_partial_chunks = True
    worker.current_layer = 0
    worker.layerwise_retrievers = []
    worker._layerwise_save_storers = {}
    worker._stats_monitor = LMCStatsMonitor.GetOrCreate()
    worker._invalid_block_ids = set()
    worker.force_skip_save = False
    return worker


def _forward_context():
    from vllm.forward_context import ForwardContext

    required = {
        field.name: ({} if field.name != "virtual_engine" else 0)
        for field in dataclasses.fields(ForwardContext)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    }
    return ForwardContext(**required)


def test_wait_for_save_then_start_load_kv_round_trips_every_group(patches, pipeline_group):
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata, LoadSpec
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector
    from lmcache_ascend.multigroup.attachments import CONNECTOR_GROUPS, STEP_BLOCK_IDS
    from tests.multigroup.cpu_slots import raw_slot_mapping_for_group

    fixture = dsv4_ascend_kv_cache_config()
    scheduler = make_connector_impl(fixture, chunk_size=CHUNK)
    driver = RequestDriver(scheduler, "req-0", list(range(1000, 1000 + PROMPT_TOKENS)))
    store_meta = driver.start(PROMPT_TOKENS, BLOCK_IDS)
    (request,) = store_meta.requests
    step_blocks = STEP_BLOCK_IDS.get(request)
    kv_groups = CONNECTOR_GROUPS.get(scheduler)
    assert step_blocks is not None and kv_groups.num_groups == 11
    assert step_blocks.geometry_digest == kv_groups.geometry_digest  # the groups themselves are not shipped

    config, engine = _engine()
    try:
        source = dsv4_ascend_kv_caches("random", seed=3)
        saver = _worker(fixture, config, engine)
        saver.register_kv_caches(source.kv_caches)
        assert isinstance(engine.gpu_connector, MultiGroupGPUConnector)
        saver._parent._connector_metadata = store_meta
        saver.wait_for_save()
        assert engine.gpu_connector.launches == 11  # one launch per layer group (state groups too) moves all 3 chunks

        target = dsv4_ascend_kv_caches("zeros")
        loader = _worker(fixture, config, engine)
        loader.register_kv_caches(target.kv_caches)
        load_request = dataclasses.replace(
            request, save_spec=None, load_spec=LoadSpec(vllm_cached_tokens=0, lmcache_cached_tokens=3 * CHUNK, can_load=True)
        )
        STEP_BLOCK_IDS.set(load_request, step_blocks)
        loader._parent._connector_metadata = LMCacheConnectorMetadata(requests=[load_request])
        loader.start_load_kv(_forward_context())
        assert loader._invalid_block_ids == set()

        kv_groups = loader._ascend_kv_groups if "_ascend_kv_groups" in vars(loader) else None
        if kv_groups is None:
            from lmcache_ascend.multigroup.connector_state import kv_groups_for_connector

            kv_groups = kv_groups_for_connector(fixture.kv_cache_config, fixture.vllm_block_size, config)
        slots = {
            group: raw_slot_mapping_for_group(kv_groups.groups[group], list(ids), PROMPT_TOKENS)
            for group, ids in enumerate(BLOCK_IDS)
        }
        expected = expected_after_roundtrip(
            source, dsv4_ascend_kv_caches("zeros"), slots, kv_groups, fixture.kv_cache_config, 3 * CHUNK, CHUNK
        )
        assert_bytes_equal(target.storages, expected)
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")


def test_a_steps_store_slots_are_resolved_at_hand_over_and_the_store_only_indexes(patches, pipeline_group,
                                                                                   monkeypatch):
    """wait_for_save resolves every storing request's slots when it hands them over (one upload);
    LMCache's store then only indexes into them; they are released after the call. A load
    (start_load_kv) resolves its request's slots once, inside the call."""
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata, LoadSpec
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from lmcache_ascend.kv_worker.device_slots import DeviceSlots
    from lmcache_ascend.multigroup.attachments import STEP_BLOCK_IDS

    fixture = dsv4_ascend_kv_cache_config()
    scheduler = make_connector_impl(fixture, chunk_size=CHUNK)
    store_meta = RequestDriver(scheduler, "req-0", list(range(1000, 1000 + PROMPT_TOKENS))).start(
        PROMPT_TOKENS, BLOCK_IDS
    )
    (request,) = store_meta.requests
    events = []
    for_requests = DeviceSlots.for_requests.__func__

    def counted(cls, requests, *args, **kwargs):
        events.append(("resolve", sorted(requests)))
        return for_requests(cls, requests, *args, **kwargs)

    monkeypatch.setattr(DeviceSlots, "for_requests", classmethod(counted))
    config, engine = _engine()
    try:
        saver = _worker(fixture, config, engine)
        saver.register_kv_caches(dsv4_ascend_kv_caches("random", seed=3).kv_caches)
        connector = engine.gpu_connector
        batched_from_gpu = connector.batched_from_gpu

        def storing(*args, **kwargs):
            events.append(("store", sorted(connector._device_slots_by_request)))
            return batched_from_gpu(*args, **kwargs)

        monkeypatch.setattr(connector, "batched_from_gpu", storing)
        saver._parent._connector_metadata = store_meta
        saver.wait_for_save()
        # Resolved once at hand-over, before LMCache's store, which found them and resolved nothing.
        assert events == [("resolve", [("req-0", True)]), ("store", [("req-0", True)])]
        assert connector.tokens_stored == 3 * CHUNK and connector._device_slots_by_request == {}

        events.clear()
        load_request = dataclasses.replace(
            request, save_spec=None, load_spec=LoadSpec(vllm_cached_tokens=0, lmcache_cached_tokens=3 * CHUNK, can_load=True)
        )
        STEP_BLOCK_IDS.set(load_request, STEP_BLOCK_IDS.get(request))
        saver._parent._connector_metadata = LMCacheConnectorMetadata(requests=[load_request])
        saver.start_load_kv(_forward_context())
        assert events == [("resolve", ["req-0"])]  # from_block_ids, once, inside the load (named for errors)
        assert connector.tokens_loaded == 3 * CHUNK and connector._device_slots_by_request == {}
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")


@pytest.mark.parametrize(
    ("environ", "expected_layer_groups"),
    [({}, 11), ({"LMCACHE_ASCEND_BUNDLE_MULTI_SPEC": "0"}, 17)],
    ids=["bundled", "exploded"],
)
def test_register_honours_the_bundle_flag(patches, monkeypatch, environ, expected_layer_groups):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    fixture = dsv4_ascend_kv_cache_config()
    config, engine = _engine()
    try:
        worker = _worker(fixture, config, engine)
        worker.register_kv_caches(dsv4_ascend_kv_caches("zeros").kv_caches)
        assert len(engine.gpu_connector.planner.layer_groups) == expected_layer_groups
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")


def test_layerwise_mode_is_rejected_at_registration(patches):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from lmcache_ascend.kv_worker import KVCacheShapeError

    fixture = dsv4_ascend_kv_cache_config()
    config, engine = _engine()
    try:
        worker = _worker(fixture, config, engine)
        worker.use_layerwise = True
        with pytest.raises(KVCacheShapeError, match="use_layerwise=True cannot move multi-group"):
            worker.register_kv_caches(dsv4_ascend_kv_caches("zeros").kv_caches)
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")


def test_chunks_with_rows_on_the_null_block_are_not_persisted(patches, pipeline_group):
    """Group 0's first block is vLLM's null block: its rows in chunks 0 and 1 have no data.

    Storing those chunks would persist stale buffer bytes as KV; only chunk 2 may be stored.
    """
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from lmcache_ascend.multigroup.attachments import CONNECTOR_GROUPS, STEP_BLOCK_IDS

    fixture = dsv4_ascend_kv_cache_config()
    scheduler = make_connector_impl(fixture, chunk_size=CHUNK)
    driver = RequestDriver(scheduler, "req-holes", list(range(2000, 2000 + PROMPT_TOKENS)))
    block_ids_with_null = ([0, 5],) + BLOCK_IDS[1:]
    store_meta = driver.start(PROMPT_TOKENS, block_ids_with_null)
    (request,) = store_meta.requests
    assert STEP_BLOCK_IDS.get(request).store_hole_chunks(CONNECTOR_GROUPS.get(scheduler)) == (0, 1)

    config, engine = _engine()
    try:
        saver = _worker(fixture, config, engine)
        saver.register_kv_caches(dsv4_ascend_kv_caches("random", seed=5).kv_caches)
        saver._parent._connector_metadata = store_meta
        saver.wait_for_save()
        assert engine.gpu_connector.launches == 1 * 11  # chunk 2 only, 11 layer groups
        # Chunk 0 was not stored, so the prompt has no LMCache prefix hit at all.
        assert engine.lookup(list(range(2000, 2000 + PROMPT_TOKENS))) == 0
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")


@pytest.mark.parametrize(
    ("can_save", "with_disagg_spec"),
    [(False, False), (True, True), (False, True)],
    ids=["producer-cannot-save", "producer-disagg", "producer-cannot-save-disagg"],
)
def test_prefill_node_never_persists_chunks_with_rows_on_the_null_block(
    patches, pipeline_group, caplog, can_save, with_disagg_spec
):
    """A kv_producer stores even when ``can_save`` is False, and lowers its start to
    ``disagg_spec.num_transferred_tokens``: neither may bring hole chunks back."""
    import logging

    from lmcache.integration.vllm.vllm_v1_adapter import DisaggSpec
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    fixture = dsv4_ascend_kv_cache_config()
    scheduler = make_connector_impl(fixture, chunk_size=CHUNK)
    tokens = list(range(3000, 3000 + PROMPT_TOKENS))
    driver = RequestDriver(scheduler, "req-producer", tokens)
    store_meta = driver.start(PROMPT_TOKENS, ([0, 5],) + BLOCK_IDS[1:])
    (request,) = store_meta.requests
    request.save_spec = dataclasses.replace(request.save_spec, skip_leading_tokens=0, can_save=can_save)
    if with_disagg_spec:
        request.disagg_spec = DisaggSpec(
            req_id="req-producer", receiver_id="decoder0", receiver_host="127.0.0.1",
            receiver_init_port=1, receiver_alloc_port=2, num_transferred_tokens=0,
        )

    config, engine = _engine()
    try:
        saver = _worker(fixture, config, engine)
        saver.kv_role = "kv_producer"
        saver.register_kv_caches(dsv4_ascend_kv_caches("random", seed=7).kv_caches)
        saver._parent._connector_metadata = store_meta
        with caplog.at_level(logging.WARNING, logger="lmcache_ascend"):
            saver.wait_for_save()
        assert engine.gpu_connector.launches == 1 * 11  # chunk 2 only
        assert engine.lookup(tokens) == 0
        skipped = [r for r in caplog.records if r.name == "lmcache_ascend" and r.levelno == logging.WARNING]
        assert len(skipped) == 1 and "req-producer" in skipped[0].getMessage()
        assert "null block" in skipped[0].getMessage()
    finally:
        LMCacheEngineBuilder.destroy("ascend-adapter-e2e")
