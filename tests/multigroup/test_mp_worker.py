"""Worker side of vLLM's builtin LMCache MP connector on LMCache 0.5.x (real vLLM and LMCache classes).

- LMCache 0.5.6's adapters built from the arguments vLLM's builtin connector
  passes (``vllm-lmcache-mp-upstream-adapter-api``), against the real MP server
  process on loopback: unpatched, vLLM's own ``create_scheduler_adapter`` fails.
- Per-group hints at registration (``vllm-lmcache-mp-upstream-group-hints``):
  layers of equal shape in different KV-cache groups get their own
  ``EngineGroupInfo``; unpatched, no group info reaches LMCache at all.
- Events on a host without CUDA (``vllm-lmcache-mp-device-events``): the
  connector's module sees LMCache's ``torch_dev`` as ``torch.cuda``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.patches import State, registry
from tests.patching import apply_now

REGISTRY = registry.process_registry()
MODULE = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector")
ADAPTER_API = "vllm-lmcache-mp-upstream-adapter-api"
GROUP_HINTS = "vllm-lmcache-mp-upstream-group-hints"
DEVICE_EVENTS = "vllm-lmcache-mp-device-events"
NEW_API = hasattr(MODULE, "LMCacheMPConnectorUpstream") and installed_version("lmcache").startswith("0.5")
needs_new_api = pytest.mark.skipif(not NEW_API, reason="vLLM >= 0.19 with LMCache 0.5 only (stack A: skipped-version)")


@pytest.fixture
def applied():
    def apply(name):
        assert apply_now(REGISTRY, name) is State.APPLIED, REGISTRY.record(name).reason

    yield apply


def test_states_per_stack():
    if NEW_API:
        for name in (ADAPTER_API, GROUP_HINTS, DEVICE_EVENTS):
            assert apply_now(REGISTRY, name) is State.APPLIED, REGISTRY.record(name).reason
    else:
        for name in (ADAPTER_API, GROUP_HINTS, DEVICE_EVENTS):
            assert apply_now(REGISTRY, name) is State.SKIPPED_VERSION, REGISTRY.record(name).reason


# ---------------------------------------------------------------- adapter API


@needs_new_api
@pytest.mark.parametrize(
    "old, expected",
    [
        # (use_mla, kv_world, kv_rank, world, rank, tp, pp) -> LMCache's derived (kv_world, kv_rank)
        ((False, 1, 0, 1, 0, 1, 1), (1, 0)),
        ((False, 4, 3, 4, 3, 2, 2), (4, 3)),
        ((True, 2, 1, 4, 3, 2, 2), (2, 1)),  # MLA: TP ranks of a stage share one KV piece
    ],
)
def test_parallel_strategy_from_vllm_fields(applied, old, expected):
    from lmcache.integration.vllm.vllm_multi_process_adapter import ParallelStrategy

    applied(ADAPTER_API)
    strategy = MODULE.ParallelStrategy(*old)
    assert type(strategy) is ParallelStrategy
    assert (strategy.kv_world_size, strategy.kv_worker_id) == expected
    assert (strategy.mla_only, strategy.vllm_world_size, strategy.vllm_worker_id, strategy.tp_size, strategy.pp_size) == (
        old[0], old[3], old[4], old[5], old[6],
    )
    assert strategy.n_servers == 1


@needs_new_api
def test_parallel_strategy_disagreeing_with_vllm_is_refused(applied):
    applied(ADAPTER_API)
    with pytest.raises(ValueError, match=r"KV world size / rank \(3, 0\) but LMCache derives \(2, 0\)"):
        MODULE.ParallelStrategy(False, 3, 0, 2, 0, 2, 1)


@needs_new_api
def test_worker_adapter_answers_the_old_store_rule(applied):
    applied(ADAPTER_API)
    adapter_cls = MODULE.LMCacheMPWorkerAdapter
    for old, writes in (((True, 1, 0, 2, 1, 2, 1), False), ((True, 1, 0, 2, 0, 2, 1), True), ((False, 2, 1, 2, 1, 2, 1), True)):
        adapter = object.__new__(adapter_cls)
        adapter.parallel_strategy = MODULE.ParallelStrategy(*old)
        assert adapter.use_mla is old[0]
        # vLLM skips the store when use_mla and not is_first_rank_of_pp_group.
        assert (not (adapter.use_mla and not adapter.is_first_rank_of_pp_group)) is writes
        assert adapter.is_kv_writer is writes


@pytest.fixture(scope="module")
def server_port():
    from tests.engine.harness import mp_server

    with mp_server(chunk_size=256) as port:
        yield port


def _create_scheduler_adapter(port):
    import zmq
    from vllm.config import DeviceConfig, VllmConfig

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.cache_config.block_size = 16
    # Stands in for a model's ModelConfig (it needs weights): the two fields read here.
    config.model_config = SimpleNamespace(model="tiny-model", use_mla=False)
    return MODULE.create_scheduler_adapter(f"tcp://127.0.0.1:{port}", zmq.Context.instance(), config, 30.0, 10.0)


@needs_new_api
@pytest.mark.skipif(
    importlib.util.find_spec("httpx") is None, reason="LMCache's MP server imports httpx, which this stack's pins lack"
)
def test_builtin_scheduler_adapter_reaches_the_real_server(applied, server_port):
    assert REGISTRY.revert(ADAPTER_API) in (State.REVERTED, State.PENDING)
    with pytest.raises(TypeError, match="server_url"):
        _create_scheduler_adapter(server_port)
    applied(ADAPTER_API)
    adapter = _create_scheduler_adapter(server_port)
    try:
        assert adapter.lmcache_tokens_per_chunk == 256  # read from the server
        assert adapter.num_blocks_per_chunk() == 256 // 16
        assert (adapter.parallel_strategy.vllm_world_size, adapter.parallel_strategy.kv_worker_id) == (1, 0)
    finally:
        adapter.shutdown()


# ---------------------------------------------------------------- group hints


class _RecordingAdapter:
    def __init__(self):
        self.calls = []

    def register_kv_caches(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def _registered(kv_cache_config):
    """What the builtin connector hands LMCache's worker adapter for equal-shaped layers of 2 groups."""
    from lmcache.integration.vllm.utils import vllm_layout_hints
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    if hasattr(config.cache_config, "get_resolved_kv_cache_layout"):
        config.cache_config.kv_cache_layout = "LBNHC"  # as the engine core resolves it for flash attention
    connector = object.__new__(MODULE.LMCacheMPConnectorUpstream)
    connector._kv_cache_config = kv_cache_config
    connector._vllm_config = config
    connector.worker_adapter = _RecordingAdapter()
    groups = kv_cache_config.kv_cache_groups
    names = [name for pair in zip(groups[0].layer_names, groups[1].layer_names) for name in pair]
    kv_caches = {name: torch.zeros(2, 64, 16, 2, 64, dtype=torch.float16) for name in names}  # [2, blocks, 16, heads, 64]
    with set_current_vllm_config(config):
        connector.register_kv_caches(kv_caches)
        hints = vllm_layout_hints(config)
    ((args, kwargs),) = connector.worker_adapter.calls
    return names, args, kwargs, hints


