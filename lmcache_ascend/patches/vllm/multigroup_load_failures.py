"""A failed KV load of a model with several KV-cache groups is recomputed, not fatal.

``Scheduler._handle_invalid_blocks`` runs as shipped for one KV-cache group. With
several, the wrapper reads the reported ids as ids of any group
(`lmcache_ascend.multigroup.load_failures`) and, for each request holding one:

- drops every block of the request from vLLM's prefix cache (which of them hold bad KV
  the ids cannot say), so no other request, nor its retry, hits bad KV;
- with ``kv_load_failure_policy`` ``recompute``: preempts the request (its blocks
  freed, its computed tokens 0, back at the head of the waiting queue, this step's
  output dropped where vLLM can drop it). Rolling back only its computed-token count,
  as vLLM does for one group, is not enough: a sliding-window group has already
  swapped the blocks before its window for the null block, so tokens recomputed there
  would be written nowhere. The retry asks vLLM's prefix cache and the connector again
  and computes what neither supplies;
- with ``fail``: leaves it to vLLM to end the request in error, as for one group.

Requests waiting for an asynchronous load are handed to vLLM's own path for failed
receives (``failed_recving_kv_req_ids``, their computed tokens 0), which frees their
blocks when the load ends. The affected ids are returned, so that vLLM skips this
step's output of those requests. One warning a request names it and what becomes of it.
"""

from __future__ import annotations

import logging
import time

from lmcache_ascend.compat.signatures import accepts_keyword, call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

logger = logging.getLogger(__name__)


def _null_block_id(scheduler) -> int:
    block_pool = getattr(scheduler.kv_cache_manager, "block_pool", None)
    null_block = getattr(block_pool, "null_block", None)
    return getattr(null_block, "block_id", 0)


def _preempt(scheduler, request, timestamp: float) -> None:
    scheduler.running.remove(request)
    if accepts_keyword(scheduler._preempt_request, "drop_stale_output"):
        scheduler._preempt_request(request, timestamp, drop_stale_output=True)
    else:
        scheduler._preempt_request(request, timestamp)
    # As vLLM's reset_prefix_cache does for the requests it preempts: the model runner must
    # take the retry as a request new to its batch.
    getattr(scheduler, "prev_step_scheduled_req_ids", set()).discard(request.request_id)


def handle_invalid_blocks_wrapper(wrapped, instance, args, kwargs):
    if len(instance.kv_cache_config.kv_cache_groups) <= 1:
        return wrapped(*args, **kwargs)
    from vllm.v1.request import RequestStatus

    from lmcache_ascend.multigroup.load_failures import blocks_of, failed_requests

    invalid = call_arguments(wrapped, args, kwargs).arguments["invalid_block_ids"]
    null_block_id = _null_block_id(instance)
    block_ids = {request.request_id: instance.kv_cache_manager.get_block_ids(request.request_id)
                 for request in instance.requests.values()
                 if request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)}
    failed = failed_requests(invalid, block_ids, null_block_id)
    if not failed:
        return set()
    recompute = instance.recompute_kv_load_failures
    # Before any block is freed: a freed block keeps its hash, and a later request would hit it.
    instance.kv_cache_manager.evict_blocks(set().union(*(blocks_of(block_ids[r], null_block_id) for r in failed)))
    timestamp = time.monotonic()
    for request_id in failed:
        request = instance.requests[request_id]
        logger.warning("lmcache-ascend: KV load of request %s failed (%d KV-cache groups); %s", request_id,
                       len(instance.kv_cache_config.kv_cache_groups),
                       "it is computed again" if recompute else "it ends in error (kv_load_failure_policy=fail)")
        if not recompute:
            continue
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.num_computed_tokens = 0
            instance.failed_recving_kv_req_ids.add(request_id)
        else:
            _preempt(instance, request, timestamp)
    return set(failed)


PATCH = Patch(
    name="vllm-multigroup-load-failures",
    target="vllm.v1.core.sched.scheduler",
    attributes=("Scheduler._handle_invalid_blocks",),
    kind=PatchKind.WRAP,
    requires={"vllm": ">=0.18.0"},
    guard=UpstreamGuard(
        # Upstream either refuses several groups outright or maps the ids through one group's table.
        unfixed_if_source_contains=("def _handle_invalid_blocks(",),
    ),
    wrappers={"Scheduler._handle_invalid_blocks": handle_invalid_blocks_wrapper},
    summary="a failed KV load of a model with several KV-cache groups preempts and recomputes the requests it touched",
    why="vLLM raises (or fails to unpack one group's table) when a connector reports a failed load for a hybrid "
    "model, and the engine dies: any chunk a shared cache evicts between lookup and load kills the server",
    mirrors="vllm.v1.core.sched.scheduler.Scheduler._handle_invalid_blocks (one group) and reset_prefix_cache's "
    "preemption of running requests",
    delete_when="vLLM recovers from block-level load failures of models with several KV-cache groups",
    # vLLM 0.18.1, 0.23.0, 0.32.0 (CPU build) and 0.33.0.
    tested_fingerprints={"Scheduler._handle_invalid_blocks": ("ea0c38554e2c", "fe69df58c44e", "1fb3da59150c")},
)
