"""Let LMCache allocate one flat byte buffer per chunk for multi-group KV caches.

What: ``LMCacheMetadata.get_shapes`` / ``get_dtypes`` return the byte shape of
the lmcache-ascend chunk buffer (uint8 ``[1, 1, tokens, ceil(bytes / tokens)]``)
when the metadata carries a chunk layout (``metadata.ascend_chunk_layout``, set
by the worker adapter patch when it swaps in the multi-group connector);
otherwise upstream answers unchanged.
Why: LMCache sizes memory objects from one ``[kv, layers, tokens, hidden]``
shape per kernel group; multi-plane, compressed and sliding-window groups have
no such shape (rows per group differ, planes mix dtypes).
Mirrors: LMCache #2926 (per-group shapes and dtypes in the metadata), as a
single byte-format object covering every group.
Delete when: LMCache's in-process engine sizes memory objects per KV-cache
group itself (group-aware ``get_shapes`` with compressed / windowed groups).
"""

from __future__ import annotations

import functools

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

LAYOUT_ATTRIBUTE = "ascend_chunk_layout"


def _build(ctx: PatchContext) -> dict[str, object]:
    import torch

    original_get_shapes = ctx.original_function("LMCacheMetadata.get_shapes")
    original_get_dtypes = ctx.original_function("LMCacheMetadata.get_dtypes")

    @functools.wraps(original_get_shapes)
    def get_shapes(self, num_tokens=None):
        layout = vars(self).get(LAYOUT_ATTRIBUTE)
        if layout is None:
            return original_get_shapes(self, num_tokens)
        return [torch.Size(layout.memory_shape(layout.chunk_size if num_tokens is None else num_tokens))]

    @functools.wraps(original_get_dtypes)
    def get_dtypes(self):
        if vars(self).get(LAYOUT_ATTRIBUTE) is None:
            return original_get_dtypes(self)
        return [torch.uint8]

    return {"LMCacheMetadata.get_shapes": get_shapes, "LMCacheMetadata.get_dtypes": get_dtypes}


PATCH = Patch(
    name="lmcache-metadata-chunk-bytes",
    target="lmcache.v1.metadata",
    attributes=("LMCacheMetadata.get_shapes", "LMCacheMetadata.get_dtypes"),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        # Upstream has no notion of a byte-format multi-group chunk; the source
        # test below only proves the wrapped methods are there.
        probe=lambda module: False if hasattr(module.LMCacheMetadata, "get_shapes") else None,
        unfixed_if_source_contains=("def get_shapes(",),
    ),
    build=_build,
    summary="memory objects of multi-group KV caches are one uint8 chunk buffer",
    why="LMCache sizes memory objects per homogeneous group; multi-plane / compressed / windowed groups have no such shape",
    mirrors="LMCache #2926 (per-group shapes and dtypes), as one byte-format object",
    delete_when="LMCache sizes in-process memory objects per KV-cache group, compressed and windowed groups included",
    tested_fingerprints={
        "LMCacheMetadata.get_shapes": ("92d5e7eefd6a", "942258ef8e53"),
        "LMCacheMetadata.get_dtypes": ("1d96f91d73a5", "d4e442d47c39"),
    },
)
