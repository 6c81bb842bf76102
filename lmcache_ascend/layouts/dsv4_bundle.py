"""DeepSeek-V4's bundle: per layer a tuple of planes of their own widths and dtypes.

vLLM: vllm-ascend registers each layer as a tuple of planes. Three of one paging
geometry are the latent, its rope part and the indexer K (DSA); four of mixed
dtypes are the int8 caches beside their scales, some of them dtype views of one
int8 blob (DSA_C8); any other tuple (planes of different geometry, dtype or
scheduler group) is moved plane by plane as it is (MULTI_PLANE). LMCache: per
layer a tuple of MLA planes, whose block-op objects hold the planes' bytes side by
side in each token row ([NL, T, row]).
"""

from __future__ import annotations

from lmcache_ascend.layouts import BLOCK_OP, FormatFacts, Layout, TupleTraits, planes_of_tuples


def _recognise(traits: TupleTraits) -> str:
    if traits.count == 3 and traits.uniform:
        return "DSA"
    if traits.count == 4 and traits.uniform and traits.dtypes > 1:
        return "DSA_C8"
    return "MULTI_PLANE"  # asked last: every tuple no other layout recognises


def _cut(paged, facts: FormatFacts, refuse) -> list:
    return planes_of_tuples(paged, facts, refuse, lambda length: True, "plane tuples of one length")


def _object_regions(obj, row_bytes, layers: int, token_offset: int, refuse) -> tuple[list[int], list[int], int]:
    # The planes' bytes side by side in each token row: a plane's rows are one token row apart.
    token_row = obj.shape[-1] * obj.element_size() if obj.dim() == 3 else sum(row_bytes)
    if sum(row_bytes) > token_row:
        refuse(f"rows hold {token_row} bytes; the planes need {sum(row_bytes)}")
    offsets = [token_offset * token_row + sum(row_bytes[:plane]) for plane in range(len(row_bytes))]
    return offsets, [token_row] * len(row_bytes), obj.numel() * obj.element_size() // layers


LAYOUT = Layout(
    rank=60,
    worker_formats={"DSA": "dsa", "DSA_C8": "dsa-c8", "MULTI_PLANE": "multi-plane"},
    recognise_tuple=_recognise,
    formats=(FormatFacts(17, "NL_X_NP_X_NB_BS_ONE_HS", frozenset({BLOCK_OP}), mla=True, kv_tuple=True),),
    cut_block_planes=_cut,
    block_object_regions=_object_regions,
)
