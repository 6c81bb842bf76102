"""LMCache 0.4.x's MP server with per-KV-cache-group block ids.

Three patches, one per target module: the protocol (what a registration and a
store/retrieve carry), the layer-group manager (layer groups split by KV-cache
group, each group's block size as its engine block size) and the cache engine
(registration answer, per-group store/retrieve through `lmcache_ascend.ops`).
A registration without the per-group hints, and its flat requests, run
upstream's code untouched. The logic lives in `lmcache_ascend.multigroup.mp_server`,
the glue in `lmcache_ascend.connector.mp_server_side`.

The server module is patched where it is imported (``lmcache server``, or a
launcher importing ``lmcache.v1.multiprocess.server``); ``python -m
lmcache.v1.multiprocess.server`` runs it as ``__main__``, which no post-import
patch sees: that server stays flat and a multi-group connector refuses it.
"""

from __future__ import annotations

import types

from lmcache_ascend.connector import mp_server_side as glue  # standard library and lmcache_ascend only
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

_REQUIRES = {"lmcache": ">=0.4.5,<0.5"}
_DELETE_WHEN = "lmcache-ascend no longer supports LMCache 0.4.x"
_MIRRORS = "LMCache #2926 (per-group shapes, dtypes and block tables in the MP server) and LMCache 0.5.x's MP server"


def _build_protocol(ctx: PatchContext) -> dict[str, object]:
    from lmcache.v1.gpu_connector.utils import LayoutHints
    from lmcache.v1.multiprocess.protocols.base import RequestType

    return {"_PROTOCOL_DEFINITIONS": glue.per_group_protocol(ctx.original("_PROTOCOL_DEFINITIONS"), RequestType, LayoutHints)}


def _store_takes_flat_ids(module: types.ModuleType) -> bool | None:
    """Upstream has it when STORE no longer declares flat ``list[int]`` block ids."""
    from lmcache.v1.multiprocess.protocols.base import RequestType

    definitions = getattr(module, "_PROTOCOL_DEFINITIONS", None)
    if not definitions or RequestType.STORE not in definitions:
        return None
    return definitions[RequestType.STORE].payload_classes[2] != list[int]


PROTOCOL = Patch(
    name="lmcache-mp-server-protocol",
    target="lmcache.v1.multiprocess.protocol",
    attributes=("_PROTOCOL_DEFINITIONS",),
    kind=PatchKind.REPLACE,
    build=_build_protocol,
    requires=_REQUIRES,
    guard=UpstreamGuard(probe=_store_takes_flat_ids),
    summary="LMCache 0.4.x's MP protocol: registration hints per KV-cache group, a registration answer, per-group block ids",
    why="STORE/RETRIEVE decode list[int] (a list[list[int]] is dropped unanswered) and LayoutHints drops unknown keys",
    mirrors=_MIRRORS,
    delete_when=_DELETE_WHEN,
)


LAYER_GROUPS = Patch(
    name="lmcache-mp-server-layer-groups",
    target="lmcache.v1.kv_layer_groups",
    attributes=("KVLayerGroupsManager.__init__",),
    kind=PatchKind.WRAP,
    wrappers={"KVLayerGroupsManager.__init__": glue.split_layer_groups},
    requires=_REQUIRES,
    guard=UpstreamGuard(unfixed_if_source_contains=("LayerGroupIdentity = tuple[int, int, int, int, torch.dtype]",)),
    tested_fingerprints={"KVLayerGroupsManager.__init__": ("3cef4ce77962",)},  # LMCache 0.4.5
    summary="LMCache 0.4.x's layer groups split by KV-cache group too, each with its group's block size as engine block size",
    why="layers are grouped by shape and dtype alone with one engine block size: equal-shaped layers of different KV-cache groups merge",
    mirrors=_MIRRORS,
    delete_when=_DELETE_WHEN,
)


_ENGINE_WRAPPERS = {
    "MPCacheEngine.register_kv_cache": (glue.register_kv_cache, "REGISTER_KV_CACHE"),
    "MPCacheEngine.store": (glue.store, "STORE"),
    "MPCacheEngine.retrieve": (glue.retrieve, "RETRIEVE"),
}


def _build_engine(ctx: PatchContext) -> dict[str, object]:
    """The wrappers, annotated with the live protocol's classes: LMCache's message queue checks
    each handler's annotations against them when the server adds its handlers."""
    from lmcache.v1.multiprocess.protocol import RequestType, get_payload_classes, get_response_class

    from lmcache_ascend.patches.model import split_attribute_path, wrapped_member

    values = {}
    for path, (wrapper, request) in _ENGINE_WRAPPERS.items():
        request_type = RequestType[request]
        value = wrapped_member(ctx.owner(path), split_attribute_path(path)[1], ctx.original(path), wrapper)
        values[path] = glue.with_protocol_annotations(
            value, get_payload_classes(request_type), get_response_class(request_type)
        )
    return values


ENGINE = Patch(
    name="lmcache-mp-server-per-group",
    target="lmcache.v1.multiprocess.server",
    attributes=tuple(_ENGINE_WRAPPERS),
    kind=PatchKind.WRAP,
    build=_build_engine,
    # The server module imports cupy at module level (LMCache 0.4.5 requires cupy-cuda13x): without
    # it (CPU, NPU) the module cannot be imported and no 0.4.x MP server runs (docs/design-decisions.md).
    requires={**_REQUIRES, "cupy-cuda13x": ">=13"},
    guard=UpstreamGuard(unfixed_if_source_contains=("gpu_block_ids: list[int],",)),
    tested_fingerprints={  # LMCache 0.4.5
        "MPCacheEngine.register_kv_cache": ("3dde47d14d04",),
        "MPCacheEngine.store": ("0835c5dfc445",),
        "MPCacheEngine.retrieve": ("7ebae561582e",),
    },
    summary="LMCache 0.4.x's MP server stores/retrieves per KV-cache group (own blocks per chunk) through lmcache_ascend.ops",
    why="one flat block-id list is sliced with one blocks_per_chunk for every layer group: hybrid models' groups cannot be moved",
    mirrors=_MIRRORS,
    delete_when=_DELETE_WHEN,
)

PATCHES = (PROTOCOL, LAYER_GROUPS, ENGINE)
