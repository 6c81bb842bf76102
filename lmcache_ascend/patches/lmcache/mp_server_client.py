"""LMCache 0.4.x's MP worker adapter negotiates per-KV-cache-group block ids with its server.

A multi-group adapter (hints attached by ``vllm-lmcache-mp-register-group-hints``)
registers with the per-group LayoutHints entries and reads the server's format
from its answer; each store/retrieve then sends per-group ids to a per-group
server and refuses them, naming both sides, to a flat one. Single-group adapters
and flat ids pass through untouched. Glue: `lmcache_ascend.connector.mp_server_side`.
"""

from __future__ import annotations

from lmcache_ascend.connector import mp_server_side as glue  # standard library and lmcache_ascend only
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

_ADAPTER = "LMCacheMPWorkerAdapter"


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
        "send_lmcache_request": glue.send_request,
        f"{_ADAPTER}._send_register_kv_caches_request": glue.send_register_request,
        f"{_ADAPTER}.submit_store_request": glue.submit_store,
        f"{_ADAPTER}.submit_retrieve_request": glue.submit_retrieve,
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
