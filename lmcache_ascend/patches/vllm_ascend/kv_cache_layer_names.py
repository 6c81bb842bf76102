"""Before vllm-ascend's ``_allocate_kv_cache`` asserts that every layer got a tensor,
a mismatch raises `lmcache_ascend.prefix_cache.layer_names`' error, which lists the
missing and extra layer names."""

from __future__ import annotations

import inspect

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def _reports_names(module) -> bool:
    return "Some layers are not correctly initialized" not in inspect.getsource(module._allocate_kv_cache)


def allocate_kv_cache_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.prefix_cache.layer_names import check_layer_names

    call = call_arguments(wrapped, args, kwargs).arguments
    kv_cache_config = call["kv_cache_config"]
    tensors_by_layer: dict[str, object] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for layer_name in tensor.shared_by:
            tensors_by_layer[layer_name] = tensor
    for layer_name, target in call["shared_layers"].items():
        tensors_by_layer.setdefault(layer_name, f"shared with {target}")
    check_layer_names(
        tensors_by_layer, (name for group in kv_cache_config.kv_cache_groups for name in group.layer_names)
    )
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="vllm-ascend-kv-cache-layer-names",
    target="vllm_ascend.worker.v2.attn_utils",
    attributes=("_allocate_kv_cache",),
    kind=PatchKind.WRAP,
    # DeepSeek-V4 support (and these targets) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    guard=UpstreamGuard(probe=_reports_names),
    wrappers={"_allocate_kv_cache": allocate_kv_cache_wrapper},
    summary="a KV-cache tensor/spec layer mismatch raises an error listing missing and extra layer names",
    why="vllm-ascend asserts 'Some layers are not correctly initialized' without saying which",
    mirrors="vllm-ascend #10193 structured layer-name mismatch error",
    delete_when="vllm-ascend names the mismatching layers itself",
    # Fingerprint of the target as shipped in vllm-ascend 0.23.0.post1.
    tested_fingerprints={"_allocate_kv_cache": ("188418253b07",)},
)
