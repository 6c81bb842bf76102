"""The worker side of KV-cache offloading: format detection, layer groups, chunk-buffer plans, the mover.

Pure logic (torch only): the device connector in ``lmcache_ascend.connector``
wires it into LMCache.
"""

from lmcache_ascend.kv_worker.backend_dims import BackendDims, DimRole, PackedKV
from lmcache_ascend.kv_worker.chunk_plan import ChunkBufferPlan, ChunkPlanner, GroupRegion
from lmcache_ascend.kv_worker.layer_planes import KVFormat, LayerPlanes, KVCacheShapeError, PlaneGeometry, detect_layer_planes
from lmcache_ascend.kv_worker.groups import LayerGroup, PlaneIdentity, build_layer_groups
from lmcache_ascend.kv_worker.registration import (
    needs_multigroup_connector,
    plan_kv_caches,
    plane_groups_from_layer_names,
    transferred_kv_caches,
)
from lmcache_ascend.kv_worker.transfer import ChunkMover

__all__ = [
    "BackendDims",
    "DimRole",
    "PackedKV",
    "ChunkMover",
    "ChunkBufferPlan",
    "ChunkPlanner",
    "GroupRegion",
    "KVFormat",
    "LayerGroup",
    "LayerPlanes",
    "KVCacheShapeError",
    "PlaneIdentity",
    "PlaneGeometry",
    "build_layer_groups",
    "detect_layer_planes",
    "needs_multigroup_connector",
    "plan_kv_caches",
    "plane_groups_from_layer_names",
    "transferred_kv_caches",
]
