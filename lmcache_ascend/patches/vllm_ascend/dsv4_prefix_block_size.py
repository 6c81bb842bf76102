"""``AscendHybridKVCacheCoordinator._get_effective_block_size`` unpacks a
``UniformTypeKVCacheSpecs`` bundle (`lmcache_ascend.prefix_cache.block_sizes.unpack_uniform_spec`)
before the original computes storage block x compress ratio."""

from __future__ import annotations

import inspect

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def _unpacks_bundles(module) -> bool:
    source = inspect.getsource(module.AscendHybridKVCacheCoordinator._get_effective_block_size)
    return "UniformTypeKVCacheSpecs" in source or "kv_cache_specs" in source


def effective_block_size_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.prefix_cache.block_sizes import unpack_uniform_spec

    call = call_arguments(wrapped, args, kwargs)
    call.arguments["kv_cache_spec"] = unpack_uniform_spec(call.arguments["kv_cache_spec"])
    return wrapped(*call.args, **call.kwargs)


PATCH = Patch(
    name="vllm-ascend-dsv4-prefix-block-size",
    target="vllm_ascend.patch.platform.patch_kv_cache_coordinator",
    attributes=("AscendHybridKVCacheCoordinator._get_effective_block_size",),
    kind=PatchKind.WRAP,
    # DeepSeek-V4 support (and these targets) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    guard=UpstreamGuard(probe=_unpacks_bundles),
    wrappers={"AscendHybridKVCacheCoordinator._get_effective_block_size": effective_block_size_wrapper},
    summary="DSv4 prefix block size = storage block x compress ratio, with UniformTypeKVCacheSpecs unpacked first",
    why="a uniform-type bundle hides compress_ratio, so the hybrid coordinator's hit alignment (LCM) is wrong",
    mirrors="vllm-ascend #10193 review fix (_prefix_block_size unpacks UniformTypeKVCacheSpecs)",
    delete_when="vllm-ascend's coordinator unpacks uniform-type bundles itself",
    # Fingerprints of the targets as shipped in vllm-ascend 0.23.0.post1.
    tested_fingerprints={
        "AscendHybridKVCacheCoordinator._get_effective_block_size": ("4289efb5f8e5",),
    },
)
