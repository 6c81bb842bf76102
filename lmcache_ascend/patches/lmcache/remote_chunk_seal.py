"""Seal the chunks LMCache's remote backend sends, check the ones it receives.

For a backend whose engine moves lmcache-ascend chunk buffers (its metadata carries
the `CHUNK_PLANNER` attachment), ``submit_put_task`` / ``batched_submit_put_task``
seal each buffer before upstream serializes it (`kv_worker.chunk_seal`: the buffer's
reserved tail), and ``get_blocking`` / ``batched_get_blocking`` /
``batched_get_non_blocking`` check each buffer upstream returns. A buffer of another
size than the planner's for its token count, or whose seal does not match, is
released and returned as None (a batch stops at it, as upstream stops at a missing
chunk), and its key is logged.

A key whose load failed (it failed the seal, or upstream's get gave nothing: evicted,
flushed, unreadable, the server gone) is remembered, and ``contains`` /
``batched_contains`` / ``batched_async_contains`` answer a miss at it until a store of
that key completes. The request that met the failure is computed again, and the
lookup of its retry must not find the same key and fail the same way: each failed key
costs one retry at most. Other backends' engines run upstream unchanged.
"""

from __future__ import annotations

import threading

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.connector.sealed_chunks import is_intact, leading, planner_of, reject, release, seal_buffers
from lmcache_ascend.multigroup.attachments import FAILED_KEYS
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

# Failed keys remembered per backend at most (a bound, not a cache policy: past it the
# oldest are forgotten, and a lookup of one of those may fail once more).
_MAX_FAILED_KEYS = 1 << 16
_lock = threading.Lock()


def _note_failed(backend, key) -> None:
    keys = FAILED_KEYS.get(backend)
    if keys is None:
        keys = {}
        FAILED_KEYS.set(backend, keys)
    with _lock:
        keys[key] = None
        while len(keys) > _MAX_FAILED_KEYS:
            keys.pop(next(iter(keys)))


def _checked(backend, planner, keys, memory_objs):
    """`memory_objs` up to the first missing or damaged one (released from there on), then None for
    the rest; the key of that one noted as failed."""
    checked = list(memory_objs)
    for index, (key, memory_obj) in enumerate(zip(keys, checked)):
        if memory_obj is None:
            _note_failed(backend, key)
            return checked
        if not is_intact(memory_obj, planner):
            reject(key, memory_obj, getattr(backend, "remote_url", backend))
            _note_failed(backend, key)
            for later in checked[index + 1:]:
                if later is not None:
                    release(later)
            return checked[:index] + [None] * (len(checked) - index)
    return checked


def _forget_on_completion(backend, keys, future) -> None:
    failed = FAILED_KEYS.get(backend)
    if not failed:
        return

    def forget() -> None:
        with _lock:
            for key in keys:
                failed.pop(key, None)

    if hasattr(future, "add_done_callback"):
        future.add_done_callback(lambda done: done.cancelled() or done.exception() is not None or forget())
    else:  # no future to wait for (upstream's batched put): the keys go once the store is issued
        forget()


def _first_failed(backend, keys) -> int | None:
    failed = FAILED_KEYS.get(backend)
    if not failed:
        return None
    return next((index for index, key in enumerate(keys) if key in failed), None)


# Every wrapper runs upstream alone for a backend whose engine moves no lmcache-ascend chunks.


def submit_put_task_wrapper(wrapped, instance, args, kwargs):
    planner = planner_of(instance)
    if planner is None:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs).arguments
    seal_buffers(planner, [call["memory_obj"]])
    future = wrapped(*args, **kwargs)
    _forget_on_completion(instance, [call["key"]], future)
    return future


def batched_submit_put_task_wrapper(wrapped, instance, args, kwargs):
    planner = planner_of(instance)
    if planner is None:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs).arguments
    keys = list(call["keys"])
    seal_buffers(planner, call["memory_objs"])
    result = wrapped(*args, **kwargs)
    _forget_on_completion(instance, keys, result)
    return result


def get_blocking_wrapper(wrapped, instance, args, kwargs):
    memory_obj = wrapped(*args, **kwargs)
    planner = planner_of(instance)
    if planner is None:
        return memory_obj
    return _checked(instance, planner, [call_arguments(wrapped, args, kwargs).arguments["key"]], [memory_obj])[0]


