"""vLLM's builtin LMCache MP connector on LMCache 0.5.x: adapter API, device events without CUDA, per-group hints."""

from __future__ import annotations

import inspect
import types

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.compat.source import NO_SOURCE
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"
CONNECTOR = "LMCacheMPConnectorUpstream"
_CUDA_EVENT = "torch.cuda.Event(interprocess=True)"
_BARE_REGISTRATION = "self.worker_adapter.register_kv_caches(kv_caches)"


def _calls_cuda(module: types.ModuleType) -> bool | None:
    """Upstream has the fix when its module makes no ``torch.cuda`` call (None: no source)."""
    try:
        return "torch.cuda." not in inspect.getsource(module)
    except (OSError, TypeError):
        return None


def without_cuda() -> str | None:
    """None on a host where torch has no usable CUDA device (CPU-only, NPU); otherwise why not."""
    import torch

    if torch.cuda.is_available():
        return "a CUDA host: torch.cuda serves it as upstream expects"
    return None


def _build_device_events(ctx: PatchContext) -> dict[str, object]:
    from lmcache.v1.platform import torch_dev

    from lmcache_ascend.connector.mp_worker import DeviceModuleTorch

    return {"torch": DeviceModuleTorch(ctx.original("torch"), torch_dev)}


DEVICE_EVENTS = Patch(
    name="vllm-lmcache-mp-device-events",
    target=TARGET,
    attributes=("torch",),
    kind=PatchKind.REPLACE,
    build=_build_device_events,
    requires={"vllm": ">=0.18.0", "lmcache": ">=0.5"},
    host=without_cuda,
    guard=UpstreamGuard(probe=_calls_cuda, unfixed_if_source_contains=(_CUDA_EVENT,)),
    summary="vLLM's builtin MP connector records its store/retrieve events on LMCache's device module (torch_dev), not torch.cuda",
    why=f"start_load_kv / wait_for_save create {_CUDA_EVENT}, which a torch without CUDA (CPU, NPU) cannot",
    mirrors="LMCache 0.5.6's own LMCacheMPConnector (events from the worker adapter's transfer context over torch_dev)",
    delete_when="vLLM's builtin MP connector takes its events from LMCache's platform layer (no torch.cuda call left)",
)


def _register_kv_caches(wrapped, instance, args, kwargs):
    """Register the caches with per-group hints; upstream's body is the bare registration only."""
    from lmcache_ascend.connector.mp_worker import group_registration

    kv_caches = call_arguments(wrapped, args, kwargs).arguments["kv_caches"]
    config = getattr(instance, "_kv_cache_config", None)
    instance.worker_adapter.register_kv_caches(**group_registration(config, kv_caches, instance._vllm_config))


def _passes_group_infos(module: types.ModuleType) -> bool | None:
    connector = getattr(module, CONNECTOR, None)
    if connector is None:
        return None
    try:
        return "engine_group_infos" in inspect.getsource(connector.register_kv_caches)
    except (OSError, TypeError):
        return None


GROUP_HINTS = Patch(
    name="vllm-lmcache-mp-upstream-group-hints",
    target=TARGET,
    attributes=(f"{CONNECTOR}.register_kv_caches",),
    kind=PatchKind.WRAP,
    wrappers={f"{CONNECTOR}.register_kv_caches": _register_kv_caches},
    requires={"vllm": ">=0.19", "lmcache": ">=0.5.6"},
    guard=UpstreamGuard(probe=_passes_group_infos, unfixed_if_source_contains=(_BARE_REGISTRATION,)),
    summary="vLLM's builtin LMCacheMPConnectorUpstream registers KV caches with LMCache's per-group hints (group id, tokens per block)",
    why="registered bare, LMCache's server groups layers by shape alone: equal-shaped layers of different KV-cache groups merge and share one block table",
    mirrors="LMCache 0.5.6's LMCacheMPConnector.register_kv_caches (create_engine_group_infos_from_vllm); LMCache #3261",
    delete_when="vLLM's builtin MP connector passes engine_group_infos to the worker adapter",
    # vLLM 0.23.0 / 0.32-0.33.
    tested_fingerprints={f"{CONNECTOR}.register_kv_caches": ("d6c147ce7465", "b3ac18671e65")},
)

def _parallel_strategy(wrapped, instance, args, kwargs):
    from lmcache_ascend.connector.mp_adapter_api import new_parallel_strategy

    return new_parallel_strategy(wrapped, args, kwargs)


def _scheduler_adapter(wrapped, instance, args, kwargs):
    from lmcache_ascend.connector.mp_adapter_api import one_server_url

    return one_server_url(wrapped, args, kwargs)


def _build_adapter_api(ctx: PatchContext) -> dict[str, object]:
    from lmcache_ascend.connector.mp_adapter_api import worker_adapter_with_old_names

    return {"LMCacheMPWorkerAdapter": worker_adapter_with_old_names(ctx.original("LMCacheMPWorkerAdapter"))}


def _speaks_lmcache_api(module: types.ModuleType) -> bool | None:
    """Upstream has it when LMCache's adapter still takes ``server_url`` or vLLM no longer passes it."""
    from lmcache_ascend.compat.signatures import accepts_keyword

    adapter = getattr(module, "LMCacheMPSchedulerAdapter", None)
    create = getattr(module, "create_scheduler_adapter", None)
    if adapter is None or create is None:
        return None
    try:
        passes_server_url = "server_url=server_url" in inspect.getsource(create)
    except (OSError, TypeError):
        return None
    return bool(accepts_keyword(adapter.__init__, "server_url")) or not passes_server_url


ADAPTER_API = Patch(
    name="vllm-lmcache-mp-upstream-adapter-api",
    target=TARGET,
    attributes=("ParallelStrategy", "LMCacheMPSchedulerAdapter", "LMCacheMPWorkerAdapter"),
    kind=PatchKind.REPLACE,
    wrappers={"ParallelStrategy": _parallel_strategy, "LMCacheMPSchedulerAdapter": _scheduler_adapter},
    build=_build_adapter_api,
    requires={"vllm": ">=0.19", "lmcache": ">=0.5.6"},
    guard=UpstreamGuard(probe=_speaks_lmcache_api),
    summary="vLLM's builtin LMCacheMPConnectorUpstream builds LMCache 0.5.x's MP adapters (ParallelStrategy fields, server_urls, is_kv_writer)",
    why="it passes LMCache 0.4.x's seven-field ParallelStrategy positionally and server_url=, which LMCache 0.5.6's adapters misread or refuse: the fallback cannot start",
    mirrors="LMCache 0.5.6's LMCacheMPConnector (build_parallel_strategy_from_vllm_config, server_urls)",
    delete_when="vLLM's builtin MP connector builds its adapters with LMCache 0.5's arguments",
    # LMCache 0.5.6's classes; the worker adapter's source reads as none where LMCache was imported first.
    tested_fingerprints={
        "ParallelStrategy": ("a69bc19751e4",),
        "LMCacheMPSchedulerAdapter": ("f294ec4a2ed3",),
        "LMCacheMPWorkerAdapter": ("a781e5b5766f", NO_SOURCE),
    },
)

PATCHES = (ADAPTER_API, DEVICE_EVENTS, GROUP_HINTS)
