"""Sparse prefix-cache checkpoints for sliding-window KV-cache groups.

A sliding-window group can serve a prefix hit of length ``L`` only if the
blocks covering the last ``window - 1`` tokens before ``L`` are all cached.
Caching every block of every request therefore keeps many blocks that can
never serve a hit (their window partner was not cached, or ``L`` is not a
hit length the coordinator accepts). vLLM 0.23 caches only the blocks that
end a reachable run ("checkpoints"); ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``
thins them further. This module reproduces those semantics so a patched
vLLM 0.18 keeps exactly the same blocks as vLLM 0.23:

- interval ``None`` (flag ``auto``, the default): a checkpoint at every
  ``alignment_tokens`` boundary (the scheduler block size);
- a positive interval (a multiple of the scheduler block size): a checkpoint
  once per interval, plus the prompt's own replay boundary;
- interval ``0`` (upstream's "latest boundary only"): only the replay boundary.

The replay boundary is the largest aligned length below the prompt length:
the scheduler never hits the whole prompt (the last token is recomputed for
its logits), so an exact replay lands there.
"""

from __future__ import annotations

from dataclasses import dataclass

FLAG_NAME = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


class RetentionIntervalError(ValueError):
    """The retention interval does not fit the model's KV-cache groups."""


def retention_interval_from_flag(flag_value: object) -> int | None:
    """The interval vLLM's managers take, from the flag's value (already checked by the flag:
    ``"auto"`` or a non-negative integer).  ``"auto"`` means what upstream does when the
    variable is unset: dense checkpoints at every aligned boundary, i.e. ``None``."""
    return None if flag_value == "auto" or flag_value is None else flag_value


def validate_retention_interval(
    retention_interval: int | None,
    scheduler_block_size: int,
    has_sliding_window_group: bool,
) -> None:
    """Raise if an explicit interval (non-negative: the flag's rule) cannot act on this model
    (upstream's rules)."""
    if retention_interval is None:
        return
    if not has_sliding_window_group:
        raise RetentionIntervalError(
            f"{FLAG_NAME}={retention_interval} is set but the model has no "
            "sliding-window KV-cache group, so retention would have no effect; "
            "allowed: 'auto' (or unset) for such models"
        )
    if retention_interval % scheduler_block_size != 0:
        raise RetentionIntervalError(
            f"{FLAG_NAME}={retention_interval} is not allowed: it must be a "
            f"non-negative multiple of the scheduler block size ({scheduler_block_size}), "
            f"e.g. {_next_multiple(retention_interval, scheduler_block_size)}"
        )


