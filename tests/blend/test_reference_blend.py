"""Hole-mode CacheBlend end to end on the tiny reference transformer.

Full prefill is the ground truth.  Cached rows without KV are NaN in every
run, so a single use of a hole's (stale / missing) KV makes outputs non-finite.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.blend.selection import topk_budget
from tests.blend.reference.model import PromptKV, TinyModelConfig, TinyRopeTransformer
from tests.blend.reference.plan import build_retrieval_plan
from tests.blend.reference.scenarios import (
    ScenarioSpec,
    assemble_cached_kv,
    build_scenario,
    hole_document_indices,
    run_at_budget,
    run_mode,
    split_budget,
    standard_budget,
)


@pytest.fixture(scope="module")
def model() -> TinyRopeTransformer:
    return TinyRopeTransformer(TinyModelConfig(num_layers=3, hidden_size=32, num_heads=2, mlp_size=64))


def all_finite(kv: PromptKV) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in kv.keys + kv.values)


def test_model_is_deterministic_and_causal(model):
    tokens = torch.arange(1, 30)
    hidden, kv = model.prefill(tokens)
    again, kv_again = TinyRopeTransformer(model.config).prefill(tokens)
    assert torch.equal(hidden, again) and all(torch.equal(a, b) for a, b in zip(kv.keys, kv_again.keys))
    prefix_hidden, prefix_kv = model.prefill(tokens[:10])
    assert torch.allclose(prefix_hidden, hidden[:10], atol=1e-5)
    assert torch.allclose(prefix_kv.keys[2], kv.keys[2][:10], atol=1e-5)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\); got min 0, max 999"):
        model.prefill(torch.tensor([0, 999]))


def test_blend_at_ratio_one_is_exactly_full_prefill(model):
    scenario = build_scenario(model, ScenarioSpec(num_documents=6, num_holes=2, placement="middle", seed=1))
    truth_hidden, truth_kv = model.prefill(scenario.tokens)
    plan = build_retrieval_plan(scenario.lookup, scenario.stored_start_of)
    cached, mask = assemble_cached_kv(model, scenario, plan)
    outcome = model.blend_prefill(scenario.tokens, cached, mask, 1, 1.0, plan.budget_ranges)
    assert outcome.recomputed.tolist() == list(range(scenario.tokens.shape[0]))
    assert torch.allclose(outcome.final_hidden, truth_hidden, atol=1e-5)
    for ours, truth in zip(outcome.kv.keys + outcome.kv.values, truth_kv.keys + truth_kv.values):
        assert torch.allclose(ours, truth, atol=1e-5)


def test_cached_kv_of_a_document_in_place_is_exact(model):
    """The system prompt is cached at its own position: after re-rotation
    (a no-op) it equals the ground truth bit for bit in every layer."""
    scenario = build_scenario(model, ScenarioSpec(num_documents=6, num_holes=1, placement="end", seed=2))
    plan = build_retrieval_plan(scenario.lookup, scenario.stored_start_of)
    cached, _ = assemble_cached_kv(model, scenario, plan)
    _, truth_kv = model.prefill(scenario.tokens)
    system = plan.placements[0]
    assert system.stored_start == system.new_start == 0
    end = system.segment.end
    for layer in range(model.config.num_layers):
        assert torch.equal(cached.keys[layer][:end], truth_kv.keys[layer][:end])
    # Moved documents are re-rotated: layer-0 K (no cross-document context
    # yet except the system prompt) matches the truth closely.
    moved = plan.placements[2]
    assert moved.position_shift > 0
    rows = slice(moved.segment.start, moved.segment.end)
    assert torch.allclose(cached.keys[0][rows], truth_kv.keys[0][rows], atol=1e-4)


@pytest.mark.parametrize("num_holes", [1, 2, 3])
@pytest.mark.parametrize("placement", ["start", "middle", "end"])
@pytest.mark.parametrize("ratio", [0.15, 0.5])
def test_hole_mode_recomputes_holes_plus_ratio_of_cached(model, num_holes, placement, ratio):
    scenario = build_scenario(model, ScenarioSpec(8, num_holes, placement, seed=num_holes))
    truth = model.prefill(scenario.tokens)
    hole = run_mode(model, scenario, "hole", ratio, truth=truth)
    standard = run_mode(model, scenario, "standard", ratio, truth=truth)
    reuse = run_mode(model, scenario, "reuse", ratio, truth=truth)
    for result in (hole, standard, reuse):
        assert all_finite(result.outcome.kv)  # no hole KV (NaN) ever used
        assert bool(torch.isfinite(result.outcome.final_hidden).all())

    count = scenario.tokens.shape[0]
    lookup = scenario.lookup
    cached_mask = torch.tensor(lookup.cached_token_mask())
    expected = (count - lookup.num_cached_tokens) + sum(
        topk_budget(int(cached_mask[a:b].sum()), ratio) for a, b in lookup.cached_stretches()
    )
    assert hole.outcome.recomputed.numel() == expected
    # every uncached token is recomputed in hole mode
    assert set(torch.nonzero(~cached_mask).flatten().tolist()) <= set(hole.outcome.recomputed.tolist())
    # standard CacheBlend recomputes everything from its first miss on
    prefix_end = lookup.prefix_hit_tokens
    assert set(range(prefix_end, count)) <= set(standard.outcome.recomputed.tolist())
    assert hole.recomputed_fraction <= standard.recomputed_fraction
    # on the prefix standard CacheBlend handles, hole mode is exactly as good
    assert hole.prefix_kv_relative_error <= standard.prefix_kv_relative_error + 1e-9
    assert reuse.recomputed_fraction == pytest.approx((count - lookup.num_cached_tokens) / count)


def test_hole_mode_beats_plain_reuse_on_average(model):
    hole_errors, reuse_errors = [], []
    for seed in range(3):
        scenario = build_scenario(model, ScenarioSpec(8, 2, "middle", seed=seed))
        truth = model.prefill(scenario.tokens)
        hole_errors.append(run_mode(model, scenario, "hole", 0.3, truth=truth).kv_relative_error)
        reuse_errors.append(run_mode(model, scenario, "reuse", 0.3, truth=truth).kv_relative_error)
    assert sum(hole_errors) < sum(reuse_errors)
    assert all(error > 0 for error in reuse_errors)  # the scenario really needs blending


def test_all_hit_prompt_with_true_kv_reproduces_the_truth(model):
    """Every token cached with its exact KV: blending selects some, recomputes
    them to the same values, and the KV stays the truth."""
    tokens = torch.arange(3, 60)
    truth_hidden, truth_kv = model.prefill(tokens)
    mask = torch.ones(tokens.shape[0], dtype=torch.bool)
    outcome = model.blend_prefill(tokens, truth_kv, mask, 1, 0.3)
    assert outcome.selection.num_hole_tokens == 0
    assert outcome.recomputed.numel() == topk_budget(tokens.shape[0], 0.3)
    for ours, truth in zip(outcome.kv.keys, truth_kv.keys):
        assert torch.allclose(ours, truth, atol=1e-5)
    rows = outcome.recomputed
    assert torch.allclose(outcome.final_hidden, truth_hidden[rows], atol=1e-5)


def test_all_miss_prompt_is_full_prefill(model):
    tokens = torch.arange(3, 40)
    truth_hidden, truth_kv = model.prefill(tokens)
    shape = truth_kv.keys[0].shape
    nothing = PromptKV(
        tuple(torch.full(shape, float("nan")) for _ in truth_kv.keys),
        tuple(torch.full(shape, float("nan")) for _ in truth_kv.values),
    )
    mask = torch.zeros(tokens.shape[0], dtype=torch.bool)
    outcome = model.blend_prefill(tokens, nothing, mask, 1, 0.5)
    assert outcome.recomputed.tolist() == list(range(tokens.shape[0]))
    assert torch.allclose(outcome.final_hidden, truth_hidden, atol=1e-5)
    assert all_finite(outcome.kv)


def test_hole_at_the_very_start_and_end_of_the_prompt(model):
    """Hole at the very start: the first document after the system prompt
    misses, so standard CacheBlend keeps only the system prompt; the
    question at the end is always a hole."""
    scenario = build_scenario(model, ScenarioSpec(6, 1, "start", seed=5))
    assert scenario.lookup.prefix_hit_tokens == scenario.spec.system_length
    truth = model.prefill(scenario.tokens)
    hole = run_mode(model, scenario, "hole", 0.15, truth=truth)
    assert all_finite(hole.outcome.kv)
    last = scenario.tokens.shape[0] - 1
    assert hole.outcome.recomputed[-1].item() == last


def test_blend_rejects_bad_arguments(model):
    tokens = torch.arange(3, 10)
    _, kv = model.prefill(tokens)
    mask = torch.ones(7, dtype=torch.bool)
    with pytest.raises(ValueError, match="check_layer=3; allowed: 0 to 2"):
        model.blend_prefill(tokens, kv, mask, 3, 0.2)
    with pytest.raises(ValueError, match="cached KV has 7 rows for 6 tokens"):
        model.blend_prefill(tokens[:6], kv, mask[:6], 1, 0.2)
    with pytest.raises(ValueError, match="num_holes=9; allowed: 0 to num_documents"):
        ScenarioSpec(8, 9, "start")
    with pytest.raises(ValueError, match="mode='fast'"):
        run_mode(model, build_scenario(model, ScenarioSpec(6, 1, "end")), "fast", 0.2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "documents, holes, placement, expected",
    [
        (8, 1, "start", [0]),
        (8, 1, "end", [7]),
        (8, 1, "middle", [4]),
        (8, 3, "middle", [2, 4, 5]),
        (6, 3, "middle", [2, 3, 4]),
        (4, 3, "middle", [0, 1, 2]),
        (6, 2, "end", [4, 5]),
        (3, 3, "middle", [0, 1, 2]),
    ],
)
def test_hole_placement(documents, holes, placement, expected):
    chosen = hole_document_indices(documents, holes, placement)
    assert chosen == expected and len(set(chosen)) == holes


# ------------------------------------------------------------ equal budget
@pytest.mark.parametrize("placement", ["start", "middle"])
@pytest.mark.parametrize("ratio", [0.15, 0.5])
def test_standard_at_its_own_budget_is_standard_at_the_ratio(model, placement, ratio):
    scenario = build_scenario(model, ScenarioSpec(8, 2, placement, seed=3))
    truth = model.prefill(scenario.tokens)
    by_ratio = run_mode(model, scenario, "standard", ratio, truth=truth)
    budget = standard_budget(scenario, ratio)
    by_budget = run_at_budget(model, scenario, "standard", budget, truth=truth)
    assert by_ratio.outcome.recomputed.numel() == budget
    assert torch.equal(by_budget.outcome.recomputed, by_ratio.outcome.recomputed)
    assert by_budget.kv_relative_error == by_ratio.kv_relative_error


@pytest.mark.parametrize("placement", ["start", "middle"])
def test_hole_and_random_at_equal_budget_recompute_exactly_the_budget(model, placement):
    scenario = build_scenario(model, ScenarioSpec(8, 2, placement, seed=4))
    truth = model.prefill(scenario.tokens)
    budget = standard_budget(scenario, 0.3)
    uncached = set(torch.nonzero(~torch.tensor(scenario.lookup.cached_token_mask())).flatten().tolist())
    results = {
        "hole": run_at_budget(model, scenario, "hole", budget, truth=truth),
        "random0": run_at_budget(model, scenario, "random", budget, truth=truth, seed=0),
        "random0again": run_at_budget(model, scenario, "random", budget, truth=truth, seed=0),
        "random1": run_at_budget(model, scenario, "random", budget, truth=truth, seed=1),
    }
    for result in results.values():
        recomputed = result.outcome.recomputed.tolist()
        assert len(recomputed) == len(set(recomputed)) == budget
        assert uncached <= set(recomputed)
        assert all_finite(result.outcome.kv)
    assert torch.equal(results["random0"].outcome.recomputed, results["random0again"].outcome.recomputed)
    assert not torch.equal(results["random0"].outcome.recomputed, results["random1"].outcome.recomputed)
    assert not torch.equal(results["hole"].outcome.recomputed, results["random0"].outcome.recomputed)


def test_budget_below_the_uncached_tokens_is_refused(model):
    scenario = build_scenario(model, ScenarioSpec(6, 2, "middle", seed=1))
    uncached = scenario.tokens.shape[0] - scenario.lookup.num_cached_tokens
    with pytest.raises(ValueError, match=f"num_recomputed={uncached - 1}; allowed for hole mode"):
        run_at_budget(model, scenario, "hole", uncached - 1)
    with pytest.raises(ValueError, match="mode='reuse'; allowed: 'standard', 'hole', 'random'"):
        run_at_budget(model, scenario, "reuse", uncached)  # type: ignore[arg-type]


def test_split_budget_is_proportional_and_exact():
    assert split_budget(10, [50, 30, 20]) == [5, 3, 2]
    assert split_budget(3, [1, 1, 1, 1]) == [1, 1, 1, 0]  # ties go to the earlier stretch
    assert split_budget(7, [10, 3]) == [5, 2]  # 5.38 / 1.62: the larger remainder gets the extra token
    assert split_budget(13, [10, 3]) == [10, 3]
    assert split_budget(0, [4, 4]) == [0, 0]
    with pytest.raises(ValueError, match="budget 14; allowed: 0 to 13"):
        split_budget(14, [10, 3])
