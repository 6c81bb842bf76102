"""LMCache's own MP connector (``lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector``, the
real class) under ``lmcache-mp-align-state-stores``: its ``wait_for_save`` submits the step's stores through
the worker adapter; in vLLM's ``mamba_cache_mode="align"`` with a Mamba group, the wrapper then waits until
the server answered each store. The worker adapter here is a stand-in for the server side: it keeps one of
LMCache's own ``MessagingFuture`` per submitted store, which a thread answers (the server's copy) or never
answers, and reports its health as the heartbeat would.

- align mode, Mamba group: wait_for_save returns only after the server answered (control: without the
  patch it returns with the store still unanswered);
- mode "none", or align mode without a Mamba group: it returns at once;
- align mode and a server that never answers: it returns once the adapter reports the server unhealthy;
- a step without stores, and a request whose store the adapter dropped, are not waited for;
- applied, then reverted: the class holds upstream's function again.
"""

from __future__ import annotations

import threading
import time
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache.integration.vllm.lmcache_mp_metadata",
                    reason="LMCache before 0.5.6 (the patch requires >=0.5.6: skipped by version there)")
connector_module = pytest.importorskip("lmcache.integration.vllm.lmcache_mp_connector")
pytest.importorskip("vllm.v1.kv_cache_interface")

from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPConnectorMetadata, LMCacheMPRequestMetadata  # noqa: E402
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp  # noqa: E402
from lmcache.v1.multiprocess.futures import MessagingFuture  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402

from lmcache_ascend.patches import State, registry  # noqa: E402
from tests.patching import apply_now  # noqa: E402

REGISTRY = registry.process_registry()

PATCH = "lmcache-mp-align-state-stores"
CONNECTOR = connector_module.LMCacheMPConnector
SERVER_DELAY_S = 0.4


class StandInAdapter:
    """The worker adapter's surface wait_for_save uses; each store gets a future the 'server' answers."""

    def __init__(self, answer_after_s: float | None):
        self.answer_after_s = answer_after_s
        self.store_futures: dict[str, MessagingFuture] = {}
        self.healthy = True
        self.submitted: list[str] = []
        self.drop = False

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    def create_recorded_event(self):
        return None

    def batched_submit_store_requests(self, request_ids, ops, event, cache_salts=None, request_configs_list=None):
        for request_id in request_ids:
            self.submitted.append(request_id)
            if self.drop:
                continue
            future = MessagingFuture()
            self.store_futures[request_id] = future
            if self.answer_after_s is not None:
                threading.Timer(self.answer_after_s, future.set_result, args=(True,)).start()


def _kv_cache_config(mamba: bool) -> KVCacheConfig:
    attention = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(layer_names=["layers.attn"], kv_cache_spec=attention)]
    if mamba:
        state = MambaSpec(block_size=128, shapes=((3, 288), (4, 16, 8)), dtypes=(torch.float32, torch.float32),
                          mamba_cache_mode="align")
        groups.insert(0, KVCacheGroupSpec(layer_names=["layers.mamba"], kv_cache_spec=state))
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _connector(mode: str, adapter: StandInAdapter, *, mamba: bool = True, stores=("r1", "r2")):
    """A worker-side LMCacheMPConnector with the fields wait_for_save reads (as upstream's __init__ sets them)."""
    connector = object.__new__(CONNECTOR)
    connector._vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode=mode))
    connector._kv_cache_config = _kv_cache_config(mamba)
    connector.worker_adapter = adapter
    connector.dispatcher = None
    metadata = LMCacheMPConnectorMetadata()
    for index, request_id in enumerate(stores):
        op = LoadStoreOp(token_ids=list(range(256)), block_ids=[[index], [index]], start=0, end=256)
        metadata.add_request_metadata(LMCacheMPRequestMetadata(request_id=request_id, direction="STORE", op=op))
    retrieve = LoadStoreOp(token_ids=list(range(256)), block_ids=[[9], [9]], start=0, end=256)
    metadata.add_request_metadata(LMCacheMPRequestMetadata(request_id="loading", direction="RETRIEVE", op=retrieve))
    connector._connector_metadata = metadata
    return connector


@pytest.fixture
def applied():
    original = CONNECTOR.__dict__["wait_for_save"]
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    yield
    REGISTRY.revert(PATCH)
    assert CONNECTOR.__dict__["wait_for_save"] is original


def _timed_save(connector) -> float:
    start = time.monotonic()
    connector.wait_for_save()
    return time.monotonic() - start


def test_align_mode_waits_until_the_server_answered(applied):
    adapter = StandInAdapter(answer_after_s=SERVER_DELAY_S)
    elapsed = _timed_save(_connector("align", adapter))
    assert adapter.submitted == ["r1", "r2"]
    assert all(future.query() for future in adapter.store_futures.values()), "returned before the server answered"
    assert elapsed >= SERVER_DELAY_S * 0.9


def test_control_without_the_patch_align_mode_does_not_wait():
    assert REGISTRY.record(PATCH).state is not State.APPLIED
    adapter = StandInAdapter(answer_after_s=SERVER_DELAY_S)
    _timed_save(_connector("align", adapter))
    assert adapter.submitted == ["r1", "r2"]
    assert not any(future.query() for future in adapter.store_futures.values())


@pytest.mark.parametrize("mode, mamba", [("none", True), ("all", True), ("align", False)])
def test_no_wait_outside_align_mode_with_state_groups(applied, mode, mamba):
    adapter = StandInAdapter(answer_after_s=None)  # never answered: a wait would not end
    elapsed = _timed_save(_connector(mode, adapter, mamba=mamba))
    assert adapter.submitted == ["r1", "r2"]
    assert elapsed < 0.5


def test_a_server_that_went_away_stops_the_wait(applied):
    adapter = StandInAdapter(answer_after_s=None)
    threading.Timer(SERVER_DELAY_S, setattr, args=(adapter, "healthy", False)).start()
    elapsed = _timed_save(_connector("align", adapter))
    assert not any(future.query() for future in adapter.store_futures.values())
    assert SERVER_DELAY_S * 0.9 <= elapsed < SERVER_DELAY_S + 2


def test_nothing_to_wait_for(applied):
    adapter = StandInAdapter(answer_after_s=None)
    assert _timed_save(_connector("align", adapter, stores=())) < 0.5
    assert adapter.submitted == []
    adapter.drop = True  # unhealthy at submission: upstream drops the store and keeps no future
    assert _timed_save(_connector("align", adapter)) < 0.5
    assert adapter.submitted == ["r1", "r2"] and not adapter.store_futures


class FixedUpstreamConnector:
    """An upstream whose wait_for_save holds align-mode state blocks until they were copied."""

    def wait_for_save(self):
        if self._mamba_align:
            self.worker_adapter.wait_for_store_copies()


def test_the_guard_tells_a_fixed_upstream_from_lmcache_0_5_6():
    from lmcache_ascend.patches.lmcache.mp_align_state_stores import PATCH as declared

    probe = declared.guard.probe
    assert probe(connector_module) is False
    fixed = types.ModuleType("fixed_upstream")
    fixed.LMCacheMPConnector = FixedUpstreamConnector
    assert probe(fixed) is True
    assert probe(types.ModuleType("no_connector")) is None
