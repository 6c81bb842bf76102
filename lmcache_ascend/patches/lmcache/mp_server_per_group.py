"""LMCache 0.4.x's MP server with per-KV-cache-group block ids.

Three patches, one per target module: the protocol (what a registration and a
store/retrieve carry), the layer-group manager (layer groups split by KV-cache
group, each group's block size as its engine block size) and the cache engine
(registration answer, per-group store/retrieve through `lmcache_ascend.ops`).
A registration without the per-group hints, and its flat requests, run
upstream's code untouched. The logic lives in `lmcache_ascend.multigroup.mp_server`;
the wrappers below read and write the upstream objects.

Server (`lmcache.v1.multiprocess.*`):
* the protocol decodes ``REGISTER_KV_CACHE`` hints with the per-group keys,
  answers a registration with a string, and takes ``list[int]`` or
  ``list[list[int]]`` block ids in ``STORE`` / ``RETRIEVE``;
* ``KVLayerGroupsManager`` of a per-group registration builds its layer groups
  one KV-cache group at a time (upstream's grouping by shape and dtype inside
  each), each with the group's own tokens per block as the engine block size,
  so compress ratio and physical chunk size come out per group;
* ``MPCacheEngine.store`` / ``retrieve`` of a per-group instance slice each KV-cache
  group's ids with that group's blocks per chunk and move each layer group
  through `lmcache_ascend.ops.multi_layer_block_kv_transfer` (the project's
  kernel: the same path on an NPU).

The server module is patched where it is imported (``lmcache server``, or a
launcher importing ``lmcache.v1.multiprocess.server``); ``python -m
lmcache.v1.multiprocess.server`` runs it as ``__main__``, which no post-import
patch sees: that server stays flat and a multi-group connector refuses it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import types
from typing import Any, TypedDict

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.multigroup.attachments import GROUP_PLAN
from lmcache_ascend.multigroup.mp_server import (
    HINT_CLIENT,
    HINT_ENGINE_BLOCK_SIZE,
    HINT_GROUP_BLOCK_SIZES,
    HINT_LAYER_GROUPS,
    ServerGroupPlan,
    block_ids_format,
    check_request_format,
    chunk_block_ids,
    plan_from_hints,
    retrieve_batches,
    server_answer,
    skip_blocks,
)
from lmcache_ascend.multigroup.mp_wire import FLAT, PER_GROUP, WireFormatMismatch
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

logger = logging.getLogger(__name__)

_REQUIRES = {"lmcache": ">=0.4.5,<0.5"}
_DELETE_WHEN = "lmcache-ascend no longer supports LMCache 0.4.x"
_MIRRORS = "LMCache #2926 (per-group shapes, dtypes and block tables in the MP server) and LMCache 0.5.x's MP server"


def _server_name() -> str:
    return f"lmcache-ascend {installed_version('lmcache-ascend')} on LMCache {installed_version('lmcache')}"


# ---------------------------------------------------------------- protocol


def per_group_protocol(definitions: dict, request_type: Any, layout_hints_type: type) -> dict:
    """A copy of LMCache 0.4.x's protocol definitions speaking per-group block ids."""
    hints_type = TypedDict(  # upstream's keys plus ours, all optional
        "GroupLayoutHints",
        {**layout_hints_type.__annotations__, HINT_CLIENT: str, HINT_LAYER_GROUPS: list[int],
         HINT_GROUP_BLOCK_SIZES: list[int]},
        total=False,
    )
    block_ids = list[int | list[int]]  # flat (single-group registrations) or per group
    changed = dict(definitions)
    register = definitions[request_type.REGISTER_KV_CACHE]
    changed[request_type.REGISTER_KV_CACHE] = dataclasses.replace(
        register, payload_classes=[*register.payload_classes[:-1], hints_type], response_class=str | None
    )
    for name, position in (("STORE", 2), ("RETRIEVE", 2)):
        definition = definitions[request_type[name]]
        payload = list(definition.payload_classes)
        payload[position] = block_ids
        changed[request_type[name]] = dataclasses.replace(definition, payload_classes=payload)
    return changed


