"""Give vLLM on NPU (and CPU) an LMCache device connector.

``CreateGPUConnector`` returns lmcache-ascend's ``MultiGroupGPUConnector``
for vLLM when LMCache has no connector for the active device (``npu``, or no
accelerator at all, which LMCache 0.4.x reports as ``cuda``); every other
device and engine gets upstream's choice. The connector moves bytes on the
backend LMCACHE_ASCEND_TRANSFER_BACKEND names (read with LMCache's config) and
learns the KV caches later, when the worker adapter patch registers them.
"""

from __future__ import annotations

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

# Devices LMCache serves itself; elsewhere ours is the only connector.
UPSTREAM_DEVICES = frozenset({"cuda", "xpu", "musa", "hpu"})


def _upstream_serves(device_type: str | None) -> bool:
    import torch

    # LMCache 0.4.x reports "cuda" on a machine without any accelerator.
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type in UPSTREAM_DEVICES


def create_gpu_connector_wrapper(wrapped, instance, args, kwargs):
    from lmcache.utils import EngineType
    from lmcache.v1 import gpu_connector

    call = call_arguments(wrapped, args, kwargs).arguments
    if call["engine"] != EngineType.VLLM or _upstream_serves(getattr(gpu_connector, "torch_device_type", None)):
        return wrapped(*args, **kwargs)
    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector
    from lmcache_ascend.flags import flag_value

    config = call["config"]
    # The transfer backend as the user set it: the environment, else LMCache's configuration
    # (its YAML and the connector's extra config, which only this config object holds).
    backend = flag_value("LMCACHE_ASCEND_TRANSFER_BACKEND", lmcache_config=config)
    return MultiGroupGPUConnector(chunk_size=config.chunk_size, backend=backend)


PATCH = Patch(
    name="lmcache-gpu-connector-npu",
    target="lmcache.v1.gpu_connector",
    attributes=("CreateGPUConnector",),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        fixed_if_source_contains=('torch_device_type == "npu"',),
        unfixed_if_source_contains=("def CreateGPUConnector(",),
    ),
    wrappers={"CreateGPUConnector": create_gpu_connector_wrapper},
    summary="vLLM on NPU / CPU-only LMCache gets the multi-group device connector",
    why="upstream has no NPU connector and degrades to no offload",
    mirrors="LMCache-Ascend #246 NPU connector selection",
    delete_when="LMCache's connector factory serves NPU devices with multi-group KV caches",
    tested_fingerprints={"CreateGPUConnector": ("62c63b5732d9", "4865413afb47")},
)
