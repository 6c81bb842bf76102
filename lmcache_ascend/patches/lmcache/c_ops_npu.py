"""Give LMCache 0.4.x's `lmcache.c_ops` users this project's KV ops on an Ascend NPU host.

LMCache 0.4.x imports `lmcache.c_ops` everywhere; without CUDA its package
``__init__`` puts the Python fallback `lmcache.non_cuda_equivalents` in that
place. On an NPU host this patch replaces the fallback's KV-movement ops
(per-token multi-layer, unilateral, single-layer and the flash pair) with
`lmcache_ascend.ops`, which run them on the project's transfer kernel
(triton-ascend on the NPU) with the same signatures and byte results. Every
other name of the fallback (pinned memory, codecs, enums, `PageBufferShapeDesc`)
stays LMCache's. CUDA and CPU-only hosts are left alone (state `skipped-host`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

# The fallback's KV ops that lmcache_ascend.ops implements with the same signature
# (0.4.x's `gpu_kv_format` is positional at every call site, as here).
OPS = (
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "single_layer_kv_transfer",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
)


def not_an_npu_host() -> str | None:
    """None on an Ascend NPU host without CUDA; otherwise why not (imports an installed torch_npu)."""
    import torch

    if torch.cuda.is_available():
        return "a CUDA host: LMCache's own CUDA ops serve it"
    if getattr(torch, "npu", None) is None and importlib.util.find_spec("torch_npu") is not None:
        try:
            importlib.import_module("torch_npu")
        except Exception as error:  # noqa: BLE001 - a broken CANN install is not an NPU host
            return f"no NPU: importing torch_npu raised {type(error).__name__}: {error}"
    npu = getattr(torch, "npu", None)
    if npu is None:
        return "no NPU: torch has no npu device module (torch_npu is not installed)"
    try:
        available = bool(npu.is_available())
    except Exception as error:  # noqa: BLE001 - cannot tell means no
        return f"no NPU: torch.npu.is_available() raised {type(error).__name__}: {error}"
    return None if available else "no NPU: torch.npu.is_available() is False"


def _build(ctx: PatchContext) -> dict[str, object]:
    import lmcache_ascend.ops as ops

    def ours(name: str):
        op = getattr(ops, name)

        @functools.wraps(op)
        def bound(*args, **kwargs):
            return op(*args, **kwargs)

        return bound

    return {name: ours(name) for name in OPS}


def _serves_our_ops(module) -> bool | None:
    """True where the module's op already is ours (an upstream that binds lmcache_ascend.ops itself)."""
    return getattr(module.multi_layer_kv_transfer, "__module__", "").startswith("lmcache_ascend") or None


PATCH = Patch(
    name="lmcache-c-ops-npu",
    target="lmcache.non_cuda_equivalents",
    attributes=OPS,
    kind=PatchKind.REPLACE,
    requires={"lmcache": ">=0.4.5,<0.5"},
    guard=UpstreamGuard(
        probe=_serves_our_ops,
        fixed_if_source_contains=("lmcache_ascend",),
        unfixed_if_source_contains=("def multi_layer_kv_transfer(",),
    ),
    host=not_an_npu_host,
    build=_build,
    summary="on an NPU host, lmcache.c_ops (LMCache 0.4.x's fallback) runs KV moves on lmcache_ascend.ops",
    why="LMCache 0.4.x has no device-ops layer: without CUDA its c_ops are Python indexing on the host",
    mirrors="LMCache 0.5.x NpuDeviceOps.ensure_native() binding lmcache_ascend.ops",
    delete_when="lmcache-ascend no longer supports LMCache 0.4.x",
    tested_fingerprints={
        "multi_layer_kv_transfer": ("65859e8e7fd3",),
        "multi_layer_kv_transfer_unilateral": ("73dc05a5fb66",),
        "single_layer_kv_transfer": ("78fe21787a71",),
        "load_and_reshape_flash": ("ccfcde071bd6",),
        "reshape_and_cache_back_flash": ("821c881a655e",),
    },
)
