"""Name the layers when vllm-ascend's KV-cache tensors and specs disagree.

What: before ``_allocate_kv_cache`` (model runner v2) allocates anything, the
layer names of the KV-cache groups are compared with the layers the
``kv_cache_tensors`` (plus shared layers) will cover; a mismatch raises
`LayerNameMismatchError` listing the missing and the extra names and the
tensors, instead of vllm-ascend's bare ``assert`` after allocating every
tensor ("Some layers are not correctly initialized"). Nothing else changes.
Why: with DeepSeek-V4's many groups (and smaller compressed blocks) a wrong
spec/tensor pairing is easy to make and the bare assert says nothing useful.
Mirrors: vllm-ascend #10193 (structured missing/extra error in the model
runner). Logic: `lmcache_ascend.prefix_cache.layer_names`.
Delete when: vllm-ascend reports the names itself.
"""

from __future__ import annotations

import inspect

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.prefix_cache.layer_names import check_layer_names


def _reports_names(module) -> bool:
    return "Some layers are not correctly initialized" not in inspect.getsource(module._allocate_kv_cache)


def _build(ctx: PatchContext) -> dict[str, object]:
    original = ctx.original_function("_allocate_kv_cache")

    def _allocate_kv_cache(kv_cache_config, shared_layers, device):
        tensors_by_layer: dict[str, object] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            for layer_name in tensor.shared_by:
                tensors_by_layer[layer_name] = tensor
        for layer_name, target in shared_layers.items():
            tensors_by_layer.setdefault(layer_name, f"shared with {target}")
        check_layer_names(
            tensors_by_layer, (name for group in kv_cache_config.kv_cache_groups for name in group.layer_names)
        )
        return original(kv_cache_config, shared_layers, device)

    return {"_allocate_kv_cache": _allocate_kv_cache}


PATCH = Patch(
    name="vllm-ascend-kv-cache-layer-names",
    target="vllm_ascend.worker.v2.attn_utils",
    attributes=("_allocate_kv_cache",),
    kind=PatchKind.WRAP,
    # DeepSeek-V4 support (and these targets) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    guard=UpstreamGuard(probe=_reports_names),
    build=_build,
    summary="a KV-cache tensor/spec layer mismatch raises an error listing missing and extra layer names",
    why="vllm-ascend asserts 'Some layers are not correctly initialized' without saying which",
    mirrors="vllm-ascend #10193 structured layer-name mismatch error",
    delete_when="vllm-ascend names the mismatching layers itself",
    # Fingerprint of the target as shipped in vllm-ascend 0.23.0.post1.
    tested_fingerprints={"_allocate_kv_cache": ("188418253b07",)},
)
