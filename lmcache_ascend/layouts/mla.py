"""One latent plane per layer, no K/V split (multi-head latent attention).

vLLM: a backend whose dims hold neither heads nor K/V, or vllm-ascend's pair of
one dtype and two shapes (the latent beside its rope part). LMCache: the latent
rows per layer, with blocks and tokens folded or not, and the value/scale blocks.
"""

from __future__ import annotations

from lmcache_ascend.layouts import (
    BLOCK_OP,
    PER_TOKEN_OPS,
    UNILATERAL_OP,
    DescribedTraits,
    FormatFacts,
    Layout,
    TupleTraits,
)


def _recognise_tuple(traits: TupleTraits) -> str | None:
    return "MLA" if traits.count == 2 and traits.uniform and traits.dtypes == 1 and not traits.same_shapes else None


def _recognise_described(traits: DescribedTraits) -> str | None:
    return "MLA"  # asked after every layout whose heads or K/V show in the dims


def _cut(paged, facts: FormatFacts, refuse) -> list:
    return [list(paged)]


_EVERY_OP = PER_TOKEN_OPS | {UNILATERAL_OP, BLOCK_OP}

LAYOUT = Layout(
    rank=50,
    worker_formats={"MLA": "mla"},
    recognise_tuple=_recognise_tuple,
    recognise_described=_recognise_described,
    formats=(
        FormatFacts(3, "NL_X_NB_BS_HS", _EVERY_OP, mla=True),
        FormatFacts(5, "NL_X_NBBS_ONE_HS", _EVERY_OP, mla=True, pbs_fused=True),
        FormatFacts(14, "NL_X_NB_BSV_BSS", frozenset({BLOCK_OP}), mla=True),
    ),
    cut_block_planes=_cut,
)
