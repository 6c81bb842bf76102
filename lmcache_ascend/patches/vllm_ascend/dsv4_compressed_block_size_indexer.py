"""``AscendDeepseekV4IndexerCache.get_kv_cache_spec`` applies
``VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE`` exactly as the DSA attention patch does
(only compress ratio 128; default 128 = the original object)."""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard
from lmcache_ascend.prefix_cache.block_sizes import COMPRESSED_BLOCK_SIZE_FLAG, spec_with_flag_block_size


PATCH = Patch(
    name="vllm-ascend-dsv4-indexer-block-size",
    target="vllm_ascend.models.deepseek_v4",
    attributes=("AscendDeepseekV4IndexerCache.get_kv_cache_spec",),
    kind=PatchKind.WRAP,
    # DeepSeek-V4 support (and these targets) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    flags=(COMPRESSED_BLOCK_SIZE_FLAG,),
    guard=UpstreamGuard(fixed_if_source_contains=(COMPRESSED_BLOCK_SIZE_FLAG,)),
    wrappers={"AscendDeepseekV4IndexerCache.get_kv_cache_spec": spec_with_flag_block_size},
    summary="DSv4 indexer cache spec follows VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE like the DSA attention spec",
    why="indexer and DSA attention caches must share one compressed block size",
    mirrors="vllm-ascend #10193 AscendDeepseekV4IndexerCache.get_kv_cache_spec",
    delete_when="vllm-ascend reads VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE itself",
    # Fingerprints of the targets as shipped in vllm-ascend 0.23.0.post1.
    tested_fingerprints={
        "AscendDeepseekV4IndexerCache.get_kv_cache_spec": ("1869e0962c34",),
    },
)