def with_protocol_annotations(method: Any, payload_classes: list, response_class: Any) -> Any:
    """`method` (a wrapped handler) annotated with its request's payload and response classes, in order."""
    import inspect

    parameters = [p.name for p in inspect.signature(method).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # after self
    if len(parameters) != len(payload_classes):
        raise TypeError(
            f"{method.__qualname__} takes {parameters}; the protocol sends {len(payload_classes)} payloads"
        )
    method.__annotations__ = {**dict(zip(parameters, payload_classes)), "return": response_class}
    return method


# ---------------------------------------------------------------- server: layer groups


def split_layer_groups(wrapped, instance, args, kwargs):
    """KVLayerGroupsManager.__init__: per KV-cache group, upstream's grouping of that group's layers."""
    from lmcache.v1.gpu_connector.utils import get_num_layers

    arguments = call_arguments(wrapped, args, kwargs).arguments
    kv_caches, kv_format = arguments["kv_caches"], arguments["gpu_kv_format"]
    hints = arguments["layout_hints"]
    plan = plan_from_hints(hints, get_num_layers(kv_caches, kv_format)) if hints else None
    if plan is None:
        return wrapped(*args, **kwargs)
    if not isinstance(kv_caches, list):
        raise ValueError(
            f"per-KV-cache-group registration needs one KV cache per layer; got {type(kv_caches).__name__} "
            f"of format {getattr(kv_format, 'name', kv_format)} (a cross-layer cache cannot be split by group)"
        )
    init = wrapped.__func__
    layer_groups, owners = [], []
    for group, block_size in enumerate(plan.block_sizes):
        layers = plan.layers_of(group)
        part = object.__new__(type(instance))
        group_hints = {key: value for key, value in hints.items() if not key.startswith("lmcache_ascend_")}
        group_hints[HINT_ENGINE_BLOCK_SIZE] = block_size
        init(part, [kv_caches[layer] for layer in layers], kv_format, arguments["num_blocks"],
             layout_hints=group_hints, lmcache_logical_chunk_size=arguments["lmcache_logical_chunk_size"])
        for info in part.kv_layer_groups:
            info.layer_indices = [layers[index] for index in info.layer_indices]
            layer_groups.append(info)
            owners.append(group)
    instance.kv_layer_groups = layer_groups
    # Read by upstream's flat path only, which a per-group instance never takes.
    instance.inference_engine_logical_block_size_ = math.gcd(*plan.block_sizes)
    GROUP_PLAN.set(instance, (plan, tuple(owners)))
    logger.info("per-KV-cache-group layer groups: %s (KV-cache group of each: %s)", layer_groups, owners)
    return None


# ---------------------------------------------------------------- server: requests


def _plan_of(engine: Any, instance_id: int) -> tuple[ServerGroupPlan, tuple[int, ...]] | None:
    context = engine.gpu_contexts.get(instance_id)
    return None if context is None else GROUP_PLAN.get(context.kv_layer_groups_manager)


def register_kv_cache(wrapped, instance, args, kwargs):
    """Registration answers a per-group client with the server's format; others as upstream (None)."""
    result = wrapped(*args, **kwargs)
    instance_id = call_arguments(wrapped, args, kwargs).arguments["instance_id"]
    return server_answer(_server_name()) if _plan_of(instance, instance_id) else result


def _refused(engine: Any, instance_id: int, error: Exception) -> tuple[bytes, bool]:
    """A failed request's answer: a recorded event (the client waits on it) and False."""
    server = sys.modules[type(engine).__module__]
    logger.error("%s", error)
    context = engine.gpu_contexts[instance_id]
    with server.torch_dev.device(context.device), server.torch_dev.stream(context.stream):
        event = server.torch_dev.Event(interprocess=True)
        event.record()
    return event.ipc_handle(), False


def _route(wrapped, instance, args, kwargs, per_group):
    arguments = call_arguments(wrapped, args, kwargs).arguments
    instance_id, block_ids = arguments["instance_id"], arguments["gpu_block_ids"]
    found = _plan_of(instance, instance_id)
    try:
        sent = block_ids_format(block_ids)
        if found is None and sent == FLAT:
            return wrapped(*args, **kwargs)
        registered = PER_GROUP if found else FLAT
        client = found[0].client if found else "a client of the flat protocol"
        check_request_format(sent, registered, {"client": client, "server": _server_name()})
        return per_group(instance, found, **arguments)
    except (ValueError, WireFormatMismatch) as error:
        return _refused(instance, instance_id, error)


def store(wrapped, instance, args, kwargs):
    return _route(wrapped, instance, args, kwargs, _store_per_group)


def retrieve(wrapped, instance, args, kwargs):
    return _route(wrapped, instance, args, kwargs, _retrieve_per_group)


def _object_keys(engine: Any, server: Any, key: Any) -> list:
    session = engine.session_manager.get_or_create(key.request_id)
    session.set_tokens(list(key.token_ids))
    hashes = [server.TokenHasher.hash_to_bytes(h) for h in session.get_hashes(key.start, key.end)]
    return server.ipc_key_to_object_keys(key, hashes)


def move_chunks(context: Any, owners: tuple[int, ...], ids_by_group: list, buffers_of, direction: int,
                 skip_tokens: int, block_sizes: tuple[int, ...]) -> None:
    """One transfer per layer group over consecutive chunks; `ids_by_group[g]`: group g's ids for them."""
    from lmcache_ascend.ops import multi_layer_block_kv_transfer

    for layer_group, group in enumerate(owners):
        multi_layer_block_kv_transfer(
            context.get_group_kv_pointers(layer_group),
            buffers_of(layer_group),
            ids_by_group[group],
            context.device,
            direction,
            context.get_shape_desc(layer_group),
            context.get_physical_chunk_size(layer_group),
            context.gpu_kv_format_,
            skip_blocks(skip_tokens, block_sizes[group]),
        )


def batch_block_ids(chunks: list[list[list[int]]]) -> list:
    """Per KV-cache group, one int64 tensor of its ids over consecutive chunks (chunk_block_ids' output)."""
    import torch

    return [torch.tensor([b for chunk in chunks for b in chunk[group]], dtype=torch.long)
            for group in range(len(chunks[0]))]


def _store_per_group(engine, found, *, key, instance_id, gpu_block_ids, event_ipc_handle):
    server = sys.modules[type(engine).__module__]
    torch_dev = server.torch_dev
    plan, owners = found
    context = engine.gpu_contexts[instance_id]
    obj_keys = _object_keys(engine, server, key)
    chunks = chunk_block_ids(gpu_block_ids, plan.blocks_per_chunk(engine.chunk_size), len(obj_keys))
    with torch_dev.device(context.device), torch_dev.stream(context.stream):
        server.check_interprocess_event_support()
        event = torch_dev.Event(interprocess=True)
        torch_dev.Event.from_ipc_handle(context.device, event_ipc_handle).wait(stream=context.stream)
        reserved: dict = {}
        try:
            layout = server.get_layout_desc(context, engine.chunk_size)
            reserved = engine.storage_manager.reserve_write(obj_keys, layout, "new")
            for index, obj_key in enumerate(obj_keys):
                if obj_key not in reserved:
                    continue
                move_chunks(context, owners, batch_block_ids(chunks[index:index + 1]), lambda lg: [context.get_tmp_chunk_gpu_buffer(lg)], 1, 0,
                             plan.block_sizes)
                server.lmcache_memcpy_async_d2h(context.get_tmp_gpu_buffer_flat(chunk_idx=0), reserved[obj_key])
        except Exception:
            logger.exception("per-group store of %d chunk(s) failed", len(obj_keys))
        finally:
            event.record()
            if reserved:
                context.cupy_stream.launch_host_func(engine.storage_manager.finish_write, list(reserved))
    return event.ipc_handle(), True


def _retrieve_per_group(engine, found, *, key, instance_id, gpu_block_ids, event_ipc_handle, skip_first_n_tokens=0):
    server = sys.modules[type(engine).__module__]
    torch_dev = server.torch_dev
    plan, owners = found
    context = engine.gpu_contexts[instance_id]
    chunk_size = engine.chunk_size
    obj_keys = _object_keys(engine, server, key)
    chunks = chunk_block_ids(gpu_block_ids, plan.blocks_per_chunk(chunk_size), len(obj_keys))
    with torch_dev.device(context.device), torch_dev.stream(context.stream):
        server.check_interprocess_event_support()
        event = torch_dev.Event(interprocess=True)
        prefetched: list = []
        succeeded = False
        try:
            with engine.storage_manager.read_prefetched_results(obj_keys) as memory_objs:
                if not memory_objs or len(memory_objs) != len(obj_keys):
                    logger.error("per-group retrieve: %d of %d chunk(s) found", len(memory_objs or ()), len(obj_keys))
                    return event.ipc_handle(), False
                prefetched = obj_keys[: len(memory_objs)]
                for first, count, skip in retrieve_batches(len(memory_objs), context.max_batch_size, chunk_size,
                                                           skip_first_n_tokens):
                    for slot, obj in enumerate(memory_objs[first:first + count]):
                        server.lmcache_memcpy_async_h2d(obj, context.get_tmp_gpu_buffer_flat(chunk_idx=slot))
                    move_chunks(context, owners, batch_block_ids(chunks[first:first + count]),
                                 lambda lg, n=count: context.get_tmp_chunk_gpu_buffer_batched(n, lg), 0, skip,
                                 plan.block_sizes)
            succeeded = True
        except Exception:
            logger.exception("per-group retrieve of %d chunk(s) failed", len(obj_keys))
            return event.ipc_handle(), False
        finally:
            event.record()
            if succeeded:
                context.cupy_stream.launch_host_func(engine.storage_manager.finish_read_prefetched, prefetched)
    return event.ipc_handle(), True


# ---------------------------------------------------------------- the patches


def _build_protocol(ctx: PatchContext) -> dict[str, object]:
    from lmcache.v1.gpu_connector.utils import LayoutHints
    from lmcache.v1.multiprocess.protocols.base import RequestType

    return {"_PROTOCOL_DEFINITIONS": per_group_protocol(ctx.original("_PROTOCOL_DEFINITIONS"), RequestType, LayoutHints)}


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
    wrappers={"KVLayerGroupsManager.__init__": split_layer_groups},
    requires=_REQUIRES,
    guard=UpstreamGuard(unfixed_if_source_contains=("LayerGroupIdentity = tuple[int, int, int, int, torch.dtype]",)),
    tested_fingerprints={"KVLayerGroupsManager.__init__": ("3cef4ce77962",)},  # LMCache 0.4.5
    summary="LMCache 0.4.x's layer groups split by KV-cache group too, each with its group's block size as engine block size",
    why="layers are grouped by shape and dtype alone with one engine block size: equal-shaped layers of different KV-cache groups merge",
    mirrors=_MIRRORS,
    delete_when=_DELETE_WHEN,
)


_ENGINE_WRAPPERS = {
    "MPCacheEngine.register_kv_cache": (register_kv_cache, "REGISTER_KV_CACHE"),
    "MPCacheEngine.store": (store, "STORE"),
    "MPCacheEngine.retrieve": (retrieve, "RETRIEVE"),
}


def _build_engine(ctx: PatchContext) -> dict[str, object]:
    """The wrappers, annotated with the live protocol's classes: LMCache's message queue checks
    each handler's annotations against them when the server adds its handlers."""
    from lmcache.v1.multiprocess.protocol import RequestType, get_payload_classes, get_response_class

    values = {}
    for path, (wrapper, request) in _ENGINE_WRAPPERS.items():
        request_type = RequestType[request]
        values[path] = with_protocol_annotations(
            ctx.wrapped(path, wrapper), get_payload_classes(request_type), get_response_class(request_type)
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
