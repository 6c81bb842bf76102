"""The paged side of a transfer: one layer group's planes, each a paged tensor per layer, checked once.

Pure logic: torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.kernels.spec import (
    DEFAULT_REGION_ALIGNMENT,
    MAX_PLANES,
    ChunkRegions,
    INT32_LIMIT,
    TransferError,
    positive_int,
    chunk_regions,
)

__all__ = ["PagedGeometry", "PagedGroup", "PagedPlane"]


@dataclass(frozen=True)
class PagedGeometry:
    """One layer's tensor of one plane, in bytes (derived, validated)."""

    address: int  # data_ptr() of the tensor itself: a view's own first byte
    storage_offset_bytes: int  # the same place, counted from its storage's start
    num_blocks: int
    block_stride_bytes: int  # from one block to the next (>= block_size * row_bytes)

    def byte_view(self, tensor: torch.Tensor, block_size: int, row_bytes: int) -> torch.Tensor:
        """A uint8 (num_blocks, block_size, row_bytes) view of exactly the tensor's bytes."""
        view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        view.set_(
            tensor.untyped_storage(),
            self.storage_offset_bytes,
            (self.num_blocks, block_size, row_bytes),
            (self.block_stride_bytes, row_bytes, 1),
        )
        return view


def _trailing_dims_contiguous(tensor: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _geometry(what: str, tensor: torch.Tensor, block_size: int, row_bytes: int) -> PagedGeometry:
    if not isinstance(tensor, torch.Tensor):
        raise TransferError(f"{what} is a {type(tensor).__name__}; allowed: a torch.Tensor")
    if tensor.layout is not torch.strided or tensor.is_quantized:
        raise TransferError(f"{what} has layout {tensor.layout}; allowed: a plain strided tensor")
    if tensor.dtype.is_complex:
        raise TransferError(f"{what} has dtype {tensor.dtype}; allowed: a real or integer dtype")
    element = tensor.element_size()
    if tensor.dim() < 2:
        raise TransferError(
            f"{what} has shape {tuple(tensor.shape)}; allowed: >= 2 dims, blocks first "
            "(num_blocks, block_size, ...)"
        )
    if row_bytes % element:
        raise TransferError(
            f"{what}: row_bytes={row_bytes} is not a multiple of its {tensor.dtype} element size ({element})"
        )
    block_bytes = math.prod(tensor.shape[1:]) * element
    if block_bytes != block_size * row_bytes:
        raise TransferError(
            f"{what} has shape {tuple(tensor.shape)} ({tensor.dtype}): {block_bytes} bytes per block, "
            f"but block_size={block_size} x row_bytes={row_bytes} = {block_size * row_bytes}"
        )
    if not _trailing_dims_contiguous(tensor):
        raise TransferError(
            f"{what} has strides {tensor.stride()} for shape {tuple(tensor.shape)}: "
            "each block's bytes must be contiguous (only the block dim may be strided)"
        )
    num_blocks = int(tensor.shape[0])
    if num_blocks == 0:
        raise TransferError(f"{what} has shape {tuple(tensor.shape)}: num_blocks=0; allowed: >= 1 block")
    if num_blocks * block_size >= INT32_LIMIT:
        raise TransferError(
            f"{what} has {num_blocks} blocks x block_size={block_size} rows; allowed: fewer than 2**31 rows"
        )
    block_stride_bytes = tensor.stride(0) * element if num_blocks > 1 else block_bytes
    if block_stride_bytes < block_bytes:
        raise TransferError(
            f"{what}: block stride {block_stride_bytes} bytes is smaller than a block ({block_bytes} bytes); "
            "blocks must not overlap"
        )
    return PagedGeometry(
        address=tensor.data_ptr(),
        storage_offset_bytes=tensor.storage_offset() * element,
        num_blocks=num_blocks,
        block_stride_bytes=block_stride_bytes,
    )


@dataclass(frozen=True)
class PagedPlane:
    """One plane of a layer group: per layer one paged tensor.

    Each tensor is seen as `num_blocks` (its dim 0) blocks of `block_size` rows of
    `row_bytes` bytes, rows one after another inside a block; only the block
    dim may be strided (views into a shared blob are fine: the view's own
    `data_ptr()` is used). Slot s is row `s % block_size` of block
    `s // block_size`. The dtype does not matter beyond its element size.
    """

    caches: tuple[torch.Tensor, ...]
    block_size: int
    row_bytes: int
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.caches, torch.Tensor) or not isinstance(self.caches, Sequence):
            raise TransferError(
                f"plane {self.name!r}: caches is a {type(self.caches).__name__}; "
                "allowed: a sequence of tensors, one per layer"
            )
        object.__setattr__(self, "caches", tuple(self.caches))
        positive_int(f"plane {self.name!r} block_size", self.block_size)
        positive_int(f"plane {self.name!r} row_bytes", self.row_bytes)
        if not self.caches:
            raise TransferError(f"plane {self.name!r} has 0 layers; allowed: >= 1 tensor")


