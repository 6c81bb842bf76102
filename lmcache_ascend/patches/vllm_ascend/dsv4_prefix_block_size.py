"""Unpack ``UniformTypeKVCacheSpecs`` before vllm-ascend computes a DeepSeek-V4 prefix block size.

What: ``AscendHybridKVCacheCoordinator._get_effective_block_size(spec)`` first
replaces a uniform-type bundle by its member spec, so a compressed group's
prefix block size is ``storage_block_size * compress_ratio`` (e.g. 128 x 128)
instead of the bundle's bare ``block_size``.
Why: the bundle carries no ``compress_ratio``; vllm-ascend reads it with
``hasattr`` and silently gets 1, so the coordinator's LCM (the alignment of
every prefix hit) comes out wrong and compressed groups miss.
Mirrors: the review fix on vllm-ascend #10193 (unpack the bundle as
``model_runner_v1`` already does). Logic: `lmcache_ascend.prefix_cache.block_sizes`.
Delete when: vllm-ascend unpacks the bundle itself (the guard then reports
skipped-upstream-has-it).
"""

from __future__ import annotations

import inspect

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.prefix_cache.block_sizes import unpack_uniform_spec


def _unpacks_bundles(module) -> bool:
    source = inspect.getsource(module.AscendHybridKVCacheCoordinator._get_effective_block_size)
    return "UniformTypeKVCacheSpecs" in source or "kv_cache_specs" in source


def _build(ctx: PatchContext) -> dict[str, object]:
    original = ctx.original_function("AscendHybridKVCacheCoordinator._get_effective_block_size")

    def _get_effective_block_size(self, kv_cache_spec) -> int:
        return original(self, unpack_uniform_spec(kv_cache_spec))

    return {"AscendHybridKVCacheCoordinator._get_effective_block_size": _get_effective_block_size}


PATCH = Patch(
    name="vllm-ascend-dsv4-prefix-block-size",
    target="vllm_ascend.patch.platform.patch_kv_cache_coordinator",
    attributes=("AscendHybridKVCacheCoordinator._get_effective_block_size",),
    kind=PatchKind.WRAP,
    # DeepSeek-V4 support (and these targets) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    guard=UpstreamGuard(probe=_unpacks_bundles),
    build=_build,
    summary="DSv4 prefix block size = storage block x compress ratio, with UniformTypeKVCacheSpecs unpacked first",
    why="a uniform-type bundle hides compress_ratio, so the hybrid coordinator's hit alignment (LCM) is wrong",
    mirrors="vllm-ascend #10193 review fix (_prefix_block_size unpacks UniformTypeKVCacheSpecs)",
    delete_when="vllm-ascend's coordinator unpacks uniform-type bundles itself",
    # Fingerprints of the targets as shipped in vllm-ascend 0.23.0.post1.
    tested_fingerprints={
        "AscendHybridKVCacheCoordinator._get_effective_block_size": ("4289efb5f8e5",),
    },
)
