"""Faults of a shared KV store, injected into a running engine between LMCache's lookup and its load.

`arm` runs inside each vLLM worker (``LLM.collective_rpc``): the next call of the
worker's LMCache engine ``retrieve`` waits for the engine's remote writes to complete, does
the fault to the store, then loads.
The scheduler has already looked the chunks up (they were there), so the load meets
the damage: that is the moment a shared cache's eviction, flush or restart hits a
serving engine. A fault named ``<fault>@store`` is done at the next ``store`` instead
(the server gone while the engine writes). `restart` (in the runner's own process, between rounds) brings a
killed server back, empty, on its port.

Stores: ``{"redis": port}`` (LMCache's Redis connector: a chunk is two keys,
``<key>metadata`` and ``<key>kv_bytes``), ``{"lm": port}`` (LMCache's own server),
``{"fs": folder}`` (LMCache's file-system connector, ``fs://``: a chunk is one ``.data``
file), ``{"disk": folder}`` (LMCache's local disk backend: one ``.pt`` file a chunk,
indexed in the worker's memory) or ``{"mp": port, "chunk_size": n}`` (LMCache's MP
server, its chunks in its own memory; a fault is done at the worker adapter's next
batch of retrieve, or with ``@store`` store, requests).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Every fault this module can do, by store.
REDIS_FAULTS = ("flushall", "delete-one", "truncate", "truncate-consistent", "xor", "empty-metadata", "kill")
LM_FAULTS = ("kill",)
FILE_FAULTS = ("wipe", "delete-one", "truncate", "xor", "rmdir")
_FILE_SUFFIX = {"fs": ".data", "disk": ".pt"}

_armed: list = []  # (engine method, fault, store) for the next call of that method in this worker


def _redis(port: int):
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)


def _chunk_keys(client) -> list[bytes]:
    """The stored chunks' key prefixes, in a fixed order."""
    return sorted(key[: -len(b"kv_bytes")] for key in client.keys(b"*kv_bytes"))


