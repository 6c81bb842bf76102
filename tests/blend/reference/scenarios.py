"""RAG-style scenarios on the tiny reference model, and their error metrics.

A prompt is ``system + SEP + doc_1 + SEP + ... + doc_n + SEP + question``.
The system prompt is cached in place; every document except the "holes" was
cached earlier by prefilling ``system + SEP + doc`` alone, so its KV lacks the
other documents' context and sits at other positions.  The question is never
cached.  Each scenario is run these ways:

* ``full``: prefill from scratch (the ground truth);
* ``standard``: LMCache's CacheBlend: the leading run of cached documents is
  blended, everything from the first missing document on is prefilled;
* ``hole``: hole mode: every cached document is blended, only the holes,
  separators and question are prefilled;
* ``reuse``: every cached document's KV used as is (re-rotated), no blending;
* ``random`` (only at a fixed budget): hole mode's structure, but the cached
  tokens it recomputes drawn at random instead of by K deviation.

`run_mode` runs a mode at a recompute ratio with the package's selection
rule; `run_at_budget` runs standard, hole or random mode recomputing exactly
the same number of tokens (`standard_budget` gives what standard CacheBlend
spends at a ratio), so modes can be compared at equal cost.  Standard and hole
mode use the same selection and the same re-rotation, so the comparison
isolates what hole mode changes.  Used by the tests and by
``scripts/bench_hole_blend.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lmcache_ascend.blend.segments import SegmentLookup
from lmcache_ascend.blend.selection import RecomputeSelection, key_deviation, topk_budget
from tests.blend.reference.documents import lookup_segments
from tests.blend.reference.model import BlendOutcome, PromptKV, RecomputeChooser, TinyRopeTransformer
from tests.blend.reference.plan import RetrievalPlan, build_retrieval_plan
from tests.blend.reference.rope import rerotate_keys

__all__ = [
    "BlendScenario",
    "ModeResult",
    "ScenarioSpec",
    "assemble_cached_kv",
    "budget_chooser",
    "build_scenario",
    "hole_document_indices",
    "run_at_budget",
    "run_mode",
    "split_budget",
    "standard_budget",
]

HolePlacement = Literal["start", "middle", "end"]
BlendMode = Literal["standard", "hole", "reuse"]


@dataclass(frozen=True)
class ScenarioSpec:
    num_documents: int
    num_holes: int
    placement: HolePlacement
    seed: int = 0
    system_length: int = 16
    document_length_range: tuple[int, int] = (24, 48)
    question_length: int = 12

    def __post_init__(self) -> None:
        if self.num_documents < 1:
            raise ValueError(f"ScenarioSpec num_documents={self.num_documents}; allowed: >= 1")
        if not 0 <= self.num_holes <= self.num_documents:
            raise ValueError(
                f"ScenarioSpec num_holes={self.num_holes}; allowed: 0 to num_documents "
                f"({self.num_documents})"
            )
        if self.placement not in ("start", "middle", "end"):
            raise ValueError(
                f"ScenarioSpec placement={self.placement!r}; allowed: 'start', 'middle', 'end'"
            )


def hole_document_indices(num_documents: int, num_holes: int, placement: HolePlacement) -> list[int]:
    """Which documents (0-based) are missing from the cache.

    ``start``: the first ones; ``end``: the last ones; ``middle``: spread
    evenly over the inner documents (never the first or last when avoidable,
    else a centred block).
    """
    if num_holes == 0:
        return []
    if placement == "start":
        return list(range(num_holes))
    if placement == "end":
        return list(range(num_documents - num_holes, num_documents))
    inner = list(range(1, num_documents - 1))
    if num_holes >= len(inner):  # no room to spread: a centred block
        first = (num_documents - num_holes) // 2
        return list(range(first, first + num_holes))
    step = len(inner) / (num_holes + 1)
    return sorted({inner[int(step * (i + 1))] for i in range(num_holes)})


@dataclass(frozen=True)
class _StoredSegment:
    stored_start: int
    kv: PromptKV


@dataclass(frozen=True)
class BlendScenario:
    spec: ScenarioSpec
    tokens: torch.Tensor
    separator: tuple[int, ...]
    lookup: SegmentLookup
    hole_documents: tuple[int, ...]
    question_start: int
    store: dict[tuple[int, ...], _StoredSegment]

    def stored_start_of(self, segment) -> int:
        key = tuple(self.tokens[segment.start : segment.end].tolist())
        return self.store[key].stored_start


def build_scenario(model: TinyRopeTransformer, spec: ScenarioSpec) -> BlendScenario:
    vocab = model.config.vocab_size
    separator = (vocab - 2, vocab - 1)  # reserved: never inside a document
    generator = torch.Generator().manual_seed(10_000 + spec.seed)

    def random_tokens(count: int) -> list[int]:
        return torch.randint(0, vocab - 2, (count,), generator=generator).tolist()

    low, high = spec.document_length_range
    system = random_tokens(spec.system_length)
    documents = [
        random_tokens(int(torch.randint(low, high + 1, (1,), generator=generator)))
        for _ in range(spec.num_documents)
    ]
    question = random_tokens(spec.question_length)
    holes = hole_document_indices(spec.num_documents, spec.num_holes, spec.placement)

    tokens: list[int] = list(system)
    for document in documents:
        tokens += list(separator) + document
    tokens += list(separator)
    question_start = len(tokens)
    tokens += question

    # The cache: the system prompt in place, every non-hole document as it
    # was computed after the system prompt alone.
    store: dict[tuple[int, ...], _StoredSegment] = {}
    _, system_kv = model.prefill(torch.tensor(system))
    store[tuple(system)] = _StoredSegment(0, system_kv)
    document_start = len(system) + len(separator)
    for index, document in enumerate(documents):
        if index in holes:
            continue
        _, kv = model.prefill(torch.tensor(system + list(separator) + document))
        store[tuple(document)] = _StoredSegment(
            document_start, kv.rows(document_start, document_start + len(document))
        )

    lookup = lookup_segments(tokens, separator, lambda seg_tokens, _: tuple(seg_tokens) in store)
    return BlendScenario(
        spec=spec,
        tokens=torch.tensor(tokens),
        separator=separator,
        lookup=lookup,
        hole_documents=tuple(holes),
        question_start=question_start,
        store=store,
    )


def assemble_cached_kv(
    model: TinyRopeTransformer, scenario: BlendScenario, plan: RetrievalPlan
) -> tuple[PromptKV, torch.Tensor]:
    """Cached KV for every prompt token (re-rotated to the new positions) and
    the cached-token mask.  Rows without cached KV are NaN, so any use of
    them shows up in the outputs."""
    count = plan.num_tokens
    config = model.config
    shape = (count, config.num_heads, config.head_dim)
    keys = [torch.full(shape, float("nan")) for _ in range(config.num_layers)]
    values = [torch.full(shape, float("nan")) for _ in range(config.num_layers)]
    for placement in plan.placements:
        segment = placement.segment
        stored = scenario.store[tuple(scenario.tokens[segment.start : segment.end].tolist())]
        if stored.kv.num_tokens != segment.length:
            raise ValueError(
                f"stored KV of segment {segment.index} has {stored.kv.num_tokens} rows "
                f"for {segment.length} tokens"
            )
        stored_positions = torch.arange(placement.stored_start, placement.stored_start + placement.length)
        new_positions = torch.arange(segment.start, segment.end)
        for layer_id in range(config.num_layers):
            keys[layer_id][segment.start : segment.end] = rerotate_keys(
                stored.kv.keys[layer_id], stored_positions, new_positions, model.rope
            )
            values[layer_id][segment.start : segment.end] = stored.kv.values[layer_id]
    mask = torch.tensor(plan.cached_token_mask(), dtype=torch.bool)
    return PromptKV(tuple(keys), tuple(values)), mask


@dataclass(frozen=True)
class ModeResult:
    mode: str
    recomputed_fraction: float
    kv_relative_error: float  # whole prompt, all layers, K and V
    prefix_kv_relative_error: float  # tokens before standard's first miss
    question_hidden_relative_error: float  # final hidden states of the question
    last_token_kl: float  # KL(full || mode) of the last token's next-token distribution
    outcome: BlendOutcome


def _relative_error(candidate: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    numerator = sum(float((c.double() - t.double()).pow(2).sum()) for c, t in zip(candidate, truth))
    denominator = sum(float(t.double().pow(2).sum()) for t in truth)
    return (numerator / denominator) ** 0.5 if denominator > 0 else float(numerator > 0)


def _lookup_for(scenario: BlendScenario, mode: str) -> SegmentLookup:
    if mode in ("hole", "random", "reuse"):
        return scenario.lookup
    if mode == "standard":
        return scenario.lookup.truncated_to_prefix()
    raise ValueError(f"mode={mode!r}; allowed: 'standard', 'hole', 'reuse', 'random'")


def run_mode(
    model: TinyRopeTransformer,
    scenario: BlendScenario,
    mode: BlendMode,
    recompute_ratio: float,
    check_layer: int = 1,
    truth: tuple[torch.Tensor, PromptKV] | None = None,
) -> ModeResult:
    """``mode`` at ``recompute_ratio`` with the package's selection rule."""
    if mode not in ("standard", "hole", "reuse"):
        raise ValueError(f"mode={mode!r}; allowed: 'standard', 'hole', 'reuse'")
    lookup = _lookup_for(scenario, mode)
    if mode == "reuse":
        recompute_ratio, check_layer = 0.0, 0
    plan = build_retrieval_plan(lookup, scenario.stored_start_of)
    cached, mask = assemble_cached_kv(model, scenario, plan)
    outcome = model.blend_prefill(
        scenario.tokens, cached, mask, check_layer, recompute_ratio, plan.budget_ranges
    )
    return _measure(model, scenario, mode, outcome, truth)


