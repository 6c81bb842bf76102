"""Worker side of vLLM's builtin LMCache MP connector on hosts without CUDA (no imports of vLLM/LMCache).

vLLM's builtin MP connector orders each store and retrieve after the step's
compute with ``torch.cuda.Event(interprocess=True)`` recorded on
``torch.cuda.current_stream()``. LMCache's platform layer names the device
module of the host it runs on (``lmcache.v1.platform.torch_dev``: ``torch.cuda``,
``torch.npu``, or on a CPU-only host a stub whose events are recorded at once,
compute there being synchronous); its MP transfer contexts export exactly those
events. `DeviceModuleTorch` is the ``torch`` the connector's module sees: torch
itself, with ``cuda`` standing for that device module.

`group_registration` is what LMCache's own MP connector hands its worker
adapter when it registers vLLM's KV caches: the caches after LMCache's group
edits, the layout hints, and one ``EngineGroupInfo`` per LMCache layer group,
each naming its vLLM KV-cache group and that group's tokens per block, so that
layers of equal shape in different KV-cache groups are never merged.
"""

from __future__ import annotations

import types
from typing import Any, Mapping

__all__ = ["DeviceModuleTorch", "group_registration"]


class DeviceModuleTorch(types.ModuleType):
    """`torch` with ``cuda`` replaced by another device module of the same API."""

    def __init__(self, torch_module: types.ModuleType, device_module: Any):
        super().__init__(torch_module.__name__, torch_module.__doc__)
        self.__dict__["_torch"] = torch_module
        self.__dict__["cuda"] = device_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_torch"], name)

    def __repr__(self) -> str:
        return f"<torch with cuda={self.__dict__['cuda']!r} (lmcache-ascend)>"


def group_registration(kv_cache_config: Any, kv_caches: Mapping[str, Any], vllm_config: Any) -> dict[str, Any]:
    """Keyword arguments of ``LMCacheMPWorkerAdapter.register_kv_caches`` with per-group hints.

    The same three steps, in the same order, as LMCache's own
    ``LMCacheMPConnector.register_kv_caches`` (LMCache >= 0.5.6); vLLM's builtin
    connector has no decode context parallelism, hence one DCP rank.
    """
    from lmcache.integration.vllm.kv_cache_group_edits import apply_kv_cache_group_edits
    from lmcache.integration.vllm.kv_cache_groups import create_engine_group_infos_from_vllm
    from lmcache.integration.vllm.utils import vllm_layout_hints

    layout_hints = vllm_layout_hints(vllm_config)
    edited = apply_kv_cache_group_edits(kv_cache_config, kv_caches, layout_hints=layout_hints)
    infos = create_engine_group_infos_from_vllm(kv_cache_config, edited, layout_hints=layout_hints, dcp_size=1)
    return {"kv_caches": edited, "engine_group_infos": infos, "layout_hints": layout_hints}
