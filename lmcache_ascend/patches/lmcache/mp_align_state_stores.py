"""LMCache's MP connector waits, in align mode, for the step's store requests before vLLM goes on.

After upstream's ``wait_for_save`` (which submits the step's stores), the wrapper reads the
step's STORE request ids from the connector metadata and, where the engine runs Mamba groups in
``mamba_cache_mode="align"`` (`lmcache_ascend.connector.mp_state_stores.holds_align_state`),
waits on the worker adapter's store future of each in short slices, until the server answered or
the adapter reports the server unhealthy (`lmcache_ascend.connector.mp_state_stores.wait_for_stores`).
Every other engine returns at once, as upstream does.
"""

from __future__ import annotations

import inspect
import types

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

CONNECTOR = "LMCacheMPConnector"
# vLLM's hand-off of align-mode boundary states to a connector (SchedulerOutput.kv_connector_block_state).
_HAND_OFF = "boundary_state"


def wait_for_save(wrapped, instance, args, kwargs):
    """Upstream's body, then, in align mode, wait until the server copied this step's stores."""
    result = wrapped(*args, **kwargs)
    from lmcache_ascend.connector.mp_state_stores import holds_align_state, store_request_ids, wait_for_stores

    request_ids = store_request_ids(instance._get_connector_metadata())
    if request_ids and holds_align_state(instance._vllm_config, getattr(instance, "_kv_cache_config", None)):
        wait_for_stores(instance.worker_adapter, request_ids)
    return result


def _holds_state_blocks(module: types.ModuleType) -> bool | None:
    """Upstream has it when its wait_for_save or its adapter's store submission deals with align-mode
    state blocks (waits for, or pins, them), or the module takes vLLM's boundary-state hand-offs."""
    connector = getattr(module, CONNECTOR, None)
    if connector is None:
        return None
    adapter = getattr(module, "LMCacheMPWorkerAdapter", None)
    functions = [connector.wait_for_save] + [getattr(adapter, name) for name in
                                             ("submit_store_request", "batched_submit_store_requests")
                                             if hasattr(adapter, name)]
    try:
        sources = [inspect.getsource(function).lower() for function in functions]
    except (OSError, TypeError):
        return None
    if any(marker in source for source in sources for marker in ("mamba", _HAND_OFF)):
        return True
    try:
        return _HAND_OFF in inspect.getsource(module)
    except (OSError, TypeError):
        return None


PATCH = Patch(
    name="lmcache-mp-align-state-stores",
    target="lmcache.integration.vllm.lmcache_mp_connector",
    attributes=(f"{CONNECTOR}.wait_for_save",),
    kind=PatchKind.WRAP,
    wrappers={f"{CONNECTOR}.wait_for_save": wait_for_save},
    requires={"lmcache": ">=0.5.6,<0.6"},
    guard=UpstreamGuard(probe=_holds_state_blocks, fixed_if_source_contains=(_HAND_OFF,)),
    summary="LMCache's MP connector waits, in vLLM's Mamba align mode, until its server copied the step's stores "
    "(vLLM reuses a request's state blocks two steps on)",
    why="in mamba_cache_mode='align' vLLM frees a request's interior state block two steps after writing it and "
    "hands it to the request's next boundary, while the MP server copies stored blocks on its own time: a chunk "
    "before the prompt's last boundary could be stored with a later state, and a prompt whose hit ends there (a "
    "shared system prompt) resumed from it (logprobs off by up to 3.2e-4, GraniteMoeHybrid)",
    mirrors="vLLM 0.32's take_pending_boundary_state_offloads contract (single_type_kv_cache_manager: a caller "
    "that reads the blocks asynchronously must pin them first); the engine waits on LMCache's own store futures",
    delete_when="LMCache's MP connector pins or waits for align-mode state blocks until its server copied them",
    tested_fingerprints={f"{CONNECTOR}.wait_for_save": ("f6a7d7805abe",)},  # LMCache 0.5.6
)