def standard_budget(scenario: BlendScenario, recompute_ratio: float) -> int:
    """Tokens standard CacheBlend recomputes from the check layer on at ``recompute_ratio``:
    every token it has no cached KV for (from its first miss on, and separators)
    plus the top-k share of its cached prefix."""
    lookup = scenario.lookup.truncated_to_prefix()
    return lookup.num_tokens - lookup.num_cached_tokens + topk_budget(lookup.num_cached_tokens, recompute_ratio)


def split_budget(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder; ties to the earlier)."""
    whole = sum(weights)
    if not 0 <= total <= whole:
        raise ValueError(f"budget {total}; allowed: 0 to {whole} (the cached tokens)")
    if whole == 0:
        return [0] * len(weights)
    shares = [divmod(total * weight, whole) for weight in weights]
    result = [share for share, _ in shares]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-shares[i][1], i))
    for index in by_remainder[: total - sum(result)]:
        result[index] += 1
    return result


def budget_chooser(
    mode: Literal["standard", "hole", "random"], lookup: SegmentLookup, num_recomputed: int, seed: int = 0
) -> RecomputeChooser:
    """Recompute exactly ``num_recomputed`` tokens: every token without cached KV,
    then ``standard`` / ``hole``: the top-k cached tokens by K deviation, the
    budget split over the stretches of cached documents in proportion to their
    cached tokens; ``random``: cached tokens drawn uniformly (seeded)."""
    if mode not in ("standard", "hole", "random"):
        raise ValueError(f"mode={mode!r}; allowed: 'standard', 'hole', 'random'")
    mask = torch.tensor(lookup.cached_token_mask(), dtype=torch.bool)
    holes = torch.nonzero(~mask).flatten()
    num_topk = num_recomputed - int(holes.numel())
    if not 0 <= num_topk <= int(mask.sum()):
        raise ValueError(
            f"num_recomputed={num_recomputed}; allowed for {mode} mode on this prompt: "
            f"{int(holes.numel())} (the tokens without cached KV) to {mask.numel()} (all tokens)"
        )
    stretches = lookup.cached_stretches()

    def choose(fresh_keys: torch.Tensor, cached_keys: torch.Tensor, cached_token_mask: torch.Tensor):
        if not torch.equal(cached_token_mask, mask):
            raise ValueError("budget_chooser: the blend's cached-token mask is not the lookup's")
        cached_indices = [torch.nonzero(mask[a:b]).flatten() + a for a, b in stretches]
        if mode == "random":
            pool = torch.cat(cached_indices) if cached_indices else torch.empty(0, dtype=torch.int64)
            generator = torch.Generator().manual_seed(seed)
            chosen = [pool[torch.randperm(pool.numel(), generator=generator)[:num_topk]]]
        else:
            deviation = key_deviation(fresh_keys, cached_keys)
            budgets = split_budget(num_topk, [int(indices.numel()) for indices in cached_indices])
            chosen = [
                indices[torch.topk(deviation[indices], k=budget).indices]
                for indices, budget in zip(cached_indices, budgets)
            ]
        return RecomputeSelection(
            indices=torch.sort(torch.cat([holes, *chosen])).values.to(torch.int64),
            num_hole_tokens=int(holes.numel()),
            num_topk_tokens=num_topk,
        )

    return choose


def run_at_budget(
    model: TinyRopeTransformer,
    scenario: BlendScenario,
    mode: Literal["standard", "hole", "random"],
    num_recomputed: int,
    check_layer: int = 1,
    truth: tuple[torch.Tensor, PromptKV] | None = None,
    seed: int = 0,
) -> ModeResult:
    """``mode`` recomputing exactly ``num_recomputed`` tokens from the check layer on
    (see `budget_chooser`); ``seed`` only matters for ``random``."""
    lookup = _lookup_for(scenario, mode)
    plan = build_retrieval_plan(lookup, scenario.stored_start_of)
    cached, mask = assemble_cached_kv(model, scenario, plan)
    outcome = model.blend_prefill(
        scenario.tokens, cached, mask, check_layer, 0.0,
        choose=budget_chooser(mode, lookup, num_recomputed, seed),
    )
    return _measure(model, scenario, mode, outcome, truth)


def _measure(
    model: TinyRopeTransformer,
    scenario: BlendScenario,
    mode: str,
    outcome: BlendOutcome,
    truth: tuple[torch.Tensor, PromptKV] | None,
) -> ModeResult:
    truth_hidden, truth_kv = truth if truth is not None else model.prefill(scenario.tokens)
    prefix_end = scenario.lookup.prefix_hit_tokens
    question = slice(scenario.question_start, scenario.tokens.shape[0])
    position_of = {int(t): i for i, t in enumerate(outcome.recomputed.tolist())}
    question_rows = [position_of[t] for t in range(question.start, question.stop)]
    mode_question_hidden = outcome.final_hidden[question_rows]

    last_truth = torch.log_softmax(model.logits(truth_hidden[-1]).double(), dim=-1)
    last_mode = torch.log_softmax(model.logits(outcome.final_hidden[-1]).double(), dim=-1)
    kl = float((last_truth.exp() * (last_truth - last_mode)).sum())

    both = lambda kv: list(kv.keys) + list(kv.values)  # noqa: E731
    return ModeResult(
        mode=mode,
        recomputed_fraction=outcome.recomputed.numel() / scenario.tokens.shape[0],
        kv_relative_error=_relative_error(both(outcome.kv), both(truth_kv)),
        prefix_kv_relative_error=_relative_error(
            [x[:prefix_end] for x in both(outcome.kv)], [x[:prefix_end] for x in both(truth_kv)]
        ),
        question_hidden_relative_error=_relative_error(
            [mode_question_hidden], [truth_hidden[question]]
        ),
        last_token_kl=max(kl, 0.0),
        outcome=outcome,
    )
