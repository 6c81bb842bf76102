"""Split a prompt into separator-delimited documents and look every one up.

The reference side of `lmcache_ascend.blend.segments`: the engine patch gets
its segments from LMCache's own token database (`lookup_from_ranges`); the
tests and ``scripts/bench_hole_blend.py`` build prompts themselves, cut them
here with LMCache's rule (checked against the real ``SegmentTokenDatabase``
in the tests) and look each piece up in a store of their own.
"""

from __future__ import annotations

from typing import Callable, Sequence

from lmcache_ascend.blend.segments import DocumentSegment, SegmentLookup

__all__ = ["lookup_segments", "split_by_separator"]


def _as_int_list(name: str, values: Sequence[int]) -> list[int]:
    if hasattr(values, "tolist"):  # torch / numpy without importing them
        values = values.tolist()
    out = list(values)
    for position, value in enumerate(out):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(
                f"{name}[{position}]={value!r} is not a token id; "
                "allowed: a sequence of ints"
            )
    return out


def split_by_separator(
    tokens: Sequence[int], separator: Sequence[int]
) -> list[DocumentSegment]:
    """Cut ``tokens`` at every non-overlapping occurrence of ``separator``.

    Matches LMCache's ``SegmentTokenDatabase``: matches are taken left to
    right, separator tokens belong to no segment.  Unlike it, empty pieces
    (a separator at the very start or end, or two in a row) are dropped, as
    they have nothing to cache, and an empty separator gives one segment
    instead of failing.
    """
    token_list = _as_int_list("tokens", tokens)
    separator_list = _as_int_list("separator", separator)
    width = len(separator_list)
    pieces: list[tuple[int, int]] = []
    piece_start = 0
    cursor = 0
    if width:
        while cursor + width <= len(token_list):
            if token_list[cursor : cursor + width] == separator_list:
                pieces.append((piece_start, cursor))
                cursor += width
                piece_start = cursor
            else:
                cursor += 1
    pieces.append((piece_start, len(token_list)))
    segments: list[DocumentSegment] = []
    for start, end in pieces:
        if end > start:
            segments.append(DocumentSegment(index=len(segments), start=start, end=end))
    return segments


def lookup_segments(
    tokens: Sequence[int],
    separator: Sequence[int],
    contains: Callable[[Sequence[int], DocumentSegment], bool],
) -> SegmentLookup:
    """Split ``tokens`` into documents and ask ``contains`` about EVERY one.

    ``contains(segment_tokens, segment)`` says whether the cache holds the
    KV of that document; it is called once per segment, in order, and the
    walk does not stop at a miss.
    """
    token_list = _as_int_list("tokens", tokens)
    segments = split_by_separator(token_list, separator)
    hits = tuple(
        bool(contains(token_list[s.start : s.end], s)) for s in segments
    )
    return SegmentLookup(len(token_list), tuple(segments), hits)
