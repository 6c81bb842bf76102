"""Seal lmcache-ascend chunk buffers as a storage backend writes them, check them as it reads them back.

Used by the ``lmcache-remote-chunk-seal`` and ``lmcache-disk-chunk-seal`` patches, the two
places where a chunk leaves this process's memory (a remote store, a file) and can come
back short, altered or not at all. A buffer is sealed only when it is exactly a chunk of
the plan its backend's engine registered (`CHUNK_PLANNER` on LMCache's metadata); any other
memory object, and every backend of an engine that moves no lmcache-ascend chunks, is
left as upstream has it. (`kv_worker.chunk_seal` is imported where a seal is made or
checked: the patch modules that use this one are imported with their targets, and the
listing CLI imports them where xxhash may not be installed.)
"""

from __future__ import annotations

import logging
import threading
from math import prod

from lmcache_ascend.multigroup.attachments import CHUNK_PLANNER

__all__ = ["clear_seal", "damaged_chunks", "is_intact", "leading", "planner_of", "reject", "release", "seal_buffers"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# Chunks found damaged in this process, over every backend (read by the engine fault tests).
damaged_chunks = 0


def planner_of(backend):
    """The chunk planner of the engine `backend` stores for, or None where it moves no lmcache-ascend chunks."""
    local = getattr(backend, "local_cpu_backend", None)
    metadata = getattr(backend, "metadata", None) or getattr(local, "metadata", None)
    return CHUNK_PLANNER.get(metadata) if metadata is not None else None


def _byte_view(memory_obj, planner) -> memoryview | None:
    """The memory object's bytes when they are exactly a planned chunk buffer, else None."""
    try:
        shape = tuple(memory_obj.get_shape())
        view = memoryview(memory_obj.byte_array).cast("B")
    except (AttributeError, TypeError, ValueError):
        return None
    if len(shape) != 4 or not 0 < shape[2] <= planner.chunk_size:
        return None
    expected = planner.memory_shape(shape[2])
    return view if shape == expected and view.nbytes == prod(expected) else None


def seal_buffers(planner, memory_objs) -> None:
    """Seal every memory object of `memory_objs` that is a planned chunk buffer (in its reserved tail)."""
    from lmcache_ascend.kv_worker.chunk_seal import seal

    for memory_obj in memory_objs:
        view = _byte_view(memory_obj, planner)
        if view is not None:
            seal(view)


def is_intact(memory_obj, planner) -> bool:
    """Whether `memory_obj` is a planned chunk buffer ending in the seal of exactly its bytes."""
    from lmcache_ascend.kv_worker.chunk_seal import is_sealed

    view = _byte_view(memory_obj, planner)
    return view is not None and is_sealed(view)


def clear_seal(buffer) -> None:
    """Zero the seal of a byte buffer about to be filled (one too small to hold a seal is left alone)."""
    from lmcache_ascend.kv_worker import chunk_seal

    if memoryview(buffer).nbytes > chunk_seal.SEAL_BYTES:
        chunk_seal.clear_seal(buffer)


def leading(memory_objs: list) -> list:
    """The objects before the first None: what a prefetch hands on (upstream returns the prefix it got)."""
    return memory_objs[: next((i for i, obj in enumerate(memory_objs) if obj is None), len(memory_objs))]


def release(memory_obj, *, pinned: bool = False) -> None:
    """Give a memory object the caller will never see back to its allocator (unpinned first if `pinned`)."""
    try:
        if pinned:
            memory_obj.unpin()
        memory_obj.ref_count_down()
    except Exception:  # a connector's object without reference counts: nothing to release
        pass


def reject(key, memory_obj, where, *, pinned: bool = False) -> None:
    """A damaged chunk read from `where`: released, counted, and logged with its key."""
    global damaged_chunks
    release(memory_obj, pinned=pinned)
    with _lock:
        damaged_chunks += 1
    logger.warning("lmcache-ascend: chunk %s from %s failed its seal check (short, altered or not ours); "
                   "it is a miss and its tokens are computed again", key, where)
