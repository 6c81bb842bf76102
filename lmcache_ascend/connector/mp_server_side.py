"""LMCache 0.4.x's MP server and its worker adapter with per-KV-cache-group block ids (glue).

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
  kernel: the same path on an NPU). A flat request of a flat registration runs
  upstream's code untouched.

Worker adapter (`lmcache.integration.vllm.vllm_multi_process_adapter`): a
multi-group registration carries the hints, learns the server's format from
its answer, and each store/retrieve encodes its ids for that format.

Imports LMCache lazily: only loaded from a patch's wrapper or build step, or from tests.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
import sys
from typing import Any, TypedDict

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.multigroup.attachments import Attachment
from lmcache_ascend.multigroup.mp_server import (
    HINT_CLIENT,
    HINT_GROUP_BLOCK_SIZES,
    HINT_LAYER_GROUPS,
    ServerGroupPlan,
    block_ids_layout,
    check_request_format,
    chunk_block_ids,
    plan_from_hints,
    retrieve_batches,
    server_answer,
    server_format_from_answer,
    skip_blocks,
)
from lmcache_ascend.multigroup.mp_wire import FLAT, PER_GROUP, WireFormatMismatch, encode_for_server

__all__ = [
    "GROUP_HINTS",
    "GROUP_PLAN",
    "batch_block_ids",
    "move_chunks",
    "SERVER_FORMAT",
    "per_group_protocol",
    "register_kv_cache",
    "retrieve",
    "send_request",
    "send_register_request",
    "split_layer_groups",
    "store",
    "submit_retrieve",
    "submit_store",
    "with_protocol_annotations",
]

logger = logging.getLogger(__name__)

# The engine block size key of LMCache 0.4.x's LayoutHints.
_ENGINE_BLOCK_SIZE = "inference_engine_logical_block_size"

# On KVLayerGroupsManager: (plan, KV-cache group of each layer group), or unset for a flat registration.
GROUP_PLAN: Attachment = Attachment("lmcache_ascend_group_plan", "(ServerGroupPlan, tuple of KV group per layer group)")
# On LMCacheMPWorkerAdapter: the per-group LayoutHints entries to register with (multi-group models only).
GROUP_HINTS: Attachment = Attachment("lmcache_ascend_group_hints", "dict of per-group LayoutHints entries")
# On LMCacheMPWorkerAdapter: (PER_GROUP or FLAT, the server's name) from its answer to the registration.
SERVER_FORMAT: Attachment = Attachment("lmcache_ascend_server_format", "(wire format, server name or None)")


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
        group_hints[_ENGINE_BLOCK_SIZE] = block_size
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
        sent = block_ids_layout(block_ids)
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


# ---------------------------------------------------------------- worker adapter


class _Registration:
    """The per-group hints of one registration in flight, and the server's answer to it."""

    def __init__(self, hints: dict[str, Any]) -> None:
        self.hints = hints
        self.future: Any = None


_REGISTERING: contextvars.ContextVar[_Registration | None] = contextvars.ContextVar(
    "lmcache_ascend_mp_registration", default=None
)


def send_request(wrapped, instance, args, kwargs):
    """send_lmcache_request: a per-group registration's payload carries the hints; its future is kept."""
    registration = _REGISTERING.get()
    bound = call_arguments(wrapped, args, kwargs)
    arguments = bound.arguments
    if registration is None or getattr(arguments["request_type"], "name", None) != "REGISTER_KV_CACHE":
        return wrapped(*args, **kwargs)
    payloads = list(arguments["payloads"])
    hints = {key: value for key, value in dict(payloads[-1] or {}).items() if key != _ENGINE_BLOCK_SIZE}
    # No engine block size: a server without the per-group protocol then registers every layer
    # uncompressed (it would refuse 4-token engine blocks against 64-row group blocks) and answers
    # None, after which the first multi-group request is refused here, naming both sides.
    payloads[-1] = {**hints, **registration.hints}
    arguments["payloads"] = payloads
    registration.future = wrapped(*bound.args, **bound.kwargs)
    return registration.future


def send_register_request(wrapped, instance, args, kwargs):
    """A multi-group adapter's registration carries the hints and records the server's format."""
    hints = GROUP_HINTS.get(instance)
    if hints is None:
        return wrapped(*args, **kwargs)
    registration = _Registration(hints)
    token = _REGISTERING.set(registration)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _REGISTERING.reset(token)
    answer = registration.future.result(timeout=0) if registration.future is not None else None
    wire_format, server = server_format_from_answer(answer)
    SERVER_FORMAT.set(instance, (wire_format, server))
    if wire_format == FLAT:
        logger.warning(
            "the LMCache MP server answered the registration of %d KV-cache groups with no per-group format "
            "(LMCache %s without lmcache-ascend's server patches?): multi-group requests will be refused",
            len(hints[HINT_GROUP_BLOCK_SIZES]), installed_version("lmcache"),
        )
    return result


def _encoded(instance: Any, op: Any) -> Any:
    """`op` with its block ids in the server's format (the same op for flat ids)."""
    if all(not isinstance(ids, list) for ids in op.block_ids):
        return op
    wire_format, server = SERVER_FORMAT.get(instance, (FLAT, None))
    versions = {
        "connector": f"lmcache-ascend {installed_version('lmcache-ascend')} on vLLM {installed_version('vllm')}",
        "server": server or f"LMCache {installed_version('lmcache')} MP server (no per-group answer at registration)",
    }
    return dataclasses.replace(op, block_ids=encode_for_server(op.block_ids, wire_format, versions))


def _flat(block_ids: list) -> list[int]:
    return [b for ids in block_ids for b in ids] if block_ids and isinstance(block_ids[0], list) else list(block_ids)


def submit_store(wrapped, instance, args, kwargs):
    bound = call_arguments(wrapped, args, kwargs)
    bound.arguments["op"] = _encoded(instance, bound.arguments["op"])
    return wrapped(*bound.args, **bound.kwargs)


def submit_retrieve(wrapped, instance, args, kwargs):
    """Per-group ids sent; the adapter's error bookkeeping keeps flat block ids (vLLM's block pool is shared)."""
    bound = call_arguments(wrapped, args, kwargs)
    sent = _encoded(instance, bound.arguments["op"])
    if sent is bound.arguments["op"]:
        return wrapped(*args, **kwargs)
    bound.arguments["op"] = sent
    if not instance.is_healthy:  # upstream would add the nested lists to its set of failed block ids
        instance.error_block_ids.update(_flat(sent.block_ids))
        return None
    result = wrapped(*bound.args, **bound.kwargs)
    request_id = bound.arguments["request_id"]
    if request_id in instance.retrieve_futures:
        future, _ = instance.retrieve_futures[request_id]
        instance.retrieve_futures[request_id] = (future, _flat(sent.block_ids))
    return result
