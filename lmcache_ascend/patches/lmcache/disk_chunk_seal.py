"""Seal the chunks LMCache's local disk backend writes, check the ones it reads back.

A chunk file can be cut short (a full disk, a crash mid-write), altered or deleted
under a running engine. Upstream reads a short file into the rest of a reused buffer
without a word, so a damaged file became wrong tokens. For a backend whose engine moves
lmcache-ascend chunk buffers, ``submit_put_task`` seals each buffer before it is queued
for writing (upstream's batched put submits through it), and ``get_blocking`` /
``batched_get_blocking`` / ``batched_get_non_blocking`` check each buffer read back.
``read_file`` zeroes a buffer's seal before upstream reads the file into it: the
allocator hands out buffers that held other chunks, and a file cut short would
otherwise leave an earlier chunk's bytes, seal included, in the rest of it. A file that
is gone is not read at all: upstream would drop the key's index entry and then look
its positions up there (a KeyError out of ``get_blocking`` on LMCache 0.4.5, the buffer
kept), where the zeroed seal makes it one more failed check. A
buffer that fails is released and returned as None (a batch stops at it), its key is
logged and removed from the backend (index entry and file): the next lookup misses
there, the request is computed again, and the next store writes the chunk anew.
"""

from __future__ import annotations

import os

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.connector.sealed_chunks import (
    clear_seal,
    is_intact,
    leading,
    planner_of,
    reject,
    release,
    seal_buffers,
)
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def _forget(backend, key) -> None:
    """The key's index entry and file dropped through upstream's ``remove`` (which accounts the
    size and the eviction policy). LMCache 0.4.5's ``remove`` keeps the index lock when the file
    is already gone, so an empty file takes its place first."""
    meta = backend.dict.get(key)
    if meta is None:
        return
    try:
        if not os.path.exists(meta.path):
            open(meta.path, "wb").close()
    except OSError:  # the folder itself is gone: only the index entry is left to drop
        with backend.disk_lock:
            backend.dict.pop(key, None)
        return
    backend.remove(key)


def _checked(backend, planner, keys, memory_objs, *, pinned: bool = False) -> list:
    """`memory_objs` up to the first damaged one; it and every later one released and None."""
    checked = list(memory_objs)
    for index, (key, memory_obj) in enumerate(zip(keys, checked)):
        if memory_obj is None or is_intact(memory_obj, planner):
            continue
        reject(key, memory_obj, backend, pinned=pinned)
        _forget(backend, key)
        for later in checked[index + 1:]:
            if later is not None:
                release(later, pinned=pinned)
        return checked[:index] + [None] * (len(checked) - index)
    return checked


def submit_put_task_wrapper(wrapped, instance, args, kwargs):
    planner = planner_of(instance)
    if planner is not None:
        seal_buffers(planner, [call_arguments(wrapped, args, kwargs).arguments["memory_obj"]])
    return wrapped(*args, **kwargs)


def read_file_wrapper(wrapped, instance, args, kwargs):
    if planner_of(instance) is None:
        return wrapped(*args, **kwargs)
    call = call_arguments(wrapped, args, kwargs).arguments
    clear_seal(call["buffer"])
    if not os.path.exists(call["path"]):
        return None  # the buffer keeps its zeroed seal: the check after the read fails and drops the key
    return wrapped(*args, **kwargs)


def get_blocking_wrapper(wrapped, instance, args, kwargs):
    memory_obj = wrapped(*args, **kwargs)
    planner = planner_of(instance)
    if planner is None or memory_obj is None:
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
    # Upstream pins what it prefetches and returns the prefix it got: so does this.
    return leading(_checked(instance, planner, keys, memory_objs, pinned=True))


_WRAPPERS = {
    "LocalDiskBackend.submit_put_task": submit_put_task_wrapper,
    "LocalDiskBackend.read_file": read_file_wrapper,
    "LocalDiskBackend.get_blocking": get_blocking_wrapper,
    "LocalDiskBackend.batched_get_blocking": batched_get_blocking_wrapper,
    "LocalDiskBackend.batched_get_non_blocking": batched_get_non_blocking_wrapper,
}

PATCH = Patch(
    name="lmcache-disk-chunk-seal",
    target="lmcache.v1.storage_backend.local_disk_backend",
    attributes=tuple(_WRAPPERS),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    flags=("LMCACHE_ASCEND_CHUNK_SEAL",),
    enabled_by="LMCACHE_ASCEND_CHUNK_SEAL",
    guard=UpstreamGuard(
        # Upstream checks no digest of a chunk file; the source test only proves the paths are there.
        unfixed_if_source_contains=("def get_blocking(", "def submit_put_task("),
    ),
    wrappers=_WRAPPERS,
    summary="lmcache-ascend chunks written by LMCache's local disk backend carry a seal (length, xxHash3); "
    "a file that fails it is a miss and is removed",
    why="a chunk file cut short or altered under a running engine was read into the rest of a reused buffer "
    "and loaded into vLLM's paged cache as it came: wrong tokens, silently",
    mirrors="LMCache's local disk backend put and get paths (LocalDiskBackend)",
    delete_when="LMCache checks the integrity of the chunk files it reads",
    # LMCache 0.4.5 (batched_get_blocking inherited: it calls get_blocking) and 0.5.6.
    tested_fingerprints={
        "LocalDiskBackend.submit_put_task": ("0f58d300d334", "9dc137929b64"),
        "LocalDiskBackend.read_file": ("38b35ffa2b66", "4bf798dff962"),
        "LocalDiskBackend.get_blocking": ("6dbb9b19fe5d", "aab283365c84"),
        "LocalDiskBackend.batched_get_blocking": ("49d1f6d4381c", "91afacc29eee"),
        "LocalDiskBackend.batched_get_non_blocking": ("bbcb9a460f1c", "8702888c35cb"),
    },
)
