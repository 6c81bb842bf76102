"""Host arrays to the device without holding the calling thread: how the package uploads its tables,
block ids and slots (torch and numpy only)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from lmcache_ascend.bounded_cache import BoundedCache

__all__ = ["PAGEABLE_UPLOAD_BYTES", "stream_table", "to_device"]

# Up to this many bytes a CUDA copy comes from pageable memory: the driver stages it and returns at
# once, without the pinned allocation that was most of a small call's host time. A larger pageable
# copy waits for the device to run what is queued before it, so it goes through pinned memory.
PAGEABLE_UPLOAD_BYTES = 64 * 1024


def to_device(values: np.ndarray, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """`values` on `device`, into `out` where given; `values` may be reused once this returns. On the
    CPU without `out` the result shares `values`' memory. A pinned staging block is kept by torch's
    caching host allocator until its copy has run."""
    host = torch.from_numpy(values)
    if device.type == "cpu":
        return host if out is None else out.copy_(host)
    cuda = device.type == "cuda"
    if cuda and values.nbytes > PAGEABLE_UPLOAD_BYTES:
        host = host.pin_memory()
    if out is None:
        return host.to(device, non_blocking=cuda)
    return out.copy_(host, non_blocking=cuda)


# Device tables for per-call values (a multi-chunk launch's chunk addresses, and block ids given as a list), by
# (device index, calling thread, CUDA stream, entries); bounded (docs/hot-path.md).
_stream_tables: BoundedCache[torch.Tensor] = BoundedCache(64)


def stream_table(device: torch.device, entries: int) -> torch.Tensor:
    """An int64 device table of `entries` for a call's values (filled with `to_device(..., out=)`), kept per
    (device, calling thread, CUDA stream, entries) rather than allocated per call. A call's copy into it
    is ordered on its stream after the previous call's kernels, which read it, so it is free again by
    then; calls on other threads or streams have tables of their own. Elsewhere (no raw stream to key
    on) each call gets a new one."""
    if device.type != "cuda":
        return torch.empty(entries, dtype=torch.int64, device=device)
    index = torch._C._cuda_getDevice() if device.index is None else device.index
    key = (index, threading.get_ident(), torch._C._cuda_getCurrentRawStream(index), entries)
    table = _stream_tables.get(key)
    if table is None:
        table = _stream_tables.put(key, torch.empty(entries, dtype=torch.int64, device=device))
    return table
