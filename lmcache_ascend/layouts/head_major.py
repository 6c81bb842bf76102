"""K and V in one tensor, heads before the block tokens: per block and head, the token rows.

Each head's rows are a plane of their own (and each K / V side, where K and V are
split). vLLM: a backend whose dims put heads outside the token row, such as its CPU
backend, which keeps per block and head every token's K row, then every token's V row.
LMCache: the HND forms of the cross-layer, K/V-major and blocks-first tensors, and
RBLN's K/V-major layout, which no op moves.
"""

from __future__ import annotations

from lmcache_ascend.layouts import BLOCK_OP, DescribedTraits, FormatFacts, Layout, PackedKV, kv_halves


def _recognise(traits: DescribedTraits) -> str | None:
    return "HEAD_MAJOR" if traits.heads_split else None


def _cut(paged, facts: FormatFacts, refuse) -> list:
    if facts.cross_layer:  # [NB, NL, 2, NH, BS, HS]
        return [[paged[:, layer, kv, head] for layer in range(paged.shape[1])]
                for kv in range(2) for head in range(paged.shape[3])]
    # [NB, NH, BS, HS] per K/V: one plane per head
    return [[layer[:, head] for layer in half] for half in kv_halves(paged, facts) for head in range(half[0].shape[1])]


LAYOUT = Layout(
    rank=20,
    worker_formats={"HEAD_MAJOR": "head-major"},
    recognise_described=_recognise,
    # cpu_attn.py: kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
    packed_backends={"CPU_ATTN": PackedKV.ROWS_PER_BLOCK_HEAD},
    formats=(
        FormatFacts(6, "NL_X_TWO_NB_NH_BS_HS", frozenset({BLOCK_OP}), hnd=True, two_major=True),
        FormatFacts(7, "NL_X_NB_TWO_NH_BS_HS", frozenset({BLOCK_OP}), hnd=True),
        FormatFacts(8, "NB_NL_TWO_NH_BS_HS", frozenset({BLOCK_OP}), cross_layer=True, hnd=True),
        FormatFacts(15, "NL_X_TWO_NB_NH_ONE_BS_HS", hnd=True, two_major=True),
    ),
    cut_block_planes=_cut,
)
