"""RoPE re-rotation and token selection (pure torch logic)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.blend.selection import key_deviation, select_recompute_tokens, topk_budget
from tests.blend.reference.rope import RopeSpec, apply_rope, rerotate_keys


# ---------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rerotated_keys_equal_keys_recomputed_at_the_new_positions(style, rotary_dim):
    spec = RopeSpec(head_dim=16, rotary_dim=rotary_dim, style=style)
    generator = torch.Generator().manual_seed(3)
    raw_keys = torch.randn(40, 4, 16, generator=generator, dtype=torch.float64)
    stored = torch.arange(5, 45)  # e.g. computed after a 5-token system prompt
    new = torch.arange(1000, 1040)  # placed deep into a long prompt
    cached = apply_rope(raw_keys, stored, spec)
    moved = rerotate_keys(cached, stored, new, spec)
    recomputed = apply_rope(raw_keys, new, spec)
    assert torch.allclose(moved, recomputed, rtol=0, atol=1e-10)
    # and it really moved: the cached K is far from the new-position K
    assert (cached - recomputed).abs().max() > 0.1
    if rotary_dim is not None:  # the features beyond rotary_dim are untouched
        assert torch.equal(moved[..., rotary_dim:], raw_keys[..., rotary_dim:])


@settings(max_examples=60, deadline=None)
@given(
    shift_from=st.integers(min_value=0, max_value=30000),
    shift_to=st.integers(min_value=0, max_value=30000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_rerotation_in_low_precision_matches_recompute(shift_from, shift_to, dtype):
    spec = RopeSpec(head_dim=32)
    raw = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(shift_from % 97))
    stored = torch.arange(shift_from, shift_from + 6)
    new = torch.arange(shift_to, shift_to + 6)
    cached = apply_rope(raw.to(dtype), stored, spec)
    moved = rerotate_keys(cached, stored, new, spec)
    recomputed = apply_rope(raw.to(dtype), new, spec)
    assert moved.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 6e-2  # bf16 rounds twice
    assert (moved.float() - recomputed.float()).abs().max() <= tolerance * raw.abs().max() * 4


def test_zero_shift_is_identity_and_positions_are_validated():
    spec = RopeSpec(head_dim=8)
    keys = torch.randn(3, 1, 8)
    same = torch.tensor([4, 9, 2])
    assert torch.equal(rerotate_keys(keys, same, same, spec), keys)
    with pytest.raises(ValueError, match=r"need one of each per token"):
        rerotate_keys(keys, same, same[:2], spec)
    with pytest.raises(ValueError, match=r"need one position per token, i.e. \(3,\)"):
        apply_rope(keys, same[:2], spec)
    with pytest.raises(ValueError, match="last dimension 8 != RopeSpec head_dim 6"):
        apply_rope(keys, same, RopeSpec(head_dim=6))
    with pytest.raises(ValueError, match="rotary_dim=5"):
        RopeSpec(head_dim=8, rotary_dim=5)
    with pytest.raises(ValueError, match="style='llama'"):
        RopeSpec(head_dim=8, style="llama")  # type: ignore[arg-type]


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_apply_rope_matches_vllm_rotary_embedding(is_neox_style, rotary_dim):
    """Cached K in vLLM's paged cache is rotated by vLLM's RotaryEmbedding:
    our rotation must be the same one, or re-rotation would be wrong.  (The
    layer itself needs a vLLM config and device to construct; its cos/sin
    table and its static forward are used directly.)"""
    from types import SimpleNamespace

    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    heads, head_dim = 2, 16
    table_owner = SimpleNamespace(base=10000.0, rotary_dim=rotary_dim, max_position_embeddings=4096)
    table_owner._compute_inv_freq = lambda base: RotaryEmbedding._compute_inv_freq(table_owner, base)
    cos_sin_cache = RotaryEmbedding._compute_cos_sin_cache(table_owner)
    positions = torch.tensor([0, 1, 7, 300, 4000])
    generator = torch.Generator().manual_seed(11)
    query = torch.randn(5, heads * head_dim, generator=generator)
    key = torch.randn(5, heads * head_dim, generator=generator)
    _, vllm_key = RotaryEmbedding.forward_static(
        positions, query, key.clone(), head_dim, rotary_dim, cos_sin_cache, is_neox_style
    )
    spec = RopeSpec(head_dim=head_dim, rotary_dim=rotary_dim, style="neox" if is_neox_style else "gptj")
    ours = apply_rope(key.view(5, heads, head_dim), positions, spec).reshape(5, -1)
    assert not torch.allclose(vllm_key, key)
    # vLLM builds its table in float32, we in float64: position 4000 differs in the 4th digit
    assert torch.allclose(ours, vllm_key, atol=2e-3, rtol=0)


# ----------------------------------------------------------------- selection
def brute_force_selection(deviation, mask, ratio, ranges):
    chosen = {i for i, cached in enumerate(mask) if not cached}
    for start, end in ranges:
        cached = [i for i in range(start, end) if mask[i]]
        budget = topk_budget(len(cached), ratio)
        chosen |= set(sorted(cached, key=lambda i: -deviation[i])[:budget])
    return sorted(chosen)


@settings(max_examples=200, deadline=None)
@given(
    mask=st.lists(st.booleans(), min_size=1, max_size=60),
    ratio=st.sampled_from([0.0, 0.15, 0.3, 0.5, 1.0]),
    split=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_selection_is_holes_plus_per_range_topk(mask, ratio, split, seed):
    count = len(mask)
    generator = torch.Generator().manual_seed(seed)
    fresh = torch.randn(count, 2, 4, generator=generator)
    cached = torch.randn(count, 2, 4, generator=generator)
    mask_tensor = torch.tensor(mask, dtype=torch.bool)
    cached[~mask_tensor] = float("nan")  # hole rows hold garbage: must not matter
    ranges = [(0, count // 2), (count // 2, count)] if split and count >= 2 else [(0, count)]
    selection = select_recompute_tokens(fresh, cached, mask_tensor, ratio, ranges)
    deviation = key_deviation(fresh, cached).tolist()
    assert selection.indices.tolist() == brute_force_selection(deviation, mask, ratio, ranges)
    assert selection.num_hole_tokens == mask.count(False)
    assert selection.num_selected == selection.num_hole_tokens + selection.num_topk_tokens


@pytest.mark.parametrize(
    "mask, ratio, expected",
    [
        ([False] * 5, 0.3, [0, 1, 2, 3, 4]),  # all miss: everything recomputed
        ([True] * 10, 0.3, [1, 4, 8]),  # all hit: exactly the top 3 by deviation
        ([True] * 10, 0.0, []),  # ratio 0: nothing (plain reuse)
        ([False, True, True, True, True], 0.1, [0, 4]),  # hole at the start; int(0.4) -> at least 1
        ([True, True, True, True, False], 0.5, [1, 3, 4]),  # hole at the end
        ([], 0.5, []),  # empty prompt
    ],
)
def test_selection_edge_cases(mask, ratio, expected):
    count = len(mask)
    deviation = torch.tensor([0.0, 5.0, 1.0, 2.0, 9.0, 0.5, 0.1, 0.2, 7.0, 0.3][:count])
    cached = torch.zeros(count, 1, 1)
    fresh = deviation.sqrt().view(count, 1, 1)
    selection = select_recompute_tokens(fresh, cached, torch.tensor(mask, dtype=torch.bool), ratio)
    assert selection.indices.tolist() == expected
    assert selection.indices.dtype == torch.int64


def test_selection_rejects_bad_input():
    keys = torch.zeros(4, 1, 2)
    mask = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="recompute_ratio=1.5; allowed: 0.0 to 1.0"):
        select_recompute_tokens(keys, keys, mask, 1.5)
    with pytest.raises(ValueError, match=r"need bool of shape \(4,\)"):
        select_recompute_tokens(keys, keys, mask[:3], 0.5)
    with pytest.raises(ValueError, match=r"need bool of shape \(4,\)"):
        select_recompute_tokens(keys, keys, mask.int(), 0.5)
    with pytest.raises(ValueError, match="fresh_keys shape"):
        select_recompute_tokens(keys, keys[:3], mask, 0.5)
    with pytest.raises(ValueError, match=r"cached token 2 lies in no budget range"):
        select_recompute_tokens(keys, keys, mask, 0.5, [(0, 2), (3, 4)])
    with pytest.raises(ValueError, match=r"budget range \(1, 3\) .* overlaps"):
        select_recompute_tokens(keys, keys, mask, 0.5, [(0, 2), (1, 3)])