def _redis_fault(fault: str, port: int) -> None:
    client = _redis(port)
    if fault == "flushall":
        client.flushall()
        return
    if fault == "kill":
        try:
            client.shutdown(nosave=True)
        except Exception:  # the server drops the connection as it goes
            pass
        return
    chunks = _chunk_keys(client)
    assert chunks, "the store holds no chunk to damage"
    if fault == "delete-one":
        victim = chunks[len(chunks) // 2]
        client.delete(victim + b"kv_bytes", victim + b"metadata")
        return
    for chunk in chunks:
        value = client.get(chunk + b"kv_bytes")
        if fault == "truncate":  # the bytes shortened, the metadata left saying the old length
            client.set(chunk + b"kv_bytes", value[: len(value) // 2])
        elif fault == "truncate-consistent":  # the metadata's length says the shortened length too
            from lmcache.v1.protocol import RemoteMetadata

            metadata = RemoteMetadata.deserialize(memoryview(client.get(chunk + b"metadata")))
            short = value[: len(value) // 2]
            metadata.length = len(short)
            client.set(chunk + b"kv_bytes", short)
            client.set(chunk + b"metadata", metadata.serialize())
        elif fault == "xor":  # every byte flipped, lengths and metadata intact
            client.set(chunk + b"kv_bytes", bytes(byte ^ 0xA5 for byte in value))
        elif fault == "empty-metadata":  # the bytes intact, the metadata key holding nothing
            client.set(chunk + b"metadata", b"")
        else:
            raise ValueError(f"unknown Redis fault {fault!r}; allowed: {', '.join(REDIS_FAULTS)}")


def _file_fault(fault: str, folder: Path, suffix: str) -> None:
    """`fault` done to the chunk files of `folder` (``rmdir``: the folder itself removed)."""
    import shutil

    if fault == "rmdir":
        shutil.rmtree(folder)
        return
    chunks = sorted(folder.glob(f"*{suffix}"))
    assert chunks, f"{folder} holds no chunk file to damage"
    if fault == "delete-one":
        chunks[len(chunks) // 2].unlink()
        return
    for chunk in chunks:
        value = chunk.read_bytes()
        if fault == "wipe":
            chunk.unlink()
        elif fault == "truncate":
            chunk.write_bytes(value[: len(value) // 2])
        elif fault == "xor":  # the second half's bytes flipped: a header LMCache reads first stays whole
            half = len(value) // 2
            chunk.write_bytes(value[:half] + bytes(byte ^ 0xA5 for byte in value[half:]))
        else:
            raise ValueError(f"unknown file fault {fault!r}; allowed: {', '.join(FILE_FAULTS)}")


def pid_listening_on(port: int) -> int:
    """The process listening on loopback TCP `port` (read from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            for fd in (process / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(process.name)
        except OSError:
            continue
    raise LookupError(f"no process listens on port {port}")


def _do(fault: str, store: dict) -> None:
    if "redis" in store:
        _redis_fault(fault, store["redis"])
    elif "fs" in store or "disk" in store:
        kind = "fs" if "fs" in store else "disk"
        _file_fault(fault, Path(store[kind]), _FILE_SUFFIX[kind])
    elif fault == "kill":
        os.kill(pid_listening_on(store.get("lm") or store["mp"]), signal.SIGKILL)
    else:
        raise ValueError(f"unknown fault {fault!r} of LMCache's server; allowed: {', '.join(LM_FAULTS)}")


def _engine():
    """What a fault hooks in this worker: LMCache's engine in process, or the MP connector's worker adapter."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    adapter = getattr(connector, "worker_adapter", None)
    return adapter if adapter is not None else connector._lmcache_engine.lmcache_engine


def _settle(engine, timeout_s: float = 60.0) -> None:
    """Wait until every write the engine sent to a remote backend has completed, with its
    completion callbacks (LMCache's and the overlay's), so a fault meets the store as the engine
    left it rather than racing a write of the round before."""
    import asyncio

    storage = getattr(engine, "storage_manager", None)  # (an MP worker adapter has none: its server stores)
    backends = [backend for backend in storage.storage_backends.values()
                if hasattr(backend, "put_tasks")] if storage is not None else []
    deadline = time.monotonic() + timeout_s
    for backend in backends:
        while True:
            with backend.lock:
                pending = len(backend.put_tasks)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pending} remote writes still pending after {timeout_s} s")
            time.sleep(0.01)
        # Upstream's callback empties put_tasks; the overlay's runs next in the same loop turn.
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), backend.loop).result(timeout_s)


def settle(worker) -> None:
    """Runs inside each vLLM worker: `_settle` its engine."""
    _settle(_engine())


def arm(worker, fault: str, store: dict) -> None:
    """Runs inside each vLLM worker: the next ``retrieve`` (or, for ``<fault>@store``, ``store``) of
    its LMCache engine does `fault` first."""
    engine = _engine()
    fault, _, method = fault.partition("@")
    if "mp" in store:
        method = {"": "batched_submit_retrieve_requests", "store": "batched_submit_store_requests"}[method]
    method = method or "retrieve"
    _armed[:] = [(method, fault, store)]
    original = getattr(engine, method)
    if getattr(original, "_fault_hook", False):
        return

    def hooked(*args, **kwargs):
        if _armed and _armed[0][0] == method:
            _settle(engine)
            _do(*_armed.pop()[1:])
        return original(*args, **kwargs)

    hooked._fault_hook = True
    setattr(engine, method, hooked)


def disarm(worker) -> bool:
    """Runs inside each vLLM worker: drops an armed fault no load met; whether one was met."""
    met = not _armed
    _armed.clear()
    return met


def wait_until_healthy(worker, timeout_s: float = 60.0) -> bool:
    """Runs inside each vLLM worker after a restart: waits until an MP worker adapter's heartbeat
    finds the server again (it re-registers the KV caches first), then two heartbeats more, in
    which the scheduler's adapter (in the engine core, pinging at the same interval) finds it too.
    An in-process engine has nothing to wait for."""
    adapter = _engine()
    if not hasattr(adapter, "_heartbeat_interval"):  # LMCache's engine in process
        return True
    deadline = time.monotonic() + timeout_s
    while not adapter.is_healthy:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the MP server was not healthy again after {timeout_s} s")
        time.sleep(0.05)
    time.sleep(2 * adapter._heartbeat_interval)
    return True


def worker_counts(worker) -> dict:
    """Runs inside each vLLM worker: chunks found damaged by the seal check."""
    from lmcache_ascend.connector import sealed_chunks

    return {"damaged_chunks": sealed_chunks.damaged_chunks}


def restart(store: dict, timeout_s: float = 120.0) -> subprocess.Popen | None:
    """Start the store's server again, empty, on its port (in the runner's process group), and
    wait until it listens; a removed folder store is made again, empty."""
    from tests.engine import harness

    if "fs" in store or "disk" in store:
        Path(store.get("fs") or store["disk"]).mkdir(parents=True, exist_ok=True)
        return None
    if "redis" in store:
        port, command = store["redis"], harness.redis_command(store["redis"])
    elif "mp" in store:
        port, command = store["mp"], harness.mp_server_command(store["mp"], store["chunk_size"])
    else:
        port, command = store["lm"], harness.remote_server_command(store["lm"])
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the restarted server on port {port} is not listening ({command[0]})")
        time.sleep(0.2)
