"""K and V in one tensor, split on a dim of 2, each token row holding every head.

vLLM: a backend whose dims put K/V outside the token row (FlashAttention's
[2, NB, BS, NH, HS]), or, from vLLM 0.32, one whose spec publishes two head slots
(slot 0 K, slot 1 V). LMCache: the cross-layer buffer, the K/V-major and the
blocks-first per-layer tensors, heads after the block tokens.
"""

from __future__ import annotations

from lmcache_ascend.layouts import BLOCK_OP, PER_TOKEN_OPS, DescribedTraits, FormatFacts, Layout, PackedKV, kv_halves


def _recognise(traits: DescribedTraits) -> str | None:
    return "MERGED" if traits.kv_split else None


def _cut(paged, facts: FormatFacts, refuse) -> list:
    if facts.cross_layer:  # [NB, NL, 2, BS, NH, HS]
        return [[paged[:, layer, kv] for layer in range(paged.shape[1])] for kv in range(2)]
    return kv_halves(paged, facts)


LAYOUT = Layout(
    rank=30,
    worker_formats={"MERGED": "merged"},
    recognise_described=_recognise,
    # b12x.py: kv_cache.unbind(1); rocm_segmented_attn.py: kv_cache[:, 0] / kv_cache[:, 1],
    # each side .unflatten(-1, (num_kv_heads, head_size)).
    packed_backends={"B12X": PackedKV.KV_HEAD_SLOTS, "ROCM_SEGMENTED_ATTN": PackedKV.KV_HEAD_SLOTS},
    formats=(
        FormatFacts(0, "NB_NL_TWO_BS_NH_HS", frozenset({BLOCK_OP}), cross_layer=True),
        FormatFacts(1, "NL_X_TWO_NB_BS_NH_HS", PER_TOKEN_OPS | {BLOCK_OP}, two_major=True),
        FormatFacts(2, "NL_X_NB_TWO_BS_NH_HS", PER_TOKEN_OPS | {BLOCK_OP}),
    ),
    cut_block_planes=_cut,
)
