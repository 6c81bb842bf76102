"""The real LMCache 0.4.5 MP server process with per-KV-cache-group block ids (CUDA only).

LMCache 0.4.5's MP server needs CUDA: KV caches arrive as CUDA IPC handles,
store/retrieve wait on interprocess CUDA events and its event bus runs on cupy
streams. Its server module imports cupy at load time, and without CUDA LMCache
falls back to Python ops that lack the block transfer every store and retrieve
calls, so that release's server cannot run on a CPU or NPU host at all. So this
test skips without CUDA or cupy, and runs on a GPU machine with the stack's
LMCache 0.4.5.

Two server processes: one launched by importing the server module after
``import lmcache_ascend`` (the overlay's server patches apply), one started as
``python -m lmcache.v1.multiprocess.server`` without the overlay (flat protocol).
The test process is the client: LMCache 0.4.5's own worker and scheduler
adapters with the overlay's protocol and client patches, KV caches of five
KV-cache groups shaped like vLLM's CUDA DeepSeek-V4 groups (256/64/64/4/8
tokens per block against vLLM's 4; three of them compressed), ten layers,
two groups' layers of equal shape.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import stack

stack.only_with_lmcache_04("the per-group MP server patches")
if not torch.cuda.is_available():
    pytest.skip(
        "LMCache 0.4.5's MP server needs CUDA (CUDA IPC KV handles, interprocess events, cupy streams); no CUDA device",
        allow_module_level=True,
    )
pytest.importorskip("cupy", reason="LMCache 0.4.5's MP server imports cupy at module level")

from lmcache_ascend.multigroup.attachments import GROUP_HINTS, SERVER_FORMAT  # noqa: E402
from lmcache_ascend.multigroup.mp_server import client_hints  # noqa: E402
from lmcache_ascend.multigroup.mp_wire import FLAT, PER_GROUP, WireFormatMismatch  # noqa: E402
from lmcache_ascend.patches import State, registry  # noqa: E402
from tests.patching import apply_now  # noqa: E402

REGISTRY = registry.process_registry()
ROOT = Path(__file__).resolve().parents[2]
TOKENS_PER_BLOCK = (256, 64, 64, 4, 8)  # per KV-cache group; vLLM block size = GCD = 4
ROWS_PER_BLOCK = (64, 64, 16, 4, 8)  # paged rows per block: compress ratios 4, 1, 4, 1, 1
VLLM_BS, CHUNK, TOKENS = 4, 256, 4096
NUM_BLOCKS, HEADS, HEAD_SIZE = 1100, 2, 16
LAYER_GROUPS = (0, 1, 2, 3, 4, 0, 1, 2, 3, 4)  # layers 0 and 1 (groups 0, 1) have equal shapes
CLIENT_PATCHES = ("lmcache-mp-server-protocol", "lmcache-mp-client-wire-format")
POISON = 0x5A

_LAUNCH_PATCHED = """
import sys
import lmcache_ascend  # activates the overlay before LMCache's server modules are imported
from lmcache.v1.multiprocess import server
sys.argv = ["lmcache-mp-server", *sys.argv[1:]]
args = server.parse_args()
server.run_cache_server(
    mp_config=server.parse_args_to_mp_server_config(args),
    storage_manager_config=server.parse_args_to_config(args),
    obs_config=server.parse_args_to_observability_config(args),
)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(patched: bool, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", "1", "--eviction-policy", "LRU",
            "--disable-observability"]
    env = dict(os.environ, LMCACHE_LOG_LEVEL="INFO")  # readiness is read from the server's INFO log
    if patched:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        command = [sys.executable, "-c", _LAUNCH_PATCHED, *args]
    else:
        env["LMCACHE_ASCEND_AUTOLOAD"] = "0"
        command = [sys.executable, "-m", "lmcache.v1.multiprocess.server", *args]
    process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.monotonic() + 120
    while "cache server is running..." not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            pytest.fail(f"LMCache MP server did not start (patched={patched}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return process, f"tcp://127.0.0.1:{port}"


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def client_patches():
    for name in CLIENT_PATCHES:
        assert apply_now(REGISTRY, name) is State.APPLIED, REGISTRY.record(name).reason
    yield
    for name in reversed(CLIENT_PATCHES):
        REGISTRY.revert(name)


@pytest.fixture(scope="module")
def patched_server(tmp_path_factory, client_patches):
    log = tmp_path_factory.mktemp("server") / "patched.log"
    process, url = _start(True, log)
    yield url, log
    _stop(process)
    print(f"--- patched server log (tail)\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def flat_server(tmp_path_factory, client_patches):
    log = tmp_path_factory.mktemp("server") / "flat.log"
    process, url = _start(False, log)
    yield url
    _stop(process)


def _adapters(url: str, hints: dict | None):
    import zmq
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        ParallelStrategy,
    )

    strategy = ParallelStrategy(use_mla=False, kv_world_size=1, kv_worker_id=0, actual_world_size=1,
                                actual_worker_id=0, tp_size=1, pp_size=1)
    context = zmq.Context.instance()
    worker = LMCacheMPWorkerAdapter(url, context, "dsv4-like", VLLM_BS, strategy, mq_timeout=60)
    if hints is not None:
        GROUP_HINTS.set(worker, hints)
    scheduler = LMCacheMPSchedulerAdapter(url, context, "dsv4-like", VLLM_BS, strategy, mq_timeout=60)
    return worker, scheduler


def _caches() -> dict[str, torch.Tensor]:
    """Ten layers [2, NB, rows, NH, HS] fp16 with random bytes (vLLM flash-attention layout)."""
    generator = torch.Generator(device="cuda").manual_seed(12)
    caches = {}
    for layer, group in enumerate(LAYER_GROUPS):
        tensor = torch.empty(2, NUM_BLOCKS, ROWS_PER_BLOCK[group], HEADS, HEAD_SIZE, dtype=torch.float16, device="cuda")
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=generator))
        caches[f"model.layers.{layer}.self_attn.attn"] = tensor
    return caches


