"""Host arrays to the device without holding the calling thread: how the package uploads its tables,
block ids and slots (torch and numpy only)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PAGEABLE_UPLOAD_BYTES", "to_device"]

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