def _next_multiple(value: int, step: int) -> int:
    return max(1, -(-abs(value) // step)) * step


def blocks_needed_for_window_hit(sliding_window: int, block_size: int, use_eagle: bool) -> int:
    """Consecutive cached blocks a sliding-window hit needs at its right edge.

    The token at position ``L`` attends to the ``sliding_window - 1`` tokens
    before it; EAGLE drops the last matched block, so it needs one more.
    """
    if sliding_window < 1 or block_size < 1:
        raise ValueError(
            f"sliding_window={sliding_window} and block_size={block_size} must both be >= 1"
        )
    needed = -(-(sliding_window - 1) // block_size)
    return needed + (1 if use_eagle else 0)


@dataclass(frozen=True)
class SlidingWindowCheckpoints:
    """Which blocks of one sliding-window group are worth caching.

    ``alignment_tokens``: hit lengths the coordinator accepts are multiples of
    it (the scheduler block size); it is a multiple of ``block_size``.
    """

    block_size: int
    sliding_window: int
    alignment_tokens: int
    use_eagle: bool = False
    retention_interval: int | None = None

    def __post_init__(self) -> None:
        if self.alignment_tokens % self.block_size != 0:
            raise ValueError(
                f"alignment_tokens={self.alignment_tokens} must be a multiple of "
                f"block_size={self.block_size}"
            )
        if self.retention_interval is not None and self.retention_interval < 0:
            raise RetentionIntervalError(
                f"{FLAG_NAME}={self.retention_interval} is not allowed; allowed: a non-negative multiple "
                f"of {self.alignment_tokens}"
            )

    @property
    def blocks_per_hit(self) -> int:
        return blocks_needed_for_window_hit(self.sliding_window, self.block_size, self.use_eagle)

    @property
    def edge_shift(self) -> int:
        """EAGLE looks one block past the boundary, so the run ends one block later."""
        return 1 if self.use_eagle else 0

    def _segment_tokens(self) -> int | None:
        if self.retention_interval is None:
            return self.alignment_tokens
        if self.retention_interval == 0:
            return None
        return self.retention_interval

    def block_mask(
        self, start_block: int, end_block: int, num_prompt_tokens: int | None
    ) -> list[bool] | None:
        """True for each block in ``[start_block, end_block)`` to cache; None = all."""
        if end_block <= start_block:
            return []
        needed = self.blocks_per_hit
        shift = self.edge_shift
        keep = [False] * (end_block - start_block)
        segment_tokens = self._segment_tokens()
        if segment_tokens is not None:
            blocks_per_segment = segment_tokens // self.block_size
            if needed >= blocks_per_segment:
                # Every block sits in some hit's window: nothing to thin out.
                return None
            first_kept_offset = blocks_per_segment - needed
            for index in range(max(start_block, shift), end_block):
                if (index - shift) % blocks_per_segment >= first_kept_offset:
                    keep[index - start_block] = True
        if self.retention_interval is not None and num_prompt_tokens is not None:
            replay_tokens = (num_prompt_tokens - 1) // self.alignment_tokens * self.alignment_tokens
            run_end = replay_tokens // self.block_size + shift
            for index in range(max(start_block, run_end - needed), min(end_block, run_end)):
                keep[index - start_block] = True
        return keep

    def checkpoint_positions(self, num_tokens: int, num_prompt_tokens: int | None) -> list[int]:
        """Hit lengths (tokens, > 0) whose whole window is kept, for a request of `num_tokens`.

        Used by tests and the benchmark to state retention in token terms.
        """
        num_blocks = num_tokens // self.block_size
        mask = self.block_mask(0, num_blocks, num_prompt_tokens)
        kept = [True] * num_blocks if mask is None else mask
        needed = self.blocks_per_hit
        shift = self.edge_shift
        positions = []
        for length in range(self.alignment_tokens, num_tokens + 1, self.alignment_tokens):
            run_end = length // self.block_size + shift
            run_start = run_end - needed
            if run_end > num_blocks or run_start < 0:
                continue
            if all(kept[run_start:run_end]):
                positions.append(length)
        return positions


def cache_sliding_window_blocks(manager, request, num_tokens: int, retention_interval: int | None) -> None:
    """vLLM 0.23's sliding-window ``cache_blocks`` on a vLLM 0.18 manager (duck-typed):
    cache only the full blocks that can serve a hit at an aligned length."""
    request_id = request.request_id
    num_cached_blocks = manager.num_cached_block.get(request_id, 0)
    num_full_blocks = num_tokens // manager.block_size
    if num_cached_blocks >= num_full_blocks:
        return
    checkpoints = SlidingWindowCheckpoints(
        block_size=manager.block_size,
        sliding_window=manager.sliding_window,
        alignment_tokens=getattr(manager, "scheduler_block_size", manager.block_size),
        use_eagle=getattr(manager, "use_eagle", False),
        retention_interval=retention_interval,
    )
    mask = checkpoints.block_mask(num_cached_blocks, num_full_blocks, request.num_prompt_tokens)
    blocks = manager.req_to_blocks[request_id]
    if mask is not None:
        # BlockPool.cache_full_blocks skips null blocks: hand it a view in
        # which the blocks that can never serve a hit are null, so they stay
        # uncached scratch (and are reused first when freed).
        blocks = list(blocks[:num_full_blocks])
        for offset, keep in enumerate(mask):
            if not keep:
                blocks[num_cached_blocks + offset] = manager._null_block
    manager.block_pool.cache_full_blocks(
        request=request,
        blocks=blocks,
        num_cached_blocks=num_cached_blocks,
        num_full_blocks=num_full_blocks,
        block_size=manager.block_size,
        kv_cache_group_id=manager.kv_cache_group_id,
    )
    manager.num_cached_block[request_id] = num_full_blocks
