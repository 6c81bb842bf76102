"""``DSAAttention.get_kv_cache_spec`` returns its spec with ``block_size`` set from
``VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE`` where the layer's compress ratio is 128
(`lmcache_ascend.prefix_cache.block_sizes`); the default 128 returns the original
spec object untouched."""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard
from lmcache_ascend.prefix_cache.block_sizes import COMPRESSED_BLOCK_SIZE_FLAG, spec_with_flag_block_size

PATCH = Patch(
    name="vllm-ascend-dsv4-attention-block-size",
    target="vllm_ascend.models.layer.attention.layer",
    attributes=("DSAAttention.get_kv_cache_spec",),
    kind=PatchKind.WRAP,
    # DeepSeek-V4 support (and these targets) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    flags=(COMPRESSED_BLOCK_SIZE_FLAG,),
    guard=UpstreamGuard(fixed_if_source_contains=(COMPRESSED_BLOCK_SIZE_FLAG,)),
    wrappers={"DSAAttention.get_kv_cache_spec": spec_with_flag_block_size},
    summary="DSA attention spec of compress-ratio-128 layers uses VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE",
    why="a 128-row compressed block spans 16K tokens, so unaligned 8K prompts never hit",
    mirrors="vllm-ascend #10193 get_dsv4_compressed_kv_block_size in DSAAttention.get_kv_cache_spec",
    delete_when="vllm-ascend reads VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE itself",
    # Fingerprints of the targets as shipped in vllm-ascend 0.23.0.post1.
    tested_fingerprints={
        "DSAAttention.get_kv_cache_spec": ("18e7feeec800",),
    },
)
