"""LMCache 0.4.x's MP worker adapter negotiates per-KV-cache-group block ids with its server.

A multi-group adapter (hints attached by ``vllm-lmcache-mp-register-group-hints``)
registers with the per-group LayoutHints entries and reads the server's format
from its answer; each store/retrieve then sends per-group ids to a per-group
server and refuses them, naming both sides, to a flat one. Single-group adapters
and flat ids pass through untouched.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from typing import Any

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.multigroup.attachments import GROUP_HINTS, SERVER_FORMAT
from lmcache_ascend.multigroup.mp_server import HINT_ENGINE_BLOCK_SIZE, HINT_GROUP_BLOCK_SIZES, server_format_from_answer
from lmcache_ascend.multigroup.mp_wire import FLAT, encode_for_server
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

logger = logging.getLogger(__name__)

_ADAPTER = "LMCacheMPWorkerAdapter"


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
    hints = {key: value for key, value in dict(payloads[-1] or {}).items() if key != HINT_ENGINE_BLOCK_SIZE}
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


PATCH = Patch(
    name="lmcache-mp-client-wire-format",
    target="lmcache.integration.vllm.vllm_multi_process_adapter",
    attributes=(
        "send_lmcache_request",
        f"{_ADAPTER}._send_register_kv_caches_request",
        f"{_ADAPTER}.submit_store_request",
        f"{_ADAPTER}.submit_retrieve_request",
    ),
    kind=PatchKind.WRAP,
    wrappers={
        "send_lmcache_request": send_request,
        f"{_ADAPTER}._send_register_kv_caches_request": send_register_request,
        f"{_ADAPTER}.submit_store_request": submit_store,
        f"{_ADAPTER}.submit_retrieve_request": submit_retrieve,
    },
    requires={"lmcache": ">=0.4.5,<0.5"},
    guard=UpstreamGuard(unfixed_if_source_contains=("    block_ids: list[int]\n",)),
    tested_fingerprints={  # LMCache 0.4.5
        "send_lmcache_request": ("0ad5bf3b3b7c",),
        f"{_ADAPTER}._send_register_kv_caches_request": ("9214f4e7989d",),
        f"{_ADAPTER}.submit_store_request": ("532b75878ead",),
        f"{_ADAPTER}.submit_retrieve_request": ("a86844c4f786",),
    },
    summary="LMCache 0.4.x's MP worker adapter learns its server's block-id format at registration and sends per-group ids to a per-group server",
    why="the adapter sends one flat list; a list[list[int]] to a flat server is dropped unanswered, so the format must be known first",
    mirrors="vLLM #42437 / LMCache #3261 (list[list[int]] block ids indexed by KV-cache group)",
    delete_when="lmcache-ascend no longer supports LMCache 0.4.x",
)
