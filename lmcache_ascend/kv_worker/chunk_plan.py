"""The byte layout of one LMCache chunk: every layer group and plane in one flat buffer.

Order: layer groups one after another; inside a group, layer after layer; inside
a layer, plane after plane.  Each plane region holds `rows` slot rows of
`row_bytes` and is rounded up to 32 bytes, so every region starts 32-byte
aligned (vector loads on both Triton and Ascend need it).  A group's layer stride
is the sum of its plane regions, so one launch addresses layer ``l`` plane ``p``
at ``group_offset + l * layer_stride + plane_offset[p]``.

Rows per plane depend on the plane's scheduler group (and, in a group whose layers
compress at several ratios, on its layer's ratio):
- plain: one row per token of the chunk;
- compressed (compress ratio r): ``ceil(tokens / r)`` rows;
- sliding window w: only the chunk's tail, the paged blocks holding its last ``w // r``
  rows (`lmcache_ascend.multigroup.specs.chunk_row_window`), not the whole chunk.

Offsets are computed once per chunk length (full chunks share one plan), with
the kernels' own `chunk_regions`, so planner and kernels cannot disagree.

Pure logic: torch only, no vLLM / LMCache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from lmcache_ascend.kernels.spec import DEFAULT_REGION_ALIGNMENT
from lmcache_ascend.kernels.spec import ChunkRegions
from lmcache_ascend.kernels.spec import chunk_regions as kernel_chunk_regions
from lmcache_ascend.kv_worker.errors import KVCacheShapeError
from lmcache_ascend.kv_worker.chunk_seal import SEAL_BYTES
from lmcache_ascend.kv_worker.groups import LayerGroup, PlaneIdentity
from lmcache_ascend.kv_worker.layer_planes import PlaneGeometry
from lmcache_ascend.multigroup.specs import KVGroupSpec, RowKey, chunk_row_window, geometry_digest

__all__ = [
    "ChunkBufferPlan",
    "ChunkPlanner",
    "GroupRegion",
]

def rows_per_chunk(group: KVGroupSpec, num_tokens: int) -> int:
    """Rows a chunk region of `num_tokens` tokens must hold, wherever the chunk starts.

    A sliding-window tail starts on a block boundary, so its length depends on
    where the chunk lies against the blocks; the pattern repeats every
    `rows_per_block` chunks: the largest of those is the capacity.
    """
    if group.sliding_window is None or group.rows_per_block == 1:
        return chunk_row_window(group, 0, num_tokens).count
    return max(
        chunk_row_window(group, index * num_tokens, (index + 1) * num_tokens).count
        for index in range(group.rows_per_block)
    )


@dataclass(frozen=True)
class GroupRegion:
    """Where one layer group lives in the chunk buffer; `layout` is relative to `byte_offset`."""

    layer_group: int
    byte_offset: int
    regions: ChunkRegions

    @property
    def byte_size(self) -> int:
        return self.regions.total_bytes

    @property
    def plane_rows(self) -> tuple[int, ...]:
        return self.regions.region_rows

    def plane_byte_offset(self, layer: int, plane: int) -> int:
        return self.byte_offset + self.regions.region_offset(layer, plane)


@dataclass(frozen=True)
class ChunkBufferPlan:
    num_tokens: int
    regions: tuple[GroupRegion, ...]
    total_bytes: int


class ChunkPlanner:
    """Plans of chunk buffers for a fixed set of layer groups (one per chunk length, cached)."""

    def __init__(
        self,
        layer_groups: Sequence[LayerGroup],
        geometry_by_group: Mapping[int, KVGroupSpec],
        chunk_size: int,
    ):
        if chunk_size <= 0:
            raise KVCacheShapeError(f"chunk_size={chunk_size} must be a positive int")
        if not layer_groups:
            raise KVCacheShapeError("no layer group to plan: every registered plane was skipped or none was registered")
        self.layer_groups = tuple(layer_groups)
        self.geometry_by_group = dict(geometry_by_group)
        for group in layer_groups:
            for identity in group.planes:
                scheduler_group, ratio = self.row_key(identity)
                if chunk_size % ratio:
                    raise KVCacheShapeError(
                        f"chunk_size={chunk_size} is not a multiple of compress_ratio="
                        f"{ratio} of scheduler group {scheduler_group}; chunks would split rows"
                    )
        # The worker's side of a step's block ids (`multigroup.slots.GroupGeometry`): the scheduler
        # ships the digest of its groups, which must be this one (the same KV-cache config gave both).
        self.geometry_digest = geometry_digest(self.geometry_by_group.values())
        self.transferred_group_indices = tuple(
            index for index, group in sorted(self.geometry_by_group.items()) if group.transferred
        )
        self.chunk_size = chunk_size
        self._plans: dict[int, ChunkBufferPlan] = {}
        self.full_plan = self.plan(chunk_size)

    def plan(self, num_tokens: int) -> ChunkBufferPlan:
        if not 0 < num_tokens <= self.chunk_size:
            raise KVCacheShapeError(f"chunk length {num_tokens} must be in 1..chunk_size={self.chunk_size}")
        cached = self._plans.get(num_tokens)
        if cached is not None:
            return cached
        offset = 0
        regions = []
        for group in self.layer_groups:
            rows = [rows_per_chunk(self.row_geometry(self.row_key(identity)), num_tokens) for identity in group.planes]
            packed = kernel_chunk_regions(
                [identity.row_bytes for identity in group.planes], rows, group.num_layers, DEFAULT_REGION_ALIGNMENT
            )
            regions.append(GroupRegion(group.index, offset, packed))
            offset += packed.total_bytes
        plan = ChunkBufferPlan(num_tokens, tuple(regions), offset)
        self._plans[num_tokens] = plan
        return plan

    def memory_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """LMCache memory-object shape for a chunk: uint8 [1, 1, tokens, bytes per token, rounded up].

        LMCache reads the token count from dim 2 (KV_2LTD), so the flat buffer is
        presented as `num_tokens` rows. The last `SEAL_BYTES` of the buffer are kept
        for its seal (`kv_worker.chunk_seal`, written where a chunk leaves the process);
        with the rounding, fewer than `num_tokens + SEAL_BYTES` bytes a chunk are not KV.
        """
        total = self.plan(num_tokens).total_bytes + SEAL_BYTES
        return (1, 1, num_tokens, max(1, math.ceil(total / num_tokens)))

    @property
    def groups(self) -> Mapping[int, KVGroupSpec]:
        """The scheduler groups' geometry by group index, as `KVGroups.groups` is indexed."""
        return self.geometry_by_group

    def scheduler_groups_in_use(self) -> tuple[int, ...]:
        return tuple(sorted({g for group in self.layer_groups for g in group.scheduler_groups}))

    def row_key(self, plane: PlaneIdentity | PlaneGeometry) -> RowKey:
        """The slot mapping that addresses `plane`: its scheduler group at its layer's compress ratio
        (the group's one ratio where its layers share it)."""
        group = self.geometry_by_group[plane.scheduler_group]
        ratio = plane.compress_ratio or group.single_ratio(f"which rows a plane of group {group.group_index} holds")
        return (plane.scheduler_group, ratio)

    def row_geometry(self, key: RowKey) -> KVGroupSpec:
        """The group's row geometry of slot mapping `key` (`KVGroupSpec.at_ratio`)."""
        return self.geometry_by_group[key[0]].at_ratio(key[1])

    def row_keys_in_use(self) -> tuple[RowKey, ...]:
        """Every slot mapping some moved plane is addressed by, in order."""
        return tuple(sorted({self.row_key(identity) for group in self.layer_groups for identity in group.planes}))
