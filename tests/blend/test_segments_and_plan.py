"""Segment lookup over the whole prompt and the retrieval plan (pure logic).

The splitting rule is checked against LMCache's real ``SegmentTokenDatabase``
(only its tokenizer is a tiny local one, see ``conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lmcache_ascend.blend.segments import DocumentSegment, SegmentLookup
from tests.blend.reference.documents import lookup_segments, split_by_separator
from tests.blend.reference.plan import SegmentPlacement, build_retrieval_plan

SEP = (7, 8)


def prompt(*documents: list[int], separator=SEP) -> list[int]:
    tokens: list[int] = []
    for index, document in enumerate(documents):
        if index:
            tokens += list(separator)
        tokens += document
    return tokens


# ----------------------------------------------------------------- splitting
def test_split_matches_lmcache_segment_token_database_on_a_rag_prompt(segment_token_database):
    separator = segment_token_database.sep_tokens.tolist()
    tokens = prompt([1, 3, 3], [4, 5], [6], [1, 1, 1, 1], separator=separator)
    upstream = [
        (start, end)
        for start, end, _ in segment_token_database.process_tokens(tokens=tokens, make_key=False)
    ]
    ours = [(s.start, s.end) for s in split_by_separator(tokens, separator)]
    assert ours == upstream == [(0, 3), (5, 7), (9, 10), (12, 16)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3), min_size=2, max_size=40))
def test_split_agrees_with_lmcache_on_random_prompts(segment_token_database, tokens):
    separator = segment_token_database.sep_tokens.tolist()
    # LMCache matches overlapping separators ("# # #" twice) and its offsets
    # then drift; that case is pinned down separately below.
    assume(all(tokens[i : i + 3] != [2, 2, 2] for i in range(len(tokens) - 2)))
    upstream = [
        (start, end)
        for start, end, _ in segment_token_database.process_tokens(tokens=tokens, make_key=False)
        if end > start  # LMCache also yields (and would key) empty pieces; we drop them
    ]
    ours = [(s.start, s.end) for s in split_by_separator(tokens, separator)]
    assert ours == upstream
    for segment in split_by_separator(tokens, separator):
        piece = tokens[segment.start : segment.end]
        assert all(piece[i : i + 2] != separator for i in range(len(piece) - 1))


def test_overlapping_separators_are_matched_left_to_right(segment_token_database):
    # LMCache's sliding window matches [2, 2] at 0 AND 1 in [2, 2, 2, 5] and
    # reports offsets past the real ones; matching left to right without
    # overlap keeps the offsets exact: the third 2 starts the document.
    assert [(s.start, s.end) for s in split_by_separator([2, 2, 2, 5], [2, 2])] == [(2, 4)]
    upstream = list(segment_token_database.process_tokens(tokens=[2, 2, 2, 5], make_key=False))
    assert [(start, end) for start, end, _ in upstream if end > start] != [(2, 4)]


def test_split_edge_cases():
    assert split_by_separator([], SEP) == []
    assert split_by_separator([5], SEP) == [DocumentSegment(0, 0, 1)]  # shorter than the separator
    assert split_by_separator([1, 2], ()) == [DocumentSegment(0, 0, 2)]  # no separator: one piece
    assert split_by_separator(list(SEP), SEP) == []  # nothing but a separator
    assert [(s.start, s.end) for s in split_by_separator([7, 8, 1, 7, 8, 7, 8, 2, 7, 8], SEP)] == [(2, 3), (7, 8)]
    assert [(s.start, s.end) for s in split_by_separator(torch.tensor([1, 7, 8, 2]), SEP)] == [(0, 1), (3, 4)]


def test_split_rejects_non_token_input():
    with pytest.raises(TypeError, match=r"tokens\[1\]=2.5 is not a token id"):
        split_by_separator([1, 2.5], SEP)
    with pytest.raises(ValueError, match="need 0 <= start < end"):
        DocumentSegment(0, 3, 3)


# -------------------------------------------------------------------- lookup
def lookup_with(tokens: list[int], cached: set[tuple[int, ...]]) -> tuple[SegmentLookup, list]:
    asked = []

    def contains(segment_tokens, segment):
        asked.append(segment.index)
        return tuple(segment_tokens) in cached

    return lookup_segments(tokens, SEP, contains), asked


def test_lookup_continues_past_a_miss():
    docs = [[1, 1], [2, 2, 2], [3], [4, 4]]
    tokens = prompt(*docs)
    result, asked = lookup_with(tokens, {(1, 1), (3,), (4, 4)})
    assert asked == [0, 1, 2, 3]  # every segment asked, the walk never stops
    assert result.hit == (True, False, True, True)
    assert result.prefix_hit_tokens == 2  # what LMCache reports: stops at doc 1
    assert result.hole_mode_hit_tokens == len(tokens)
    assert result.num_cached_tokens == 5
    mask = result.cached_token_mask()
    assert mask == [True, True, False, False, False, False, False, False, False, True, False, False, True, True]
    runs = [(r.start, r.end, r.cached) for r in result.runs()]
    assert runs == [(0, 2, True), (2, 9, False), (9, 10, True), (10, 12, False), (12, 14, True)]
    assert result.cached_stretches() == [(0, 2), (9, 14)]  # separators inside a stretch are kept
    standard = result.truncated_to_prefix()
    assert standard.hit == (True, False, False, False)
    assert standard.cached_stretches() == [(0, 2)]


@pytest.mark.parametrize(
    "cached, prefix, reach, loadable, stretches",
    [
        (set(), 0, 0, 0, []),  # all miss
        ({(1, 1), (2, 2, 2), (3,)}, 10, 10, 10, [(0, 10)]),  # all hit
        ({(2, 2, 2), (3,)}, 0, 10, 0, [(4, 10)]),  # hole at the very start: prefilled
        ({(1, 1), (2, 2, 2)}, 7, 7, 7, [(0, 7)]),  # hole at the very end
        ({(1, 1), (3,)}, 2, 10, 10, [(0, 2), (9, 10)]),  # hole in the middle
    ],
    ids=["all-miss", "all-hit", "hole-at-start", "hole-at-end", "hole-in-middle"],
)
def test_lookup_ordinary_edge_cases(cached, prefix, reach, loadable, stretches):
    tokens = prompt([1, 1], [2, 2, 2], [3])
    result, _ = lookup_with(tokens, cached)
    assert result.prefix_hit_tokens == prefix
    assert result.hole_mode_hit_tokens == reach
    assert result.loadable_hit_tokens == loadable
    assert result.cached_stretches() == stretches
    runs = result.runs()
    assert runs[0].start == 0 and runs[-1].end == len(tokens)
    assert all(a.end == b.start and a.cached != b.cached for a, b in zip(runs, runs[1:]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=1, max_value=4), st.booleans()), max_size=12))
def test_lookup_invariants_on_random_hit_patterns(documents):
    """For any documents and hits: runs tile the prompt, alternate, and agree
    with the mask; stretches hold exactly the cached tokens; standard's view
    is a prefix of hole mode's."""
    tokens: list[int] = []
    cached: set[tuple[int, ...]] = set()
    for index, (length, hit) in enumerate(documents):
        document = [10 + index] * length  # distinct documents
        if hit:
            cached.add(tuple(document))
        tokens += (list(SEP) if index else []) + document
    result, asked = lookup_with(tokens, cached)
    assert asked == list(range(len(documents)))
    mask = result.cached_token_mask()
    runs = result.runs()
    assert sum(run.length for run in runs) == len(tokens)
    assert all(a.end == b.start and a.cached != b.cached for a, b in zip(runs, runs[1:]))
    assert all(mask[i] == run.cached for run in runs for i in range(run.start, run.end))
    in_stretches = sum(mask[a:b].count(True) for a, b in result.cached_stretches())
    assert in_stretches == result.num_cached_tokens == sum(mask)
    assert result.prefix_hit_tokens <= result.loadable_hit_tokens <= result.hole_mode_hit_tokens
    standard = result.truncated_to_prefix()
    assert standard.hole_mode_hit_tokens == result.prefix_hit_tokens
    assert all(s <= h for s, h in zip(standard.hit, result.hit))


