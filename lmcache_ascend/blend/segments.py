"""Document segments of a prompt and their lookup over the WHOLE prompt.

CacheBlend keys its cache by document, not by fixed-size chunk: the prompt is
cut at every occurrence of a separator token sequence (LMCache's
``blend_special_str``, tokenized), each piece is hashed on its own, and the
separator tokens themselves belong to no piece (so they are never cached).

LMCache's lookup walks these pieces in order and stops at the first one it
does not hold; everything after is prefilled from scratch.  Hole mode keeps
walking: the result records hit and miss runs across the whole prompt, so the
cached documents after a missing one (a "hole") can still be reused.

Pure logic: no vLLM / LMCache import.  The segments come from LMCache's own
token database (`lookup_from_ranges`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = [
    "DocumentSegment",
    "SegmentLookup",
    "TokenRun",
    "lookup_from_ranges",
]


@dataclass(frozen=True)
class DocumentSegment:
    """One separator-delimited piece of a prompt: tokens ``[start, end)``."""

    index: int  # order of the segment in the prompt (empty pieces are dropped)
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(
                f"DocumentSegment(start={self.start}, end={self.end}): "
                "need 0 <= start < end (empty segments hold no KV)"
            )

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TokenRun:
    """A maximal run of prompt tokens that are all cached or all uncached."""

    start: int
    end: int
    cached: bool

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SegmentLookup:
    """Which segments of a prompt the cache holds, over the whole prompt."""

    num_tokens: int
    segments: tuple[DocumentSegment, ...]
    hit: tuple[bool, ...]  # hit[i] is for segments[i]

    def __post_init__(self) -> None:
        if len(self.hit) != len(self.segments):
            raise ValueError(
                f"SegmentLookup: {len(self.hit)} hit flags for "
                f"{len(self.segments)} segments; need one per segment"
            )
        previous_end = 0
        for segment in self.segments:
            if segment.start < previous_end or segment.end > self.num_tokens:
                raise ValueError(
                    f"SegmentLookup: segment {segment} overlaps another or lies "
                    f"outside the prompt of {self.num_tokens} tokens"
                )
            previous_end = segment.end

    @property
    def hit_segments(self) -> tuple[DocumentSegment, ...]:
        return tuple(s for s, h in zip(self.segments, self.hit) if h)

    def cached_token_mask(self) -> list[bool]:
        """True for every token whose KV comes from the cache."""
        mask = [False] * self.num_tokens
        for segment in self.hit_segments:
            mask[segment.start : segment.end] = [True] * segment.length
        return mask

    @property
    def num_cached_tokens(self) -> int:
        return sum(s.length for s in self.hit_segments)

    @property
    def prefix_hit_tokens(self) -> int:
        """What LMCache's own lookup reports: the end of the leading hit run.

        Zero when the first segment misses (or there are no segments).
        """
        end = 0
        for segment, hit in zip(self.segments, self.hit):
            if not hit:
                break
            end = segment.end
        return end

    @property
    def hole_mode_hit_tokens(self) -> int:
        """The end of the LAST hit segment: how far cached KV reaches.

        Every token up to here is either loaded from the cache or recomputed
        as a hole; tokens after it are ordinary prefill.
        """
        ends = [s.end for s in self.hit_segments]
        return max(ends) if ends else 0

    @property
    def loadable_hit_tokens(self) -> int:
        """How many leading tokens hole mode can hand to a layerwise retrieval.

        `hole_mode_hit_tokens` when the first segment hits, else 0: LMCache's
        layerwise buffer starts at the first retrieved token, so KV recomputed
        for a hole BEFORE it would have nowhere to go; such a prompt is
        prefilled from scratch instead (as standard CacheBlend does).
        """
        if not self.segments or not self.hit[0]:
            return 0
        return self.hole_mode_hit_tokens

    def runs(self) -> list[TokenRun]:
        """Cached / uncached runs covering ``[0, num_tokens)`` in order."""
        mask = self.cached_token_mask()
        runs: list[TokenRun] = []
        run_start = 0
        for position in range(1, self.num_tokens + 1):
            if position == self.num_tokens or mask[position] != mask[run_start]:
                runs.append(TokenRun(run_start, position, mask[run_start]))
                run_start = position
        return runs

    def cached_stretches(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each run of consecutive HIT segments (the
        separators between them included); misses split stretches.  Each
        stretch is what standard CacheBlend would blend if it started there,
        and gets its own top-k budget in hole mode."""
        stretches: list[tuple[int, int]] = []
        previous_hit = False
        for segment, hit in zip(self.segments, self.hit):
            if hit and previous_hit:
                stretches[-1] = (stretches[-1][0], segment.end)
            elif hit:
                stretches.append((segment.start, segment.end))
            previous_hit = hit
        return stretches

    def truncated_to_prefix(self) -> "SegmentLookup":
        """The lookup LMCache's standard CacheBlend acts on: misses from the
        first miss on (every later segment is prefilled from scratch)."""
        flags: list[bool] = []
        still_hitting = True
        for hit in self.hit:
            still_hitting = still_hitting and hit
            flags.append(still_hitting)
        return SegmentLookup(self.num_tokens, self.segments, tuple(flags))


def lookup_from_ranges(num_tokens: int, ranges: Iterable[tuple[int, int, bool]]) -> SegmentLookup:
    """A lookup from ``(start, end, hit)`` per segment, as an upstream token
    database yields them (empty ranges are dropped; validated)."""
    segments: list[DocumentSegment] = []
    hits: list[bool] = []
    for start, end, hit in ranges:
        if end > start:
            segments.append(DocumentSegment(index=len(segments), start=int(start), end=int(end)))
            hits.append(bool(hit))
    return SegmentLookup(int(num_tokens), tuple(segments), tuple(hits))
