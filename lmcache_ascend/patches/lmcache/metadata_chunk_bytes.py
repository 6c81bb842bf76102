"""Let LMCache allocate one flat byte buffer per chunk for multi-group KV caches.

``LMCacheMetadata.get_shapes`` / ``get_dtypes`` return the byte shape of
the lmcache-ascend chunk buffer (uint8 ``[1, 1, tokens, ceil(bytes / tokens)]``)
when the metadata carries a chunk layout (the `CHUNK_PLANNER` attachment, set
by the worker adapter patch when it swaps in the multi-group connector);
otherwise upstream answers unchanged.
"""

from __future__ import annotations

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.multigroup.attachments import CHUNK_PLANNER
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def get_shapes_wrapper(wrapped, instance, args, kwargs):
    planner = CHUNK_PLANNER.get(instance)
    if planner is None:
        return wrapped(*args, **kwargs)
    import torch

    num_tokens = call_arguments(wrapped, args, kwargs).arguments["num_tokens"]
    return [torch.Size(planner.memory_shape(planner.chunk_size if num_tokens is None else num_tokens))]


def get_dtypes_wrapper(wrapped, instance, args, kwargs):
    if CHUNK_PLANNER.get(instance) is None:
        return wrapped(*args, **kwargs)
    import torch

    return [torch.uint8]


PATCH = Patch(
    name="lmcache-metadata-chunk-bytes",
    target="lmcache.v1.metadata",
    attributes=("LMCacheMetadata.get_shapes", "LMCacheMetadata.get_dtypes"),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        # Upstream has no notion of a byte-format multi-group chunk; the source
        # test only proves the wrapped methods are there.
        unfixed_if_source_contains=("def get_shapes(",),
    ),
    wrappers={"LMCacheMetadata.get_shapes": get_shapes_wrapper, "LMCacheMetadata.get_dtypes": get_dtypes_wrapper},
    summary="memory objects of multi-group KV caches are one uint8 chunk buffer",
    why="LMCache sizes memory objects per homogeneous group; multi-plane / compressed / windowed groups have no such shape",
    mirrors="LMCache #2926 (per-group shapes and dtypes), as one byte-format object",
    delete_when="LMCache sizes in-process memory objects per KV-cache group, compressed and windowed groups included",
    tested_fingerprints={
        "LMCacheMetadata.get_shapes": ("92d5e7eefd6a", "942258ef8e53"),
        "LMCacheMetadata.get_dtypes": ("1d96f91d73a5", "d4e442d47c39"),
    },
)