@needs_new_api
def test_equal_shaped_layers_of_two_groups_stay_apart(applied):
    from tests.fixtures.kv_cache_configs import full_and_sliding_window_kv_cache_config

    applied(GROUP_HINTS)
    fixture = full_and_sliding_window_kv_cache_config()
    names, args, kwargs, hints = _registered(fixture.kv_cache_config)
    assert args == ()
    assert list(kwargs["kv_caches"]) == names
    infos = kwargs["engine_group_infos"]
    per_group = {}
    for info in infos:
        per_group.setdefault(info.engine_group_id, []).extend(info.layer_indices)
    # names interleave the groups: full.0, swa.0, full.1, swa.1
    assert {group: sorted(indices) for group, indices in per_group.items()} == {0: [0, 2], 1: [1, 3]}
    assert {info.engine_group_id: info.tokens_per_block for info in infos} == {0: 16, 1: 16}
    assert {info.engine_group_id: info.sw_size_tokens for info in infos} == {0: -1, 1: 64}
    assert kwargs["layout_hints"] == hints and hints["kv_layout"] in ("NHD", "HND")


@needs_new_api
def test_unpatched_registration_carries_no_groups():
    """The control: upstream hands LMCache the caches alone; every layer then reads group 0's blocks."""
    from lmcache.v1.multiprocess.group_view import expand_engine_block_ids

    from tests.fixtures.kv_cache_configs import full_and_sliding_window_kv_cache_config

    assert REGISTRY.revert(GROUP_HINTS) in (State.REVERTED, State.PENDING)
    try:
        _, args, kwargs, _ = _registered(full_and_sliding_window_kv_cache_config().kv_cache_config)
        assert "engine_group_infos" not in kwargs
        assert expand_engine_block_ids((), [[1, 2], [7, 8]]) == [[1, 2]]  # group 1's blocks never reach LMCache
    finally:
        assert apply_now(REGISTRY, GROUP_HINTS) is State.APPLIED


# ---------------------------------------------------------------- device events


@needs_new_api
def test_connector_module_records_events_on_lmcache_device(applied):
    from lmcache.v1.platform import torch_dev

    if torch.cuda.is_available():
        pytest.skip("on a CUDA host LMCache's torch_dev is torch.cuda itself: nothing tells the two apart")
    applied(DEVICE_EVENTS)
    assert MODULE.torch.cuda is torch_dev
    assert MODULE.torch.Tensor is torch.Tensor and MODULE.torch.float16 is torch.float16
    # The statements of start_load_kv / wait_for_save, as the module now runs them.
    with MODULE.torch.cuda.stream(MODULE.torch.cuda.current_stream()):
        event = MODULE.torch.cuda.Event(interprocess=True)
        event.record()
    assert event.query()
    assert REGISTRY.revert(DEVICE_EVENTS) is State.REVERTED
    try:
        assert MODULE.torch is torch
        with pytest.raises((RuntimeError, AssertionError)):
            torch.cuda.Event(interprocess=True).record()
    finally:
        applied(DEVICE_EVENTS)


def test_device_events_skip_a_cuda_host(monkeypatch):
    from lmcache_ascend.patches.vllm.lmcache_mp_worker import without_cuda

    # Both kinds of host faked, so the check runs the same on a CPU, NPU or CUDA machine.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert without_cuda() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "CUDA host" in without_cuda()
