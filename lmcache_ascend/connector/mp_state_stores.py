"""Waiting for a step's LMCache MP store requests where vLLM reuses Mamba state blocks within a request.

No vLLM or LMCache import: the connector, its metadata, its vLLM configuration and its worker
adapter are read by attribute, as LMCache's MP connector reads them.

In ``mamba_cache_mode="align"`` vLLM snapshots a request's recurrent state at block boundaries
and frees an interior boundary's block two steps later, handing the same block to a later
boundary of the request. LMCache's MP connector submits a step's stores in ``wait_for_save`` and
its server copies the blocks on its own time; `wait_for_stores` makes the worker wait, in short
slices, until the server answered each of the step's store requests (the answer comes after the
copy), so that no block of a store is written again before it was copied. It stops waiting as
soon as the adapter reports its server unhealthy (LMCache's heartbeat): a server that went away
never stalls the engine, and its stores are lost anyway.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

logger = logging.getLogger(__name__)
__all__ = ["holds_align_state", "store_request_ids", "wait_for_stores"]

WAIT_SLICE_S = 0.05


def holds_align_state(vllm_config: Any, kv_cache_config: Any) -> bool:
    """Whether the engine runs Mamba groups in ``mamba_cache_mode="align"`` (vLLM reuses their blocks
    within a request). Without the resolved groups, align mode alone decides."""
    if getattr(getattr(vllm_config, "cache_config", None), "mamba_cache_mode", "none") != "align":
        return False
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        return True
    return any(_is_mamba(group.kv_cache_spec) for group in groups)


def _is_mamba(spec: Any) -> bool:
    """A Mamba spec, or a uniform bundle holding one (class names, as LMCache's connector tells them)."""
    if any(cls.__name__ == "MambaSpec" for cls in type(spec).__mro__):
        return True
    return any(_is_mamba(inner) for inner in (getattr(spec, "kv_cache_specs", None) or {}).values())


def store_request_ids(metadata: Any) -> list[str]:
    """The request ids of the step's STORE operations, in the metadata's order."""
    return [meta.request_id for meta in getattr(metadata, "requests", ()) if meta.direction == "STORE"]


def wait_for_stores(adapter: Any, request_ids: Iterable[str], slice_s: float = WAIT_SLICE_S) -> list[str]:
    """Wait until the adapter's store future of each request is done; returns the ids left unfinished
    (empty unless the adapter turned unhealthy). A request without a future (dropped while unhealthy,
    or by a non-writer rank) is not waited for."""
    futures = getattr(adapter, "store_futures", {})
    pending = [(request_id, futures.get(request_id)) for request_id in request_ids]
    pending = [(request_id, future) for request_id, future in pending if future is not None]
    for index, (request_id, future) in enumerate(pending):
        while not future.wait(slice_s):
            if not adapter.is_healthy:
                left = [left for left, other in pending[index:] if not other.query()]
                logger.warning("LMCache's MP server is unhealthy: not waiting for the stores of %s (align-mode "
                               "state blocks may be rewritten before they are copied)", left)
                return left
    return []
