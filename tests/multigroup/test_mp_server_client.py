"""LMCache 0.4.x's real MP worker adapter negotiating per-group block ids (stack A, CPU).

The adapter is LMCache's own class; its message-queue client is a recorder
answering as a server would (a per-group server's answer, or nothing), and
CUDA IPC wrapping of the caches is replaced (no CUDA here). The real server
process runs in test_mp_server_cuda.py.
"""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch

from lmcache_ascend.compat.versions import installed_version
from tests import stack

stack.only_with_lmcache_04("the MP worker adapter's wire-format patch (0.5.x speaks per-group ids itself)")

from lmcache.integration.vllm import vllm_multi_process_adapter as adapter_module  # noqa: E402
from lmcache.v1.multiprocess.futures import MessagingFuture  # noqa: E402
from lmcache.v1.multiprocess.protocol import RequestType, get_payload_classes  # noqa: E402

from lmcache_ascend.multigroup.attachments import GROUP_HINTS, SERVER_FORMAT  # noqa: E402
from lmcache_ascend.multigroup.mp_server import (  # noqa: E402
    HINT_GROUP_BLOCK_SIZES,
    HINT_LAYER_GROUPS,
    client_hints,
    server_answer,
)
from lmcache_ascend.multigroup.mp_wire import FLAT, PER_GROUP, WireFormatMismatch  # noqa: E402
from lmcache_ascend.patches import State, registry  # noqa: E402
from tests.patching import apply_now  # noqa: E402

REGISTRY = registry.process_registry()
PATCHES = ("lmcache-mp-server-protocol", "lmcache-mp-client-wire-format")


class _HostFuture(MessagingFuture):
    """The adapter waits on a CUDA event beside the answer; no CUDA here."""

    def to_cuda_future(self, device=None):
        return self


class _Server:
    """Records requests as the server would decode them; answers REGISTER with `answer`."""

    def __init__(self, answer):
        self.answer = answer
        self.requests = []

    def submit_request(self, request_type, payloads, response_cls):
        decoded = [msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=cls) if cls is not bytes else p
                   for p, cls in zip(payloads, get_payload_classes(request_type))
                   if request_type is not RequestType.REGISTER_KV_CACHE or cls is not get_payload_classes(request_type)[1]]
        self.requests.append((request_type, decoded))
        future = _HostFuture()
        future.set_result(self.answer if request_type is RequestType.REGISTER_KV_CACHE else (b"", True))
        return future


class _Event:
    def ipc_handle(self):
        return b"event"


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(adapter_module, "wrap_kv_caches", lambda caches: [])  # CUDA IPC handles: no CUDA here
    for name in PATCHES:
        assert apply_now(REGISTRY, name) is State.APPLIED, REGISTRY.record(name).reason
    yield
    for name in reversed(PATCHES):
        assert REGISTRY.revert(name) is State.REVERTED


def _adapter(server, hints):
    worker = object.__new__(adapter_module.LMCacheMPWorkerAdapter)
    strategy = adapter_module.ParallelStrategy(False, 1, 0, 1, 0, 1, 1)
    worker.__dict__.update(
        mq_client=server, _mq_timeout=5.0, instance_id=7, kv_caches={}, store_futures={}, retrieve_futures={},
        error_block_ids=set(), finished_stores=set(), model_name="m", parallel_strategy=strategy,
        vllm_logical_block_size=4, _health_event=threading.Event(), _heartbeat=object(),
    )
    worker._health_event.set()
    if hints is not None:
        GROUP_HINTS.set(worker, hints)
    return worker


def _op(block_ids):
    return adapter_module.LoadStoreOp(token_ids=list(range(32)), block_ids=block_ids, start=0, end=32)


HINTS = client_hints([0, 1, 0, 1], (8, 4), "test client")
CACHES = {f"l{i}": torch.zeros(1) for i in range(4)}


def test_registration_carries_hints_without_engine_block_size_and_reads_answer(patched):
    server = _Server(server_answer("lmcache-ascend x on LMCache 0.4.5"))
    worker = _adapter(server, HINTS)
    worker.register_kv_caches(CACHES)
    (request_type, payload), = server.requests
    assert request_type is RequestType.REGISTER_KV_CACHE
    hints = payload[-1]
    assert hints[HINT_LAYER_GROUPS] == [0, 1, 0, 1] and hints[HINT_GROUP_BLOCK_SIZES] == [8, 4]
    assert "inference_engine_logical_block_size" not in hints
    assert SERVER_FORMAT.get(worker) == (PER_GROUP, "lmcache-ascend x on LMCache 0.4.5")

    worker.submit_store_request("s", _op([[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]]), _Event())
    worker.submit_retrieve_request("r", _op([[21, 22, 23, 24], [25, 26, 27, 28, 29, 30, 31, 32]]), _Event())
    assert server.requests[1][1][2] == [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]]
    assert server.requests[2][1][2] == [[21, 22, 23, 24], [25, 26, 27, 28, 29, 30, 31, 32]]
    assert worker.retrieve_futures["r"][1] == list(range(21, 33))  # flat: vLLM's block pool is shared


def test_flat_server_refuses_first_multi_group_request_naming_both_sides(patched):
    server = _Server(None)  # a server without the per-group protocol answers a registration with nothing
    worker = _adapter(server, HINTS)
    worker.register_kv_caches(CACHES)
    assert SERVER_FORMAT.get(worker) == (FLAT, None)
    for submit in (worker.submit_store_request, worker.submit_retrieve_request):
        with pytest.raises(WireFormatMismatch) as error:
            submit("x", _op([[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]]), _Event())
        message = str(error.value)
        assert f"vLLM {installed_version('vllm')}" in message and f"LMCache {installed_version('lmcache')}" in message
    assert len(server.requests) == 1 and not worker.store_futures and not worker.retrieve_futures


def test_single_group_adapter_sends_exactly_what_upstream_sends(patched, monkeypatch):
    def sent(apply: bool):
        server = _Server(None)
        worker = _adapter(server, None)
        worker.register_kv_caches(CACHES)
        worker.submit_store_request("s", _op([3, 4, 5]), _Event())
        worker.submit_retrieve_request("r", _op([6, 7, 8]), _Event())
        return [(t, [msgspec.msgpack.encode(p) for p in payload]) for t, payload in server.requests]

    ours = sent(True)
    for name in reversed(PATCHES):
        REGISTRY.revert(name)
    try:
        upstream = sent(False)
    finally:
        for name in PATCHES:
            apply_now(REGISTRY, name)
    assert ours == upstream
    assert ours[1][1][2] == msgspec.msgpack.encode([3, 4, 5])


def test_unhealthy_retrieve_keeps_flat_error_block_ids(patched):
    worker = _adapter(_Server(server_answer("s")), HINTS)
    worker.register_kv_caches(CACHES)
    worker._health_event.clear()
    worker.submit_retrieve_request("r", _op([[1, 2], [3, 4, 5]]), _Event())
    assert worker.get_block_ids_with_load_errors() == {1, 2, 3, 4, 5}