def test_empty_prompt_lookup():
    result, asked = lookup_with([], set())
    assert asked == [] and result.runs() == [] and result.cached_token_mask() == []
    assert result.prefix_hit_tokens == result.hole_mode_hit_tokens == 0
    plan = build_retrieval_plan(result)
    assert plan.placements == () and plan.num_hole_tokens == 0 and plan.budget_ranges == ()


def test_lookup_validates_its_parts():
    segment = DocumentSegment(0, 0, 2)
    with pytest.raises(ValueError, match="1 hit flags for 2 segments"):
        SegmentLookup(4, (segment, DocumentSegment(1, 2, 4)), (True,))
    with pytest.raises(ValueError, match="outside the prompt of 1 tokens"):
        SegmentLookup(1, (segment,), (True,))


# ---------------------------------------------------------------------- plan
def test_plan_places_every_hit_segment_at_its_new_positions():
    docs = [[1, 1], [2, 2, 2], [3], [4, 4]]
    tokens = prompt(*docs)
    result, _ = lookup_with(tokens, {(1, 1), (3,), (4, 4)})
    stored_at = {(1, 1): 0, (3,): 40, (4, 4): 12}
    plan = build_retrieval_plan(result, lambda seg: stored_at[tuple(tokens[seg.start : seg.end])])
    assert [(p.segment.start, p.stored_start, p.length) for p in plan.placements] == [(0, 0, 2), (9, 40, 1), (12, 12, 2)]
    assert [p.position_shift for p in plan.placements] == [0, -31, 0]
    assert plan.needs_rerotation
    assert plan.cached_token_indices() == [0, 1, 9, 12, 13]
    assert plan.new_positions() == [0, 1, 9, 12, 13]
    assert plan.stored_positions() == [0, 1, 40, 12, 13]
    assert plan.num_cached_tokens == 5 and plan.num_hole_tokens == len(tokens) - 5
    assert plan.cached_token_mask() == result.cached_token_mask()
    assert plan.budget_ranges == ((0, 2), (9, 14))
    assert [(r.start, r.end) for r in plan.hole_runs] == [(2, 9), (10, 12)]


def test_plan_without_stored_positions_needs_no_rerotation():
    tokens = prompt([1, 1], [2])
    result, _ = lookup_with(tokens, {(1, 1), (2,)})
    plan = build_retrieval_plan(result)
    assert not plan.needs_rerotation
    assert plan.stored_positions() == plan.new_positions() == [0, 1, 4]


def test_plan_rejects_bad_stored_positions():
    tokens = prompt([1, 1], [2])
    result, _ = lookup_with(tokens, {(1, 1), (2,)})
    with pytest.raises(ValueError, match=r"stored_start=-1; allowed: >= 0"):
        build_retrieval_plan(result, lambda seg: -1)
    with pytest.raises(TypeError, match=r"returned '3'; allowed: an int >= 0"):
        build_retrieval_plan(result, lambda seg: "3")
    with pytest.raises(ValueError, match="stored_start=-2"):
        SegmentPlacement(DocumentSegment(0, 0, 1), stored_start=-2)
