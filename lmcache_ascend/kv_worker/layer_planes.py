"""The planes of one registered layer, from its tensors and their documented layout.

A layer's KV cache arrives as one tensor or as a tuple of tensors ("planes").
Whatever the format, the transfer path only needs, per plane, a byte view whose
row ``s`` is the paged row of slot ``s``.  A single tensor is read with its
attention backend's `BackendDims` (never from its number of dims); a tuple is
vllm-ascend's documented form, every plane ``[num_blocks, block_size, ...]``.
Layout errors surface at registration with the layer name and the offending
shape instead of as a wrong copy later.

Planes that are dtype views of one storage blob (vllm-ascend keeps, e.g., an int8
indexer K and its scale inside one int8 allocation) are folded into a single
byte plane: the view covering the most bytes carries the paging geometry, the
others must lie inside its rows, and the blob's bytes are moved once.

Pure logic: torch only, no vLLM / LMCache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

import torch

from lmcache_ascend.kv_worker.backend_dims import BackendDims, described_planes
from lmcache_ascend.kv_worker.errors import KVCacheShapeError
from lmcache_ascend.layouts import LAYOUTS, DescribedTraits, TupleTraits

__all__ = [
    "KVFormat",
    "LayerPlanes",
    "KVCacheShapeError",
    "PlaneGeometry",
    "detect_layer_planes",
]


# The worker's name for a registered layer's layout: every layout's (`lmcache_ascend.layouts`).
KVFormat = enum.Enum(
    "KVFormat",
    [item for layout in LAYOUTS for item in layout.worker_formats.items()],
    module=__name__,
)


@dataclass(frozen=True)
class PlaneGeometry:
    """Paging geometry of one plane: the bytes moved per slot and where they live."""

    layer_name: str
    # Index of the geometry-carrying tensor in the registered tuple (0 for a bare tensor;
    # for MERGED, 0 is K and 1 is V).
    plane_index: int
    scheduler_group: int
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    row_bytes: int  # bytes moved per slot
    row_stride_bytes: int  # distance between consecutive slots' rows
    # Registered tuple indices of other views whose bytes travel inside these rows.
    folded_plane_indices: tuple[int, ...] = ()
    # The KV head this plane holds where a head-major layout is split per head.
    head: int | None = None
    # Rows per block as the kernels address them: 1 when blocks are packed back to
    # back (the plane is one run of rows), else block_size (blocks strided apart).
    kernel_block_rows: int = 1
    # Tokens per row of its layer, from the layer's own KV-cache spec, where its group's layers
    # compress at several ratios (set at registration); None: the group's one ratio.
    compress_ratio: int | None = None

    @property
    def num_rows(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class LayerPlanes:
    layer_name: str
    format: KVFormat
    planes: tuple[PlaneGeometry, ...]
    # Per plane (same order), a uint8 view [num_rows / kernel_block_rows,
    # kernel_block_rows, row_bytes] of its paged rows: row s is slot s.
    paged_rows: tuple[torch.Tensor, ...] = field(compare=False, repr=False)

    @property
    def scheduler_groups(self) -> tuple[int, ...]:
        return tuple(plane.scheduler_group for plane in self.planes)


def _tensors_of(layer_name: str, kv_cache: object) -> list[torch.Tensor]:
    if isinstance(kv_cache, torch.Tensor):
        return [kv_cache]
    if isinstance(kv_cache, (tuple, list)):
        if not kv_cache:
            raise KVCacheShapeError(f"layer {layer_name!r}: the KV cache is an empty {type(kv_cache).__name__}")
        for index, item in enumerate(kv_cache):
            if not isinstance(item, torch.Tensor):
                raise KVCacheShapeError(
                    f"layer {layer_name!r}: plane {index} is a {type(item).__name__}, expected a torch.Tensor"
                )
        return list(kv_cache)
    raise KVCacheShapeError(
        f"layer {layer_name!r}: the KV cache is a {type(kv_cache).__name__}; "
        "expected a torch.Tensor or a tuple of tensors"
    )


@dataclass(frozen=True)
class _Geometry:
    num_blocks: int
    block_size: int
    row_bytes: int
    row_stride_bytes: int
    first_byte: int  # storage offset of row 0


def _paging_geometry(layer_name: str, index: int, tensor: torch.Tensor) -> _Geometry:
    """Geometry of a plane shaped [num_blocks, block_size, ...] whose slot rows are dense."""
    where = f"layer {layer_name!r} plane {index} (shape {tuple(tensor.shape)}, dtype {tensor.dtype})"
    if tensor.ndim < 2:
        raise KVCacheShapeError(f"{where}: expected dims [num_blocks, block_size, ...]")
    num_blocks, block_size = int(tensor.shape[0]), int(tensor.shape[1])
    if num_blocks <= 0 or block_size <= 0:
        raise KVCacheShapeError(f"{where}: num_blocks and block_size must be > 0")
    item = tensor.element_size()
    inner = tensor[0, 0]
    if not inner.is_contiguous():
        raise KVCacheShapeError(
            f"{where}: the bytes of one slot are not contiguous (strides {tensor.stride()}); "
            "head-major (HND) paged layouts are not supported"
        )
    row_bytes = inner.numel() * item
    row_stride = tensor.stride(1) * item
    block_stride = tensor.stride(0) * item
    if block_size > 1 and row_stride < row_bytes:
        raise KVCacheShapeError(f"{where}: slot rows overlap (row stride {row_stride} B < row bytes {row_bytes} B)")
    if block_size == 1:
        row_stride = block_stride
    if num_blocks > 1 and block_stride != block_size * row_stride:
        raise KVCacheShapeError(
            f"{where}: blocks are not evenly packed (block stride {block_stride} B, "
            f"expected block_size * row stride = {block_size * row_stride} B)"
        )
    return _Geometry(num_blocks, block_size, row_bytes, row_stride, tensor.storage_offset() * item)


def _rows_view(tensor: torch.Tensor, geometry: _Geometry) -> torch.Tensor:
    """uint8 [num_rows, 1, row_bytes] view over the storage of `tensor` (blocks of one row)."""
    storage_bytes = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    storage_bytes.set_(tensor.untyped_storage())
    return storage_bytes.as_strided(
        (geometry.num_blocks * geometry.block_size, 1, geometry.row_bytes),
        (geometry.row_stride_bytes, geometry.row_bytes, 1),
        geometry.first_byte,
    )


@dataclass
class _Plane:
    indices: list[int]  # registered indices folded here; indices[0] carries the geometry
    tensor: torch.Tensor
    geometry: _Geometry
    scheduler_group: int
    # Byte window of row 0 covered by all folded views: [low, high).
    low: int = 0
    high: int = 0

    def span(self) -> tuple[int, int]:
        rows = self.geometry.num_blocks * self.geometry.block_size
        return self.low, self.low + (rows - 1) * self.geometry.row_stride_bytes + (self.high - self.low)


def _fold_views(layer_name: str, tensors: list[torch.Tensor], groups: list[int]) -> list[_Plane]:
    """One plane per storage region; a dtype view sharing another view's slot rows is folded in."""
    by_storage: dict[int, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(index)
    planes: list[_Plane] = []
    for indices in by_storage.values():
        # Widest view first: it carries the paging geometry of the blob.
        order = sorted(indices, key=lambda i: (-tensors[i].numel() * tensors[i].element_size(), i))
        members: list[_Plane] = []
        for index in order:
            tensor = tensors[index]
            geometry = _paging_geometry(layer_name, index, tensor)
            host = None
            for plane in members:
                same_paging = (
                    (geometry.num_blocks, geometry.block_size, geometry.row_stride_bytes)
                    == (plane.geometry.num_blocks, plane.geometry.block_size, plane.geometry.row_stride_bytes)
                )
                low = min(plane.low, geometry.first_byte)
                high = max(plane.high, geometry.first_byte + geometry.row_bytes)
                if same_paging and high - low <= geometry.row_stride_bytes:
                    host = plane
                    break
            if host is None:
                candidate = _Plane(
                    [index], tensor, geometry, groups[index], geometry.first_byte, geometry.first_byte + geometry.row_bytes
                )
                mine = candidate.span()
                for plane in members:
                    other = plane.span()
                    if mine[0] < other[1] and other[0] < mine[1]:
                        raise KVCacheShapeError(
                            f"layer {layer_name!r}: plane {index} (shape {tuple(tensor.shape)}, dtype {tensor.dtype}) "
                            f"overlaps plane {plane.indices[0]} in one storage blob without sharing its slot rows "
                            f"(same [num_blocks, block_size] = [{plane.geometry.num_blocks}, "
                            f"{plane.geometry.block_size}] and slot stride {plane.geometry.row_stride_bytes} B)"
                        )
                members.append(candidate)
                continue
            if groups[index] != host.scheduler_group:
                raise KVCacheShapeError(
                    f"layer {layer_name!r}: planes {host.indices[0]} and {index} are views of one storage blob "
                    f"but map to scheduler groups {host.scheduler_group} and {groups[index]}"
                )
            host.indices.append(index)
            host.low = min(host.low, geometry.first_byte)
            host.high = max(host.high, geometry.first_byte + geometry.row_bytes)
        planes.extend(members)
    for plane in planes:
        geometry = plane.geometry
        plane.geometry = _Geometry(
            geometry.num_blocks, geometry.block_size, plane.high - plane.low, geometry.row_stride_bytes, plane.low
        )
    planes.sort(key=lambda plane: plane.indices[0])
    return planes


def _classify(tensors: list[torch.Tensor], planes: list[_Plane]) -> KVFormat:
    """The layout of a registered tuple: the first layout that recognises it."""
    count = len(tensors)
    geometries = {(plane.geometry.num_blocks, plane.geometry.block_size) for plane in planes}
    one_group = len({plane.scheduler_group for plane in planes}) == 1
    traits = TupleTraits(
        count=count,
        uniform=one_group and len(geometries) == 1 and len(planes) == count,
        dtypes=len({tensor.dtype for tensor in tensors}),
        same_shapes=all(tensor.shape == tensors[0].shape for tensor in tensors),
    )
    for layout in LAYOUTS:
        name = layout.recognise_tuple(traits) if layout.recognise_tuple else None
        if name is not None:
            return KVFormat[name]
    raise KVCacheShapeError(f"layer of {count} tensors: no layout recognises it")


def _described_format(backend_dims: BackendDims, planes: Sequence) -> KVFormat:
    """The layout of a single tensor read with its backend's dims: the first layout that recognises it."""
    traits = DescribedTraits(
        roles=backend_dims.dims,
        heads_split=any(plane.head is not None for plane in planes),
        kv_split=any(plane.kv is not None for plane in planes),
    )
    for layout in LAYOUTS:
        name = layout.recognise_described(traits) if layout.recognise_described else None
        if name is not None:
            return KVFormat[name]
    raise KVCacheShapeError(f"backend {backend_dims.backend!r}: no layout reads {backend_dims.describe()}")


def _described_layer(
    layer_name: str, tensor: torch.Tensor, group: int, backend_dims: BackendDims
) -> tuple[KVFormat, tuple[PlaneGeometry, ...], tuple[torch.Tensor, ...]]:
    planes = described_planes(layer_name, tensor, backend_dims)
    fmt = _described_format(backend_dims, planes)
    geometries, views = [], []
    for plane in planes:
        packed = plane.block_stride_bytes == plane.block_size * plane.row_bytes
        blocks = plane.blocks
        if packed:  # one run of rows: hand it over as blocks of one row, like every packed plane
            blocks = blocks.view(plane.num_blocks * plane.block_size, 1, plane.row_bytes)
        geometries.append(
            PlaneGeometry(
                layer_name=layer_name,
                plane_index=plane.kv or 0,
                scheduler_group=group,
                dtype=tensor.dtype,
                num_blocks=plane.num_blocks,
                block_size=plane.block_size,
                row_bytes=plane.row_bytes,
                row_stride_bytes=plane.row_bytes,
                head=plane.head,
                kernel_block_rows=1 if packed else plane.block_size,
            )
        )
        views.append(blocks)
    return fmt, tuple(geometries), tuple(views)


def detect_layer_planes(
    layer_name: str,
    kv_cache: object,
    plane_groups: Sequence[int],
    *,
    backend_dims: BackendDims | None = None,
) -> LayerPlanes:
    """The format and planes of one registered layer.

    A single tensor is read with `backend_dims`, the description of the
    attention backend that allocated it (required: a tensor's dims are never
    guessed from their number).  A tuple of tensors is vllm-ascend's documented
    multi-plane form: every plane [num_blocks, block_size, ...], slot rows dense.

    `plane_groups` names the scheduler KV-cache group of each registered tensor
    (one entry applies to all of them).
    """
    tensors = _tensors_of(layer_name, kv_cache)
    groups = list(plane_groups)
    if len(groups) == 1:
        groups = groups * len(tensors)
    if len(groups) != len(tensors) or not groups:
        raise KVCacheShapeError(
            f"layer {layer_name!r}: {len(plane_groups)} scheduler groups given for {len(tensors)} planes; "
            "give one group for all planes or one per plane"
        )
    for group in groups:
        if not isinstance(group, int) or group < 0:
            raise KVCacheShapeError(f"layer {layer_name!r}: scheduler group {group!r} must be an int >= 0")
    devices = {tensor.device for tensor in tensors}
    if len(devices) > 1:
        raise KVCacheShapeError(f"layer {layer_name!r}: planes live on different devices {sorted(map(str, devices))}")

    if isinstance(kv_cache, torch.Tensor):
        if backend_dims is None:
            raise KVCacheShapeError(
                f"layer {layer_name!r}: a KV tensor of shape {tuple(kv_cache.shape)}, dtype {kv_cache.dtype} came "
                "without its attention backend's layout description; its dims cannot be told apart"
            )
        fmt, geometries, views = _described_layer(layer_name, kv_cache, groups[0], backend_dims)
    else:
        planes = _fold_views(layer_name, tensors, groups)
        fmt = _classify(tensors, planes)
        geometries = tuple(
            PlaneGeometry(
                layer_name=layer_name,
                plane_index=plane.indices[0],
                scheduler_group=plane.scheduler_group,
                dtype=plane.tensor.dtype,
                num_blocks=plane.geometry.num_blocks,
                block_size=plane.geometry.block_size,
                row_bytes=plane.geometry.row_bytes,
                row_stride_bytes=plane.geometry.row_stride_bytes,
                folded_plane_indices=tuple(plane.indices[1:]),
            )
            for plane in planes
        )
        views = tuple(_rows_view(plane.tensor, plane.geometry) for plane in planes)
    return LayerPlanes(layer_name, fmt, geometries, views)
