"""Configurable DeepSeek-V4 compressed KV block size for vllm-ascend's DSA attention spec.

What: ``DSAAttention.get_kv_cache_spec`` returns its spec with ``block_size``
set from ``VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE`` (32 | 64 | 128) where
the layer's compress ratio is 128; the default 128 returns the original spec
object untouched (bit-for-bit legacy).
Why: one compressed block covers ``block_size * 128`` prompt tokens; at 128
that is 16K tokens, so an 8K prompt never fills one and its tail never hits
(vllm-ascend #10193 measured 0% -> 81.5% replay hits at 32).
Mirrors: vllm-ascend #10193 ``get_dsv4_compressed_kv_block_size`` used by
``DSAAttention.get_kv_cache_spec``. Logic: `lmcache_ascend.prefix_cache.block_sizes`.
Delete when: vllm-ascend reads the same switch itself.
"""

from __future__ import annotations

from lmcache_ascend.flags import flag_value
from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.prefix_cache.block_sizes import COMPRESSED_BLOCK_SIZE_FLAG, with_compressed_block_size


def spec_getter_build(attribute: str):
    """A build that makes ``attribute`` (a ``get_kv_cache_spec``) honour the flag."""

    def build(ctx: PatchContext) -> dict[str, object]:
        original = ctx.original_function(attribute)

        def get_kv_cache_spec(self, vllm_config):
            return with_compressed_block_size(original(self, vllm_config), flag_value(COMPRESSED_BLOCK_SIZE_FLAG))

        return {attribute: get_kv_cache_spec}

    return build


PATCH = Patch(
    name="vllm-ascend-dsv4-attention-block-size",
    target="vllm_ascend.models.layer.attention.layer",
    attributes=("DSAAttention.get_kv_cache_spec",),
    kind=PatchKind.WRAP,
    # DeepSeek-V4 support (and these targets) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    flags=(COMPRESSED_BLOCK_SIZE_FLAG,),
    guard=UpstreamGuard(fixed_if_source_contains=(COMPRESSED_BLOCK_SIZE_FLAG,)),
    build=spec_getter_build("DSAAttention.get_kv_cache_spec"),
    summary="DSA attention spec of compress-ratio-128 layers uses VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE",
    why="a 128-row compressed block spans 16K tokens, so unaligned 8K prompts never hit",
    mirrors="vllm-ascend #10193 get_dsv4_compressed_kv_block_size in DSAAttention.get_kv_cache_spec",
    delete_when="vllm-ascend reads VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE itself",
    # Fingerprints of the targets as shipped in vllm-ascend 0.23.0.post1.
    tested_fingerprints={
        "DSAAttention.get_kv_cache_spec": ("18e7feeec800",),
    },
)
