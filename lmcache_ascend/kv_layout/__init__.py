"""KV-cache layouts on the worker: format detection, layer groups, chunk-buffer plans.

Pure logic (torch only): the device connector in ``lmcache_ascend.connector``
wires it into LMCache.
"""

from lmcache_ascend.kv_layout.backend_layout import BackendLayout, DimRole, PackedKV
from lmcache_ascend.kv_layout.chunk_plan import (
    REGION_ALIGNMENT,
    ChunkBufferPlan,
    ChunkLayout,
    GroupRegion,
    RowWindow,
    row_window,
)
from lmcache_ascend.kv_layout.formats import KVFormat, LayerLayout, LayoutError, PlaneLayout, detect_layer_layout
from lmcache_ascend.kv_layout.groups import (
    LayerGroup,
    PlaneIdentity,
    SchedulerGroupGeometry,
    build_layer_groups,
)

from lmcache_ascend.kv_layout.registration import (
    geometry_from_group_specs,
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
    "REGION_ALIGNMENT",
    "ChunkBufferPlan",
    "ChunkLayout",
    "GroupRegion",
    "KVFormat",
    "LayerGroup",
    "LayerLayout",
    "LayoutError",
    "PlaneIdentity",
    "PlaneLayout",
    "RowWindow",
    "SchedulerGroupGeometry",
    "build_layer_groups",
    "detect_layer_layout",
    "geometry_from_group_specs",
    "needs_multigroup_connector",
    "plan_kv_caches",
    "plane_groups_from_layer_names",
    "transferred_kv_caches",
    "row_window",
]