def _device_signature(tensor: torch.Tensor) -> tuple[bool, bool, int]:
    return (tensor.is_cpu, tensor.is_cuda, tensor.get_device())


@dataclass(frozen=True)
class PagedGroup:
    """A layer group: all planes of all its layers, moved by one launch.

    Built once (at KV-cache registration); validation and per-tensor geometry
    are computed here, and backends may cache device-side tables on it.
    """

    planes: tuple[PagedPlane, ...]
    geometry: tuple[tuple[PagedGeometry, ...], ...] = field(init=False, repr=False, compare=False)
    device: torch.device = field(init=False, repr=False, compare=False)
    backend_cache: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.planes, PagedPlane) or not isinstance(self.planes, Sequence):
            raise TransferError(
                f"planes is a {type(self.planes).__name__}; allowed: a sequence of PagedPlane"
            )
        planes = tuple(self.planes)
        object.__setattr__(self, "planes", planes)
        if not 1 <= len(planes) <= MAX_PLANES:
            raise TransferError(f"plane count={len(planes)} is not allowed; allowed: 1..{MAX_PLANES}")
        for index, plane in enumerate(planes):
            if not isinstance(plane, PagedPlane):
                raise TransferError(f"planes[{index}] is a {type(plane).__name__}; allowed: PagedPlane")
        layer_counts = [len(plane.caches) for plane in planes]
        if len(set(layer_counts)) != 1:
            raise TransferError(f"planes have different layer counts {layer_counts}; all must be equal")
        device = planes[0].caches[0].device if isinstance(planes[0].caches[0], torch.Tensor) else None
        geometry = []
        for layer in range(layer_counts[0]):
            per_plane = []
            for index, plane in enumerate(planes):
                what = f"plane {index} ({plane.name or 'unnamed'}) layer {layer} cache"
                tensor = plane.caches[layer]
                per_plane.append(_geometry(what, tensor, plane.block_size, plane.row_bytes))
                if tensor.device != device:
                    raise TransferError(
                        f"{what} is on {tensor.device} but plane 0 layer 0 is on {device}; "
                        "all tensors of a transfer must be on one device"
                    )
            geometry.append(tuple(per_plane))
        object.__setattr__(self, "geometry", tuple(geometry))
        object.__setattr__(self, "device", device)
        # Reading `tensor.device` builds a Python object (over a microsecond); the
        # per-call checks compare these cheap attributes instead where they decide
        # equality on their own (CPU and CUDA tensors), see `on_group_device`.
        object.__setattr__(self, "_device_signature", _device_signature(planes[0].caches[0]))
        object.__setattr__(self, "_device_signature_exact", device is not None and device.type in ("cpu", "cuda"))

    def on_group_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on this group's device (exact; cheap for CPU and CUDA)."""
        if _device_signature(tensor) != self._device_signature:
            return False
        return self._device_signature_exact or tensor.device == self.device

    @property
    def layer_count(self) -> int:
        return len(self.planes[0].caches)

    @property
    def plane_count(self) -> int:
        return len(self.planes)

    def chunk_regions(
        self, region_rows: Sequence[int], alignment: int = DEFAULT_REGION_ALIGNMENT
    ) -> ChunkRegions:
        """This group's chunk layout for the given rows per plane (memoized: one per chunk shape)."""
        return self.cache("chunk_regions", 256).get_or_build((tuple(region_rows), alignment), lambda: chunk_regions(
            [plane.row_bytes for plane in self.planes], region_rows, self.layer_count, alignment))

    def cache(self, name: str, bound: int) -> BoundedCache:
        """The group's bounded cache `name` (made on first use): what callers derive from this group's
        fixed geometry, kept with it (`docs/hot-path.md`)."""
        found = self.backend_cache.get(name)
        if found is None:
            found = self.backend_cache[name] = BoundedCache(bound)
        return found
