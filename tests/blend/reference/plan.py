"""Retrieval plan: where each cached document's KV goes in the new prompt.

A cached document was computed at some earlier position (its *stored start*:
0 when it was prefilled alone, or its offset in the prompt that stored it).
In the new prompt it sits at ``segment.start``.  The plan lists, per hit
segment, the stored and the new token range, plus everything the blender
needs: which prompt tokens are cached, which are holes (always recomputed),
and the old/new RoPE position of every cached token.

Pure logic: no vLLM / LMCache import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lmcache_ascend.blend.segments import DocumentSegment, SegmentLookup, TokenRun

__all__ = ["RetrievalPlan", "SegmentPlacement", "build_retrieval_plan"]


@dataclass(frozen=True)
class SegmentPlacement:
    """Cached KV of one document: stored at ``stored_start``, placed at
    ``new_start``; both ranges are ``length`` tokens long."""

    segment: DocumentSegment
    stored_start: int

    def __post_init__(self) -> None:
        if self.stored_start < 0:
            raise ValueError(
                f"SegmentPlacement for segment {self.segment.index}: "
                f"stored_start={self.stored_start}; allowed: >= 0"
            )

    @property
    def new_start(self) -> int:
        return self.segment.start

    @property
    def length(self) -> int:
        return self.segment.length

    @property
    def position_shift(self) -> int:
        """How far the document moved (new minus stored position)."""
        return self.new_start - self.stored_start


@dataclass(frozen=True)
class RetrievalPlan:
    """Everything a hole-aware retrieval + blend needs for one prompt."""

    num_tokens: int
    placements: tuple[SegmentPlacement, ...]
    runs: tuple[TokenRun, ...]
    # One top-k budget per stretch of consecutive cached documents.
    budget_ranges: tuple[tuple[int, int], ...]

    @property
    def num_cached_tokens(self) -> int:
        return sum(p.length for p in self.placements)

    @property
    def num_hole_tokens(self) -> int:
        return self.num_tokens - self.num_cached_tokens

    @property
    def hole_runs(self) -> tuple[TokenRun, ...]:
        return tuple(run for run in self.runs if not run.cached)

    def cached_token_mask(self) -> list[bool]:
        mask = [False] * self.num_tokens
        for placement in self.placements:
            segment = placement.segment
            mask[segment.start : segment.end] = [True] * segment.length
        return mask

    def cached_token_indices(self) -> list[int]:
        return [
            index
            for placement in self.placements
            for index in range(placement.segment.start, placement.segment.end)
        ]

    def stored_positions(self) -> list[int]:
        """RoPE position each cached token had when stored (same order as
        `cached_token_indices`)."""
        return [
            placement.stored_start + offset
            for placement in self.placements
            for offset in range(placement.length)
        ]

    def new_positions(self) -> list[int]:
        """RoPE position each cached token has in this prompt."""
        return self.cached_token_indices()

    @property
    def needs_rerotation(self) -> bool:
        return any(p.position_shift != 0 for p in self.placements)


def build_retrieval_plan(
    lookup: SegmentLookup,
    stored_start_of: Callable[[DocumentSegment], int] | None = None,
) -> RetrievalPlan:
    """Place every HIT segment of ``lookup`` (not only the leading ones).

    ``stored_start_of(segment)`` gives the position the document's cached KV
    was computed at; without it the KV is taken to be stored at the position
    it has now (no re-rotation), which is what LMCache assumes.
    """
    placements = []
    for segment in lookup.hit_segments:
        stored_start = segment.start if stored_start_of is None else stored_start_of(segment)
        if not isinstance(stored_start, int) or isinstance(stored_start, bool):
            raise TypeError(
                f"stored_start_of(segment {segment.index}) returned {stored_start!r}; "
                "allowed: an int >= 0"
            )
        placements.append(SegmentPlacement(segment=segment, stored_start=stored_start))
    return RetrievalPlan(
        num_tokens=lookup.num_tokens,
        placements=tuple(placements),
        runs=tuple(lookup.runs()),
        budget_ranges=tuple(lookup.cached_stretches()),
    )
