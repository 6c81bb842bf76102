"""A CPU KV pool made shared memory where it lies, so that every view of it stays valid.

Sharing a CPU KV cache with another process (LMCache's MP server) by copying it into a
new shared segment and re-pointing the tensors handed over leaves every other view of
the same pages on the old memory: the model keeps writing where the server never reads.
vLLM's CPU worker holds such views for a model with several KV-cache groups, and the
connector registers reshaped views of its own.  Here the pages under a storage are
instead replaced in place (``mmap`` with ``MAP_FIXED``) by a POSIX shared-memory segment
holding the same bytes, so the storage, every view of it and the other process all
address one memory.

The whole pages around the storage are shared (a page is the unit of a mapping); the
pool of a KV cache is large enough that the allocator maps it on pages of its own.
Segments are opened and removed with CPython's own ``shm_open`` / ``shm_unlink``
(``_posixshmem``, which ``multiprocessing.shared_memory`` and LMCache's ``posix_shm``
call too), and removed when the storage dies or the process exits.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass

import torch

_COPY_BYTES = 64 << 20  # the copy into the segment goes in pieces of this size, without a second buffer
_PROT_READ, _PROT_WRITE, _MAP_SHARED, _MAP_FIXED = 0x1, 0x2, 0x01, 0x10


@dataclass(frozen=True)
class SharedPages:
    """The segment under one storage: its name (as ``shm_open`` takes it), its length, and where the
    storage's first byte lies in it."""

    name: str
    nbytes: int
    storage_offset_bytes: int


_shared: dict[int, tuple[weakref.ReferenceType, SharedPages]] = {}  # id(storage) -> (the storage, its segment)
_lock = threading.Lock()
_counter = itertools.count()


def share_in_place(tensor: torch.Tensor, prefix: str) -> SharedPages:
    """Back the pages under ``tensor``'s storage by a shared-memory segment named ``prefix<pid>_<n>``
    (once per storage; its views get the same segment), unlinked when the storage dies.  For a cache
    being registered, before the engine writes it: a write between the copy and the remap is lost."""
    if tensor.device.type != "cpu":
        raise ValueError(f"share_in_place: tensor on {tensor.device}; only CPU memory can be shared in place")
    storage = tensor.untyped_storage()
    with _lock:
        known = _shared.get(id(storage))
        if known is not None and known[0]() is storage:
            return known[1]
        start_address = storage.data_ptr()
        page = mmap.PAGESIZE
        first = start_address - start_address % page
        end = -(-(start_address + storage.nbytes()) // page) * page
        pages = SharedPages(f"{prefix}{os.getpid()}_{next(_counter)}", end - first, start_address - first)
        _map_over(first, pages)
        _shared[id(storage)] = (weakref.ref(storage), pages)
        weakref.finalize(storage, _forget, id(storage), pages.name)
        return pages


def _map_over(address: int, pages: SharedPages) -> None:
    import _posixshmem

    fd = _posixshmem.shm_open(pages.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
    try:
        os.ftruncate(fd, pages.nbytes)
        for offset in range(0, pages.nbytes, _COPY_BYTES):
            piece = min(_COPY_BYTES, pages.nbytes - offset)
            os.pwrite(fd, memoryview((ctypes.c_char * piece).from_address(address + offset)).cast("B"), offset)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        mapped = libc.mmap(address, pages.nbytes, _PROT_READ | _PROT_WRITE, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if mapped != address:
            raise OSError(ctypes.get_errno(), f"mmap of {pages.name} over {address:#x} failed")
    except BaseException:
        _unlink(pages.name)
        raise
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    import _posixshmem

    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


def _forget(storage_id: int, name: str) -> None:
    with _lock:
        known = _shared.get(storage_id)
        if known is not None and known[1].name == name:
            del _shared[storage_id]
    _unlink(name)


@atexit.register
def _unlink_all() -> None:
    """A process that ends with its pools alive (an engine's does) leaves no segment behind."""
    with _lock:
        names = [pages.name for _, pages in _shared.values()]
        _shared.clear()
    for name in names:
        _unlink(name)
