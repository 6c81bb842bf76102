"""K and V packed together in the last dim: each (head, token) cell holds that token's K, then its V.

Moved whole, one plane per layer (one per head where heads come before the block
tokens). vLLM: backends whose cells pack K and V (TRITON_ATTN, FLASH_ATTN, ...),
found by a content dim of 2 * head_size or a spec with head_size_v. LMCache: the
fused K/V formats and their compressed-state forms.
"""

from __future__ import annotations

from lmcache_ascend.layouts import BLOCK_OP, DescribedTraits, DimRole, FormatFacts, Layout, PackedKV


def _recognise(traits: DescribedTraits) -> str | None:
    # Heads or K/V in the dims but neither split out: one row per token holds them all.
    return "TOKEN_ROWS" if DimRole.HEAD in traits.roles or DimRole.KV in traits.roles else None


def _cut(paged, facts: FormatFacts, refuse) -> list:
    # [NB, BS, NH, 2, HS] splits flatten back to one packed row per token.
    layers = [layer.reshape(*layer.shape[:3], -1) if layer.dim() == 5 else layer for layer in paged]
    if facts.hnd:
        return [[layer[:, head] for layer in layers] for head in range(layers[0].shape[1])]
    return [layers]


_BLOCK = frozenset({BLOCK_OP})

LAYOUT = Layout(
    rank=40,
    worker_formats={"TOKEN_ROWS": "token-rows"},
    recognise_described=_recognise,
    # Read from each backend's forward / do_kv_cache_update (vLLM 0.23 / 0.32 / 0.33):
    # kv_cache.transpose(1, 2).split(head_size, dim=-1), K then V inside each cell.
    packed_backends={
        "TRITON_ATTN": PackedKV.PER_CELL,  # triton_attn.py (per-token-head quant: inline scales, still per cell)
        "FLEX_ATTENTION": PackedKV.PER_CELL,  # flex_attention.py
        "FLASH_ATTN": PackedKV.PER_CELL,  # flash_attn.py; rocm_aiter_fa.py without shuffle; triton_flash_attn._FABackend
        "FLASH_ATTN_DIFFKV": PackedKV.PER_CELL,  # flash_attn_diffkv.py: cell of head_size + head_size_v
        "TRITON_FLASH_ATTN": PackedKV.PER_CELL,  # triton_flash_attn.py: composite of TRITON_ATTN and FLASH_ATTN
        "HPC_ATTN": PackedKV.PER_CELL,  # hpc_attn.py
        "ROCM_AITER_UNIFIED_ATTN": PackedKV.PER_CELL,  # rocm_aiter_unified_attn.py (vLLM 0.32)
        # triton_attn_diffkv.py: kv_cache[..., :head_size_qk], kv_cache[..., head_size_qk:]
        "TRITON_ATTN_DIFFKV": PackedKV.PER_CELL,
        # rocm_octave_attn.py customize_spec: "one packed K+V slot per (token, KV head)" of
        # the octave quantized format; the slot bytes are moved verbatim.
        "ROCM_OCTAVE": PackedKV.PER_CELL,
    },
    formats=(
        FormatFacts(10, "NL_X_NB_NH_BS_TWO_HS", _BLOCK, hnd=True, fused=True),
        FormatFacts(11, "NL_X_NB_BS_NH_TWO_HS", _BLOCK, fused=True),
        FormatFacts(12, "NL_X_NB_NH_BS_CS", _BLOCK, hnd=True, fused=True),
        FormatFacts(13, "NL_X_NB_BS_NH_CS", _BLOCK, fused=True),
    ),
    cut_block_planes=_cut,
)
