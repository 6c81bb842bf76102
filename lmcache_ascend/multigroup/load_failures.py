"""Which requests a failed KV load touched, when requests hold blocks of several KV-cache groups.

A connector reports a failed load as a flat set of block ids. With one KV-cache group vLLM
maps them to the request and the first token to recompute; with several it cannot tell
which group an id came from (LMCache's in-process connector reports its group 0's, another
connector may report any group's) and refuses. Read as an id of ANY group, the set names a
superset of the requests whose KV is bad: a request holding one of the ids in any group is
taken as failed. A request taken in wrongly is only computed again; a failed one is never
missed.

Nor can the ids say where in the other groups the bad KV starts, so every block of a failed
request may hold bad KV: all of them leave vLLM's prefix cache (`blocks_of`). That costs
vLLM's own hits on the failed request's prefix, once, for a failure.

The null block (vLLM's placeholder for a sliding window's skipped blocks, shared by every
request) is never a failure: reading it as one would fail every windowed request.

Pure: no vLLM import; the scheduler patch (``vllm-multigroup-load-failures``) hands in
plain block-id lists.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

__all__ = ["blocks_of", "failed_requests"]


def failed_requests(
    invalid_block_ids: Iterable[int],
    block_ids_by_request: Mapping[str, Sequence[Sequence[int]]],
    null_block_id: int = 0,
) -> list[str]:
    """The requests holding an invalid block in any group, in the mapping's order
    (`block_ids_by_request`: per request, one block-id list per KV-cache group)."""
    invalid = set(invalid_block_ids)
    invalid.discard(null_block_id)
    if not invalid:
        return []
    return [request_id for request_id, group_block_ids in block_ids_by_request.items()
            if any(not invalid.isdisjoint(block_ids) for block_ids in group_block_ids)]


def blocks_of(group_block_ids: Sequence[Sequence[int]], null_block_id: int = 0) -> set[int]:
    """Every block of a failed request but the null block: vLLM must drop them from its prefix
    cache before they are freed, or another request (or the retry) hits bad KV."""
    blocks = {block_id for block_ids in group_block_ids for block_id in block_ids}
    blocks.discard(null_block_id)
    return blocks
