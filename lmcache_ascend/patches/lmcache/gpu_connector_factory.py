"""Give vLLM on NPU (and CPU) an LMCache device connector.

What: ``CreateGPUConnector`` returns lmcache-ascend's ``MultiGroupGPUConnector``
for vLLM when LMCache has no connector for the active device (``npu``, or no
accelerator at all, which LMCache 0.4.x reports as ``cuda``); every other
device and engine gets upstream's choice. The
connector learns the KV caches later, when the worker adapter patch registers
them.
Why: upstream raises "No supported npu connector found", and the LMCache
manager then runs degraded (no offload at all).
Mirrors: LMCache-Ascend's NPU connector selection (#246 routes vllm-ascend
through its own NPU connector).
Delete when: LMCache's factory returns a connector for NPU devices that moves
multi-group, multi-plane KV caches.
"""

from __future__ import annotations

import functools

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

# Devices LMCache serves itself; elsewhere ours is the only connector.
UPSTREAM_DEVICES = frozenset({"cuda", "xpu", "musa", "hpu"})


def _build(ctx: PatchContext) -> dict[str, object]:
    original = ctx.original_function("CreateGPUConnector")

    import torch

    def upstream_serves(device_type: str | None) -> bool:
        # LMCache 0.4.x reports "cuda" on a machine without any accelerator.
        if device_type == "cuda":
            return torch.cuda.is_available()
        return device_type in UPSTREAM_DEVICES

    @functools.wraps(original)
    def CreateGPUConnector(config, metadata, engine, *args, **kwargs):
        from lmcache.utils import EngineType

        if engine != EngineType.VLLM or upstream_serves(getattr(ctx.module, "torch_device_type", None)):
            return original(config, metadata, engine, *args, **kwargs)
        from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector

        return MultiGroupGPUConnector(chunk_size=config.chunk_size)

    return {"CreateGPUConnector": CreateGPUConnector}


PATCH = Patch(
    name="lmcache-gpu-connector-npu",
    target="lmcache.v1.gpu_connector",
    attributes=("CreateGPUConnector",),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        probe=lambda module: None,
        fixed_if_source_contains=('torch_device_type == "npu"',),
        unfixed_if_source_contains=("def CreateGPUConnector(",),
    ),
    build=_build,
    summary="vLLM on NPU / CPU-only LMCache gets the multi-group device connector",
    why="upstream has no NPU connector and degrades to no offload",
    mirrors="LMCache-Ascend #246 NPU connector selection",
    delete_when="LMCache's connector factory serves NPU devices with multi-group KV caches",
    tested_fingerprints={"CreateGPUConnector": ("62c63b5732d9", "4865413afb47")},
)
