"""Group registered layers into layer groups: one kernel launch per group per chunk.

Layers join one layer group when every plane agrees on layout identity (row
bytes, block size, dtype) and on the scheduler KV-cache group whose slot
mapping addresses it: two scheduler groups with identical shapes still own
different block-ID namespaces, so they never merge.

Bundled (LMCACHE_ASCEND_BUNDLE_MULTI_SPEC=1) a layer's planes travel together in
one launch; exploded (=0) each plane becomes its own pseudo-layer and planes are
grouped one by one (more launches, simplest kernels).

Planes of scheduler groups that are not transferred (compressor-state groups
when LMCACHE_ASCEND_SKIP_STATE_GROUPS asks to skip them) are left out of
the plan: never stored, never loaded.

Pure logic: torch only, no vLLM / LMCache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from lmcache_ascend.kv_worker.layer_planes import KVFormat, LayerPlanes, KVCacheShapeError, PlaneGeometry
from lmcache_ascend.multigroup.specs import KVGroupSpec

__all__ = [
    "LayerGroup",
    "PlaneIdentity",
    "build_layer_groups",
]


@dataclass(frozen=True)
class PlaneIdentity:
    """What makes two planes movable by one launch with one slot array."""

    scheduler_group: int
    row_bytes: int
    block_size: int
    dtype: torch.dtype
    kernel_block_rows: int = 1  # how the kernels address its blocks (see PlaneGeometry)
    # Its layer's compress ratio where the group's layers compress at several: planes of one group
    # at other ratios are other rows of the shared blocks, addressed by other slots.
    compress_ratio: int | None = None

    @classmethod
    def of(cls, plane: PlaneGeometry) -> "PlaneIdentity":
        return cls(plane.scheduler_group, plane.row_bytes, plane.block_size, plane.dtype, plane.kernel_block_rows,
                   plane.compress_ratio)


@dataclass(frozen=True)
class LayerGroup:
    """Layers (or exploded planes) that one kernel launch moves together."""

    index: int
    format: KVFormat
    planes: tuple[PlaneIdentity, ...]  # per-plane identity, shared by every member
    # Layer names; "name#h<j>" for head j of a head-major layer, "name#p<k>" for exploded planes.
    member_names: tuple[str, ...]
    # Per member, the uint8 [num_rows / kernel_block_rows, kernel_block_rows, row_bytes] view of each plane.
    paged_rows: tuple[tuple[torch.Tensor, ...], ...] = field(compare=False, repr=False)
    # Per member, the geometry of each plane (num_blocks may differ between members).
    plane_geometries: tuple[tuple[PlaneGeometry, ...], ...] = field(compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.member_names)

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def scheduler_groups(self) -> tuple[int, ...]:
        return tuple(plane.scheduler_group for plane in self.planes)


def _kept_planes(layer: LayerPlanes, geometry_by_group: Mapping[int, KVGroupSpec],
                 seen: dict[tuple, str]) -> list[tuple[PlaneGeometry, torch.Tensor]]:
    """The layer's planes that move and were not met before (`seen`, updated)."""
    kept = []
    for plane, rows in zip(layer.planes, layer.paged_rows):
        geometry = geometry_by_group.get(plane.scheduler_group)
        if geometry is None:
            raise KVCacheShapeError(
                f"layer {layer.layer_name!r}: plane {plane.plane_index} maps to scheduler group "
                f"{plane.scheduler_group}, which is not among the registered groups "
                f"{sorted(geometry_by_group)}"
            )
        if not geometry.transferred:
            continue
        # A plane is identified by its bytes AND its scheduler group: vLLM's KV
        # sharing registers one cache under two layer names of one group (moved
        # once), while the hybrid KV-cache manager backs a layer of each group
        # with one tensor whose groups own disjoint blocks (each group moves).
        identity = (
            rows.untyped_storage().data_ptr(),
            rows.storage_offset(),
            tuple(rows.shape),
            rows.stride(),
            plane.scheduler_group,
        )
        if identity in seen:
            continue
        seen[identity] = layer.layer_name
        kept.append((plane, rows))
    return kept


def _bundled_members(layer: LayerPlanes, kept: list) -> Iterable[tuple[tuple, tuple]]:
    """(group key, member) per member of a bundled layer: a head-major layer travels as one member
    per head (each with its K / V planes), so the plane count of a launch stays that of one head."""
    by_head: dict[int | None, list] = {}
    for plane, rows in kept:
        by_head.setdefault(plane.head, []).append((plane, rows))
    for head, members in by_head.items():
        key = (layer.format, tuple(PlaneIdentity.of(plane) for plane, _ in members))
        name = layer.layer_name if head is None else f"{layer.layer_name}#h{head}"
        yield key, (name, tuple(rows for _, rows in members), tuple(plane for plane, _ in members))


def _exploded_members(layer: LayerPlanes, kept: list) -> Iterable[tuple[tuple, tuple]]:
    """(group key, member) per plane: exploded planes group by plane identity alone, whatever layer
    format they came from."""
    for plane, rows in kept:
        key = (None, (PlaneIdentity.of(plane),))
        name = layer.layer_name
        if plane.head is not None:
            name += f"#h{plane.head}"
        if sum(other.head == plane.head for other in layer.planes) > 1:
            name += f"#p{plane.plane_index}"
        yield key, (name, (rows,), (plane,))


def build_layer_groups(
    layers: Iterable[LayerPlanes],
    geometry_by_group: Mapping[int, KVGroupSpec],
    *,
    bundle_multi_spec: bool = True,
) -> tuple[LayerGroup, ...]:
    """Layer groups in first-appearance order of their first member."""
    buckets: dict[tuple, list[tuple[str, tuple[torch.Tensor, ...], tuple[PlaneGeometry, ...]]]] = {}
    formats: dict[tuple, KVFormat] = {}
    seen: dict[tuple, str] = {}
    for layer in layers:
        kept = _kept_planes(layer, geometry_by_group, seen)
        members = _bundled_members(layer, kept) if bundle_multi_spec else _exploded_members(layer, kept)
        for key, member in members:
            buckets.setdefault(key, []).append(member)
            if bundle_multi_spec:
                formats[key] = layer.format
            else:
                formats.setdefault(key, layer.format)
    return tuple(
        LayerGroup(
            index=index,
            format=formats[key],
            planes=key[1],
            member_names=tuple(name for name, _, _ in members),
            paged_rows=tuple(rows for _, rows, _ in members),
            plane_geometries=tuple(planes for _, _, planes in members),
        )
        for index, (key, members) in enumerate(buckets.items())
    )
