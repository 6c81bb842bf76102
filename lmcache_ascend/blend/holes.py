"""Names shared by the two halves of hole-mode CacheBlend (engine and blender patches)."""

from __future__ import annotations

__all__ = ["BLENDER_PATCH_NAME", "ENGINE_PATCH_NAME", "HOLE_SINK_KWARG", "HOLE_STATE_ATTRIBUTE"]

ENGINE_PATCH_NAME = "lmcache-blend-holes-engine"
BLENDER_PATCH_NAME = "lmcache-blend-holes-blender"
# Keyword the hole-aware blender passes to the engine's retrieve_layer: a callable
# that receives the `SegmentLookup` the retrieval acted on (and the buffer offset).
HOLE_SINK_KWARG = "ascend_blend_hole_sink"
# Per-request state on the blender: (SegmentLookup, first buffer token) or None.
HOLE_STATE_ATTRIBUTE = "_ascend_blend_hole_state"
