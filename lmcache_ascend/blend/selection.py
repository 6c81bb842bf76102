"""Which tokens CacheBlend recomputes from the check layer on.

At a check layer CacheBlend has, for every prompt token, the K it just
computed in the new context and (for cached tokens) the K loaded from the
cache.  The tokens whose K deviates most are the ones whose cached KV is most
wrong for the new context, so only those are recomputed in later layers.

Hole mode adds two rules.  A token with no cached KV at all (a hole: a
missing document, a separator, the trailing question) is always recomputed.
The top-k budget, ``recompute_ratio * number of cached tokens``, is spent on
cached tokens only and per *budget range*: each stretch of cached documents
between two missing ones gets its own share, chosen as if standard CacheBlend
ran on that stretch alone.  So the leading stretch (all that standard
CacheBlend reuses) gets exactly the tokens standard CacheBlend would pick, and
later stretches, whose KV lost more context, cannot starve it of budget.

Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["RecomputeSelection", "key_deviation", "select_recompute_tokens", "topk_budget"]


@dataclass(frozen=True)
class RecomputeSelection:
    """Sorted token indices to recompute, and how they were chosen."""

    indices: torch.Tensor  # int64, ascending, unique
    num_hole_tokens: int
    num_topk_tokens: int

    @property
    def num_selected(self) -> int:
        return int(self.indices.numel())


def key_deviation(fresh_keys: torch.Tensor, cached_keys: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance per token (summed over heads and features), float32."""
    if fresh_keys.shape != cached_keys.shape:
        raise ValueError(
            f"fresh_keys shape {tuple(fresh_keys.shape)} != cached_keys shape "
            f"{tuple(cached_keys.shape)}; need the same [num_tokens, ...] layout"
        )
    difference = fresh_keys.to(torch.float32) - cached_keys.to(torch.float32)
    # flatten(1) rather than reshape(n, -1): an empty prompt has no -1 to infer.
    return difference.pow(2).flatten(1).sum(dim=1) if difference.dim() > 1 else difference.pow(2)


def topk_budget(num_cached_tokens: int, recompute_ratio: float) -> int:
    """``int(ratio * cached)``, at least one token when both are positive
    (as LMCache's blender does), and zero when nothing is cached."""
    if num_cached_tokens <= 0 or recompute_ratio <= 0:
        return 0
    return max(1, int(num_cached_tokens * recompute_ratio))


def select_recompute_tokens(
    fresh_keys: torch.Tensor,
    cached_keys: torch.Tensor,
    cached_token_mask: torch.Tensor,
    recompute_ratio: float,
    budget_ranges: Sequence[tuple[int, int]] | None = None,
) -> RecomputeSelection:
    """Hole tokens plus, per budget range, the top-k cached tokens by K deviation.

    ``fresh_keys`` / ``cached_keys``: ``[num_tokens, ...]``; rows of
    ``cached_keys`` at hole tokens are ignored (they may hold anything).
    ``cached_token_mask``: bool ``[num_tokens]``, True where KV was loaded.
    ``budget_ranges``: disjoint ``(start, end)`` token ranges, each with its
    own budget ``ratio * cached tokens in it``; every cached token must lie in
    one.  None: one range over the whole prompt.
    """
    if not 0.0 <= recompute_ratio <= 1.0:
        raise ValueError(f"recompute_ratio={recompute_ratio}; allowed: 0.0 to 1.0")
    num_tokens = fresh_keys.shape[0]
    if cached_token_mask.dtype != torch.bool or tuple(cached_token_mask.shape) != (num_tokens,):
        raise ValueError(
            f"cached_token_mask dtype {cached_token_mask.dtype} shape "
            f"{tuple(cached_token_mask.shape)}; need bool of shape ({num_tokens},)"
        )
    deviation = key_deviation(fresh_keys, cached_keys)
    mask = cached_token_mask.to(deviation.device)
    ranges = [(0, num_tokens)] if budget_ranges is None else _checked_ranges(budget_ranges, mask)
    hole_indices = torch.nonzero(~mask, as_tuple=False).flatten()
    chosen = [hole_indices]
    total_budget = 0
    for start, end in ranges:
        cached_indices = torch.nonzero(mask[start:end], as_tuple=False).flatten() + start
        budget = topk_budget(int(cached_indices.numel()), recompute_ratio)
        if budget:
            top = torch.topk(deviation[cached_indices], k=budget).indices
            chosen.append(cached_indices[top])
            total_budget += budget
    indices, _ = torch.sort(torch.cat(chosen))
    return RecomputeSelection(
        indices=indices.to(torch.int64),
        num_hole_tokens=int(hole_indices.numel()),
        num_topk_tokens=total_budget,
    )


def _checked_ranges(
    budget_ranges: Sequence[tuple[int, int]], cached_token_mask: torch.Tensor
) -> list[tuple[int, int]]:
    num_tokens = int(cached_token_mask.shape[0])
    covered = torch.zeros(num_tokens, dtype=torch.bool)
    ranges = []
    for start, end in budget_ranges:
        if not 0 <= start < end <= num_tokens or bool(covered[start:end].any()):
            raise ValueError(
                f"budget range ({start}, {end}) is empty, outside [0, {num_tokens}) "
                "or overlaps another; allowed: disjoint non-empty ranges"
            )
        covered[start:end] = True
        ranges.append((int(start), int(end)))
    uncovered = cached_token_mask.cpu() & ~covered
    if bool(uncovered.any()):
        first = int(torch.nonzero(uncovered)[0])
        raise ValueError(
            f"cached token {first} lies in no budget range {list(budget_ranges)}; "
            "every cached token needs one (its KV would never be checked)"
        )
    return ranges