def _block_ids(seed: int) -> list[list[int]]:
    """Per group, distinct non-null block ids for TOKENS tokens ([16, 64, 64, 1024, 512])."""
    rng = random.Random(seed)
    return [rng.sample(range(1, NUM_BLOCKS), TOKENS // size) for size in TOKENS_PER_BLOCK]


def _op(tokens, block_ids):
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    return LoadStoreOp(token_ids=list(tokens), block_ids=block_ids, start=0, end=len(tokens))


def _event():
    event = torch.cuda.Event(interprocess=True)
    event.record()
    return event


LOOKUP_ANSWER_TIMEOUT_S = 60  # one lookup's answer from the server
STORE_VISIBLE_TIMEOUT_S = 60  # a finished store becoming visible to lookups


def _lookup_answer(scheduler, request_id: str, tokens) -> int:
    """Submit one lookup and poll for its answer until LOOKUP_ANSWER_TIMEOUT_S; fail naming it."""
    scheduler.maybe_submit_lookup_request(request_id, list(tokens))
    deadline = time.monotonic() + LOOKUP_ANSWER_TIMEOUT_S
    while (found := scheduler.check_lookup_result(request_id)) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"lookup {request_id!r} ({len(tokens)} tokens) got no answer from the MP server "
                        f"in {LOOKUP_ANSWER_TIMEOUT_S} s")
        time.sleep(0.05)  # poll interval
    return found


def _lookup(scheduler, tokens, name: str) -> int:
    """Tokens LMCache holds for `tokens`: lookups until one finds any (a store's keys land on a
    host callback), for at most STORE_VISIBLE_TIMEOUT_S; fails naming what it waited for."""
    deadline = time.monotonic() + STORE_VISIBLE_TIMEOUT_S
    attempt = 0
    while not (found := _lookup_answer(scheduler, f"{name}-{attempt}", tokens)):
        if time.monotonic() > deadline:
            pytest.fail(f"a finished store of {len(tokens)} tokens was not visible to lookups in "
                        f"{STORE_VISIBLE_TIMEOUT_S} s ({attempt + 1} lookups, each found 0 tokens)")
        attempt += 1
        time.sleep(0.25)  # poll interval
    return found


def test_dsv4_groups_store_and_retrieve_every_byte(patched_server):
    url, _ = patched_server
    hints = client_hints(list(LAYER_GROUPS), TOKENS_PER_BLOCK, "lmcache-ascend test client")
    worker, scheduler = _adapters(url, hints)
    caches = _caches()
    worker.register_kv_caches(caches)
    assert SERVER_FORMAT.get(worker)[0] == PER_GROUP, SERVER_FORMAT.get(worker)

    tokens = list(range(1, TOKENS + 1))
    stored_ids = _block_ids(1)
    saved = {name: tensor.clone() for name, tensor in caches.items()}
    worker.submit_store_request("store-1", _op(tokens, stored_ids), _event())
    assert worker.store_futures["store-1"].result(timeout=120) is True

    assert _lookup(scheduler, tokens, "load") == TOKENS

    for tensor in caches.values():
        tensor.view(torch.uint8).fill_(POISON)
    loaded_ids = _block_ids(2)
    assert loaded_ids != stored_ids
    request_id = "load-hit"
    _lookup_answer(scheduler, request_id, tokens)  # the lookup a retrieve follows, as vLLM's scheduler does
    worker.submit_retrieve_request(request_id, _op(tokens, loaded_ids), _event())
    assert worker.retrieve_futures[request_id][0].result(timeout=120) is True
    torch.cuda.synchronize()

    for layer, (name, tensor) in enumerate(caches.items()):
        group = LAYER_GROUPS[layer]
        got = tensor.view(torch.uint8)
        want = saved[name].view(torch.uint8)
        into = torch.tensor(loaded_ids[group], device="cuda")
        source = torch.tensor(stored_ids[group], device="cuda")
        assert torch.equal(got[:, into], want[:, source]), f"layer {layer} (group {group}): bytes differ"
        untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool, device="cuda")
        untouched[into] = False
        assert bool((got[:, untouched] == POISON).all()), f"layer {layer}: a block outside the request was written"
    worker.shutdown()


