"""Group registered layers into layer groups: one kernel launch per group per chunk.

Layers join one layer group when every plane agrees on layout identity (row
bytes, block size, dtype) and on the scheduler KV-cache group whose slot
mapping addresses it: two scheduler groups with identical shapes still own
different block-ID namespaces, so they never merge.

Bundled (LMCACHE_ASCEND_BUNDLE_MULTI_SPEC=1) a layer's planes travel together in
one launch; exploded (=0) each plane becomes its own pseudo-layer and planes are
grouped one by one (more launches, simplest kernels).

Planes of scheduler groups that are not transferred (recurrent-state groups
under the state-skip policy, LMCACHE_ASCEND_SKIP_STATE_GROUPS) are left out of
the plan: never stored, never loaded.

Pure logic: torch only, no vLLM / LMCache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from lmcache_ascend.kv_layout.formats import KVFormat, LayerLayout, LayoutError, PlaneLayout

__all__ = [
    "LayerGroup",
    "PlaneIdentity",
    "SchedulerGroupGeometry",
    "build_layer_groups",
]


@dataclass(frozen=True)
class SchedulerGroupGeometry:
    """What the worker needs to know about one scheduler KV-cache group."""

    group_id: int
    # Tokens per stored row: slot mapping of the group has ceil(T / compress_ratio) entries.
    compress_ratio: int = 1
    # Tokens of attention window; only the chunk's last `sliding_window` tokens are kept.
    sliding_window: int | None = None
    # False for groups LMCache leaves out (recurrent-state groups under the
    # state-skip policy of lmcache_ascend.multigroup.state_skip).
    transferred: bool = True

    def __post_init__(self) -> None:
        if self.group_id < 0:
            raise LayoutError(f"scheduler group id {self.group_id} must be >= 0")
        if self.compress_ratio <= 0:
            raise LayoutError(
                f"scheduler group {self.group_id}: compress_ratio={self.compress_ratio} must be a positive int"
            )
        if self.sliding_window is not None:
            if self.sliding_window < self.compress_ratio or self.sliding_window % self.compress_ratio:
                raise LayoutError(
                    f"scheduler group {self.group_id}: sliding_window={self.sliding_window} must be a positive "
                    f"multiple of compress_ratio={self.compress_ratio}"
                )


@dataclass(frozen=True)
class PlaneIdentity:
    """What makes two planes movable by one launch with one slot array."""

    scheduler_group: int
    row_bytes: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, plane: PlaneLayout) -> "PlaneIdentity":
        return cls(plane.scheduler_group, plane.row_bytes, plane.block_size, plane.dtype)


@dataclass(frozen=True)
class LayerGroup:
    """Layers (or exploded planes) that one kernel launch moves together."""

    index: int
    format: KVFormat
    planes: tuple[PlaneIdentity, ...]  # per-plane identity, shared by every member
    member_names: tuple[str, ...]  # layer names ("name#p<k>" for exploded planes)
    # Per member, the uint8 [num_rows, row_bytes] view of each plane.
    paged_rows: tuple[tuple[torch.Tensor, ...], ...] = field(compare=False, repr=False)
    # Per member, the geometry of each plane (num_blocks may differ between members).
    plane_layouts: tuple[tuple[PlaneLayout, ...], ...] = field(compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.member_names)

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def scheduler_groups(self) -> tuple[int, ...]:
        return tuple(plane.scheduler_group for plane in self.planes)


def build_layer_groups(
    layers: Iterable[LayerLayout],
    geometry_by_group: Mapping[int, SchedulerGroupGeometry],
    *,
    bundle_multi_spec: bool = True,
) -> tuple[LayerGroup, ...]:
    """Layer groups in first-appearance order of their first member."""
    buckets: dict[tuple, list[tuple[str, tuple[torch.Tensor, ...], tuple[PlaneLayout, ...]]]] = {}
    formats: dict[tuple, KVFormat] = {}
    seen_rows: dict[tuple[int, int, int, int], str] = {}
    for layer in layers:
        kept = []
        for plane, rows in zip(layer.planes, layer.paged_rows):
            geometry = geometry_by_group.get(plane.scheduler_group)
            if geometry is None:
                raise LayoutError(
                    f"layer {layer.layer_name!r}: plane {plane.plane_index} maps to scheduler group "
                    f"{plane.scheduler_group}, which is not among the registered groups "
                    f"{sorted(geometry_by_group)}"
                )
            if not geometry.transferred:
                continue
            # The same bytes registered under two layer names (vLLM KV sharing) move once.
            identity = (rows.untyped_storage().data_ptr(), rows.storage_offset(), rows.shape[0], rows.stride(0))
            if identity in seen_rows:
                continue
            seen_rows[identity] = layer.layer_name
            kept.append((plane, rows))
        if not kept:
            continue
        if bundle_multi_spec:
            key = (layer.format, tuple(PlaneIdentity.of(plane) for plane, _ in kept))
            buckets.setdefault(key, []).append(
                (layer.layer_name, tuple(rows for _, rows in kept), tuple(plane for plane, _ in kept))
            )
            formats[key] = layer.format
        else:
            for plane, rows in kept:
                # Exploded planes group by plane identity alone, whatever layer format they came from.
                key = (None, (PlaneIdentity.of(plane),))
                name = layer.layer_name if len(layer.planes) == 1 else f"{layer.layer_name}#p{plane.plane_index}"
                buckets.setdefault(key, []).append((name, (rows,), (plane,)))
                formats.setdefault(key, layer.format)
    groups = []
    for index, (key, members) in enumerate(buckets.items()):
        groups.append(
            LayerGroup(
                index=index,
                format=formats[key],
                planes=key[1],
                member_names=tuple(name for name, _, _ in members),
                paged_rows=tuple(rows for _, rows, _ in members),
                plane_layouts=tuple(planes for _, _, planes in members),
            )
        )
    return tuple(groups)
