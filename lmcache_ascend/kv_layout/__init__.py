"""KV-cache layouts on the worker: format detection, layer groups, chunk-buffer plans.

Pure logic (torch only): the device connector in ``lmcache_ascend.connector``
wires it into LMCache.
"""

from lmcache_ascend.kv_layout.backend_layout import BackendLayout, DimRole, PackedKV
from lmcache_ascend.kv_layout.chunk_plan import ChunkBufferPlan, ChunkPlanner, GroupRegion
from lmcache_ascend.kv_layout.formats import KVFormat, LayerLayout, LayoutError, PlaneLayout, detect_layer_layout
from lmcache_ascend.kv_layout.groups import LayerGroup, PlaneIdentity, build_layer_groups
from lmcache_ascend.kv_layout.registration import (
    needs_multigroup_connector,
    plan_kv_caches,
    plane_groups_from_layer_names,
    transferred_kv_caches,
)
from lmcache_ascend.kv_layout.transfer import ChunkMover

__all__ = [
    "BackendLayout",
    "DimRole",
    "PackedKV",
    "ChunkMover",
    "ChunkBufferPlan",
    "ChunkPlanner",
    "GroupRegion",
    "KVFormat",
    "LayerGroup",
    "LayerLayout",
    "LayoutError",
    "PlaneIdentity",
    "PlaneLayout",
    "build_layer_groups",
    "detect_layer_layout",
    "needs_multigroup_connector",
    "plan_kv_caches",
    "plane_groups_from_layer_names",
    "transferred_kv_caches",
]