def test_a_group_missing_from_a_step_is_refused_and_nothing_stored(patched_server):
    url, log = patched_server
    hints = client_hints(list(LAYER_GROUPS), TOKENS_PER_BLOCK, "lmcache-ascend test client")
    worker, scheduler = _adapters(url, hints)
    worker.instance_id += 1  # a second engine of this process
    caches = _caches()
    worker.register_kv_caches(caches)
    tokens = list(range(50_000, 50_000 + TOKENS))
    block_ids = _block_ids(3)
    block_ids[4] = []  # group 4 sent no blocks this step
    worker.submit_store_request("store-missing", _op(tokens, block_ids), _event())
    assert worker.store_futures["store-missing"].result(timeout=120) is False
    assert "group 4: 0 ids, 512 needed" in log.read_text()
    assert _lookup_answer(scheduler, "missing-lookup", tokens) == 0
    worker.shutdown()


def test_flat_server_refuses_multi_group_naming_both_versions(flat_server):
    hints = client_hints(list(LAYER_GROUPS), TOKENS_PER_BLOCK, "lmcache-ascend test client")
    worker, _ = _adapters(flat_server, hints)
    worker.register_kv_caches(_caches())
    assert SERVER_FORMAT.get(worker) == (FLAT, None)
    with pytest.raises(WireFormatMismatch) as error:
        worker.submit_store_request("store-flat", _op(range(TOKENS), _block_ids(4)), _event())
    message = str(error.value)
    assert "lmcache-ascend" in message and f"LMCache {_VERSION}" in message and "5 KV-cache groups" in message
    assert "store-flat" not in worker.store_futures
    worker.shutdown()
