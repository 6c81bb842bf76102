"""K and V in separate tensors: a (K, V) pair per layer, or lists of K and of V layers.

vLLM: vllm-ascend registers a (K, V) tuple of equal shapes and dtypes. LMCache:
SGLang's [K layers] + [V layers] lists (blocks and tokens folded or not), per-layer
(K, V) tuples, and one K or V tensor per entry.
"""

from __future__ import annotations

import torch

from lmcache_ascend.layouts import BLOCK_OP, UNILATERAL_OP, FormatFacts, Layout, TupleTraits, planes_of_tuples


def _recognise(traits: TupleTraits) -> str | None:
    return "SEPARATE" if traits.count == 2 and traits.uniform and traits.dtypes == 1 and traits.same_shapes else None


def _kv_lists(paged, facts: FormatFacts, refuse) -> list:
    what = "paged_buffer_ptrs_tensor"
    if not isinstance(paged, (list, tuple)):
        refuse(f"{what} is a {type(paged).__name__}; allowed: [[K layers], [V layers]]")
    if len(paged) != 2 or not all(isinstance(side, (list, tuple)) for side in paged):
        if len(paged) % 2 or not all(isinstance(t, torch.Tensor) for t in paged):
            refuse(f"{what} has {len(paged)} entries; allowed: [[K layers], [V layers]] or a flat list of 2 x NL "
                   "tensors")
        paged = [list(paged[: len(paged) // 2]), list(paged[len(paged) // 2:])]
    return [list(paged[0]), list(paged[1])]


def _cut(paged, facts: FormatFacts, refuse) -> list:
    if facts.kv_list:
        return _kv_lists(paged, facts, refuse)
    if facts.kv_tuple:
        return planes_of_tuples(paged, facts, refuse, lambda length: length == 2, "(K, V) tuples")
    return [list(paged)]


_LISTS = frozenset({UNILATERAL_OP, BLOCK_OP})

LAYOUT = Layout(
    rank=10,
    worker_formats={"SEPARATE": "separate"},
    recognise_tuple=_recognise,
    formats=(
        FormatFacts(4, "TWO_X_NL_X_NBBS_NH_HS", _LISTS, kv_list=True, pbs_fused=True),
        FormatFacts(9, "TWO_X_NL_X_NB_BS_NH_HS", _LISTS, kv_list=True),
        FormatFacts(16, "NL_X_TWO_X_NB_BS_NH_HS", frozenset({BLOCK_OP}), kv_tuple=True),
        FormatFacts(18, "NL_X_NB_BS_NH_HS", frozenset({BLOCK_OP}), single_kv=True),
    ),
    cut_block_planes=_cut,
)
