"""One move of a paged group's rows to or from LMCache's buffer, and a call's repeat.

`move` describes a call's rows as one strided chunk layout and runs it in one launch (or stages
a buffer that lives elsewhere); where that launch was direct, a later call of the same shapes may
make it again over its own buffers (`repeats`, "repeated calls" below).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.flags import flag_value
from lmcache_ascend.kernels.dispatch import prepare_relaunch, transfer_group
from lmcache_ascend.kernels.paged import PagedGroup, PagedPlane
from lmcache_ascend.kernels.resolve import PlaneSlots
from lmcache_ascend.kernels.spec import TransferError, strided_chunk_regions
from lmcache_ascend.op_surface.arguments import TableCache


def byte_strides(tensor: torch.Tensor, what: str, op: str) -> tuple[int, ...]:
    """`tensor`'s strides in bytes; its last dim must be contiguous (rows are moved as byte ranges)."""
    if tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise TransferError(f"{op}: {what} has strides {tensor.stride()}; allowed: a contiguous last dim")
    element = tensor.element_size()
    return tuple(stride * element for stride in tensor.stride())


def _byte_span(tensor: torch.Tensor, what: str, op: str) -> torch.Tensor:
    """A flat uint8 view from `tensor`'s first byte to its last (its last dim contiguous)."""
    byte_strides(tensor, what, op)
    element = tensor.element_size()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    span = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    span.set_(tensor.untyped_storage(), tensor.storage_offset() * element, (extent * element,), (1,))
    return span


# PagedGroups by the address and geometry of their tensors: built (and validated)
# once, so the Triton backend's per-group tables are reused from call to call. A
# group keeps its tensors alive: the bound keeps a re-allocated KV cache from
# pinning many old ones (an engine allocates its caches once).
_groups: BoundedCache[PagedGroup] = BoundedCache(64)


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def paged_group(planes: Sequence[tuple[Sequence[torch.Tensor], int, int]]) -> PagedGroup:
    """The group of these (caches per layer, block size, row bytes) planes."""
    key = tuple((tuple(_tensor_key(t) for t in caches), block_size, row_bytes) for caches, block_size, row_bytes in planes)
    return _groups.get_or_build(key, lambda: PagedGroup(tuple(
        PagedPlane(tuple(caches), block_size, row_bytes, name=f"plane{index}")
        for index, (caches, block_size, row_bytes) in enumerate(planes))))


def transfer_backend() -> str:
    """The user's transfer backend (LMCACHE_ASCEND_TRANSFER_BACKEND), read on every call: cheap, and
    a bad value raises FlagError naming it every time."""
    return flag_value("LMCACHE_ASCEND_TRANSFER_BACKEND")


def move(group: PagedGroup, slots: PlaneSlots | Sequence[PlaneSlots], chunk: torch.Tensor,
          plane_offsets: Sequence[int], row_pitch: Sequence[int], layer_stride: int, store: bool, op: str,
          what: str, backend: str, repeatable: bool = False):
    """Move the group's rows at `slots` <-> `chunk` (offsets, pitches, stride in bytes from chunk's first byte).

    `repeatable`: also return the move's repeat (`never` where it has none)."""
    if isinstance(slots, PlaneSlots):
        slots = (slots,) * group.plane_count
    span = _byte_span(chunk, what, op)
    regions = strided_regions(tuple(plane.row_bytes for plane in group.planes), tuple(s.count for s in slots),
                             tuple(plane_offsets), tuple(row_pitch), layer_stride, group.layer_count)
    if regions.total_bytes > span.numel():
        raise TransferError(
            f"{op}: {what} spans {span.numel()} bytes but the move needs {regions.total_bytes}; "
            f"shape {tuple(chunk.shape)} is too small"
        )
    if group.on_group_device(span):
        transfer_group(group, slots, span, store=store, regions=regions, backend=backend)
        if repeatable:
            return prepare_relaunch(group, slots, span, store=store, regions=regions, backend=backend) or never
        return None
    # LMCache's buffer lives elsewhere (pinned host memory): stage it on the caches'
    # device. A store stages the old bytes too, so rows it skips keep them.
    staged = span.to(group.device, non_blocking=not store)
    transfer_group(group, slots, staged, store=store, regions=regions, backend=backend)
    if store:
        span.copy_(staged)
    return never if repeatable else None


# ---------------------------------------------------------------- repeated calls
#
# LMCache calls an op over and over with the same caches and shapes, a chunk at a time: only
# the chunk buffer and the slot (or block id) tensor are new. The first call of a shape runs
# every check and the whole path; where that ended in one direct kernel launch, the launch is
# kept (`kernels.prepare_relaunch`) under a key of everything those checks read: the caches'
# description (as `arguments.tables` identifies it), every other argument's value and type, each
# tensor's shape, strides, dtype and device, and the backend. A later call with that key
# makes the launch again over its own buffers (nothing the checks read differs), unless their
# addresses are aligned otherwise; then, and for any other call, the whole path runs.

repeats = TableCache()


def never(*arguments: object) -> bool:
    """The repeat of a call that has none (the reference backend, a staged buffer, an object moved on
    its own, no direct launch): every call takes the whole path."""
    return False


def repeat_key(op: str, backend: str, tensors: tuple, scalars: tuple) -> tuple | None:
    """The key of a call's repeat, or None where a call cannot have one (an argument that is not
    a plain tensor where one is expected)."""
    try:
        described = tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors if type(t) is torch.Tensor)
    except RuntimeError:  # a tensor without strides (sparse, ...)
        return None
    if len(described) != len(tensors):
        return None
    return op, backend, scalars, tuple(map(type, scalars)), described


# A call's chunk layout is one of a few (chunk sizes x formats): checked once, then looked up.
strided_regions = functools.lru_cache(maxsize=256)(strided_chunk_regions)


def slot_row_bytes(tensor: torch.Tensor, block_size: int) -> int:
    """Bytes per slot of a blocks-first tensor of `block_size` rows per block."""
    return math.prod(tensor.shape[1:]) * tensor.element_size() // block_size