def batched_get_blocking_wrapper(wrapped, instance, args, kwargs):
    memory_objs = wrapped(*args, **kwargs)
    planner = planner_of(instance)
    if planner is None:
        return memory_objs
    return _checked(instance, planner, list(call_arguments(wrapped, args, kwargs).arguments["keys"]), memory_objs)


async def batched_get_non_blocking_wrapper(wrapped, instance, args, kwargs):
    memory_objs = await wrapped(*args, **kwargs)
    planner = planner_of(instance)
    if planner is None:
        return memory_objs
    keys = list(call_arguments(wrapped, args, kwargs).arguments["keys"])
    return leading(_checked(instance, planner, keys, memory_objs))


# The lookups below run for every request: with no failed key (the common case) they cost one
# attribute read on top of upstream's.


def contains_wrapper(wrapped, instance, args, kwargs):
    if not FAILED_KEYS.get(instance):
        return wrapped(*args, **kwargs)
    key = call_arguments(wrapped, args, kwargs).arguments["key"]
    return _first_failed(instance, [key]) is None and wrapped(*args, **kwargs)


def batched_contains_wrapper(wrapped, instance, args, kwargs):
    found = wrapped(*args, **kwargs)
    if not FAILED_KEYS.get(instance):
        return found
    first = _first_failed(instance, list(call_arguments(wrapped, args, kwargs).arguments["keys"])[:found])
    return found if first is None else first


async def batched_async_contains_wrapper(wrapped, instance, args, kwargs):
    found = await wrapped(*args, **kwargs)
    if not FAILED_KEYS.get(instance):
        return found
    first = _first_failed(instance, list(call_arguments(wrapped, args, kwargs).arguments["keys"])[:found])
    return found if first is None else first


_WRAPPERS = {
    "RemoteBackend.submit_put_task": submit_put_task_wrapper,
    "RemoteBackend.batched_submit_put_task": batched_submit_put_task_wrapper,
    "RemoteBackend.get_blocking": get_blocking_wrapper,
    "RemoteBackend.batched_get_blocking": batched_get_blocking_wrapper,
    "RemoteBackend.batched_get_non_blocking": batched_get_non_blocking_wrapper,
    "RemoteBackend.contains": contains_wrapper,
    "RemoteBackend.batched_contains": batched_contains_wrapper,
    "RemoteBackend.batched_async_contains": batched_async_contains_wrapper,
}

PATCH = Patch(
    name="lmcache-remote-chunk-seal",
    target="lmcache.v1.storage_backend.remote_backend",
    attributes=tuple(_WRAPPERS),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    flags=("LMCACHE_ASCEND_CHUNK_SEAL",),
    enabled_by="LMCACHE_ASCEND_CHUNK_SEAL",
    guard=UpstreamGuard(
        # Upstream checks no digest of a remote chunk; the source test only proves the paths are there.
        unfixed_if_source_contains=("def get_blocking(", "def submit_put_task("),
    ),
    wrappers=_WRAPPERS,
    summary="lmcache-ascend chunks sent to a remote backend carry a seal (length, xxHash3); a chunk that fails it is a miss",
    why="a remote chunk truncated or altered (a buggy peer, a bad write, memory errors) was loaded into vLLM's "
    "paged cache as it came and gave wrong tokens silently",
    mirrors="LMCache's remote backend put and get paths (RemoteBackend), around its serializer",
    delete_when="LMCache checks the integrity of remote chunks itself",
    # LMCache 0.4.5 and 0.5.6.
    tested_fingerprints={
        "RemoteBackend.submit_put_task": ("723b723edff5", "45ffe5a6dba3"),
        "RemoteBackend.batched_submit_put_task": ("8a85646b0c85", "83edb8b24826"),
        "RemoteBackend.get_blocking": ("e511e9382174",),
        "RemoteBackend.batched_get_blocking": ("e58b0cfb62d8", "4e84fcc49204"),
        "RemoteBackend.batched_get_non_blocking": ("b567ba0609e0", "97d3a72a175c"),
        "RemoteBackend.contains": ("6799c985bbee", "13a038cbe3cb"),
        "RemoteBackend.batched_contains": ("d4e2bc7ec657", "e44f5bc799d6"),
        "RemoteBackend.batched_async_contains": ("54d1c8b9c7d9", "5258bbd98083"),
    },
)
