"""Build and drive vLLM's REAL KV-cache manager on either stack (tests and benchmark).

Only version differences in constructor signatures are bridged here; every
block decision is vLLM's (patched or not). No model: requests carry token ids
and block hashes, and "running" a step means allocating slots.
"""

from __future__ import annotations

import inspect
import math
import os
import random
from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request


@dataclass(frozen=True)
class HybridModel:
    """A DeepSeek-V4-like hybrid: MLA (full) group, sliding-window group, compressed group.

    The compressed group is modelled in prefix-cache terms: one of its blocks
    covers ``compressed_block_tokens`` prompt tokens (storage block size x
    compress ratio on vllm-ascend).
    """

    mla_block_size: int = 128
    sliding_window_block_size: int = 128
    sliding_window: int = 128
    compressed_block_tokens: int = 256
    num_blocks: int = 1024

    @property
    def group_block_sizes(self) -> list[int]:
        return [self.mla_block_size, self.sliding_window_block_size, self.compressed_block_tokens]

    @property
    def scheduler_block_size(self) -> int:
        return math.lcm(*self.group_block_sizes)

    @property
    def hash_block_size(self) -> int:
        return math.gcd(*self.group_block_sizes)


def hybrid_config(hybrid: HybridModel) -> KVCacheConfig:
    mla = MLAAttentionSpec(block_size=hybrid.mla_block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
    swa = SlidingWindowSpec(
        block_size=hybrid.sliding_window_block_size,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.float16,
        sliding_window=hybrid.sliding_window,
    )
    compressed = FullAttentionSpec(
        block_size=hybrid.compressed_block_tokens, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    return KVCacheConfig(
        num_blocks=hybrid.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["mla.0"], mla),
            KVCacheGroupSpec(["swa.0"], swa),
            KVCacheGroupSpec(["compressed.0"], compressed),
        ],
    )


def sliding_window_config(block_size: int, sliding_window: int, num_blocks: int) -> KVCacheConfig:
    swa = SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=sliding_window
    )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["swa.0"], swa)])


RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


def make_manager(
    config: KVCacheConfig,
    scheduler_block_size: int,
    hash_block_size: int,
    max_model_len: int = 32768,
    retention_interval: int | None = None,
):
    """A real KVCacheManager, given the arguments each stack's Scheduler would pass.

    `retention_interval` goes where the stack takes it: vLLM 0.33 reads
    ``KVCacheConfig.prefix_cache_retention_interval``; vLLM 0.23 and the
    stack-A backport read the environment while the manager is built.
    """
    if retention_interval is not None and "prefix_cache_retention_interval" in getattr(
        KVCacheConfig, "__dataclass_fields__", {}
    ):
        config.prefix_cache_retention_interval = retention_interval
        retention_interval = None
    previous = os.environ.get(RETENTION_ENV)
    if retention_interval is not None:
        os.environ[RETENTION_ENV] = str(retention_interval)
    try:
        return _make_manager(config, scheduler_block_size, hash_block_size, max_model_len)
    finally:
        if retention_interval is not None:
            if previous is None:
                os.environ.pop(RETENTION_ENV, None)
            else:
                os.environ[RETENTION_ENV] = previous


def _make_manager(config: KVCacheConfig, scheduler_block_size: int, hash_block_size: int, max_model_len: int):
    parameters = inspect.signature(KVCacheManager.__init__).parameters
    kwargs: dict[str, object] = dict(
        kv_cache_config=config, max_model_len=max_model_len, hash_block_size=hash_block_size, enable_caching=True
    )
    if "max_num_batched_tokens" in parameters:
        kwargs["max_num_batched_tokens"] = 8192
    if "scheduler_block_size" in parameters:  # vLLM >= 0.23, or 0.18 patched
        kwargs["scheduler_block_size"] = scheduler_block_size
    return KVCacheManager(**kwargs)


def computed_blocks(manager: KVCacheManager, request: Request) -> tuple[object, int]:
    """(cached blocks, cached tokens) of `request`: vLLM 0.33 returns a third value."""
    result = manager.get_computed_blocks(request)
    return result[0], result[1]


# The vLLM core backports the KV-cache manager depends on, in the order they build
# on each other; the Scheduler's LCM block size comes on top where a Scheduler runs.
CORE_BACKPORT_PATCHES = (
    "vllm-free-queue-prepend",
    "vllm-block-pool-free-prepend",
    "vllm-sliding-window-retention",
    "vllm-coordinator-scheduler-block-size",
    "vllm-kv-cache-manager-scheduler-block-size",
)
SCHEDULER_BACKPORT_PATCH = "vllm-scheduler-lcm-block-size"

_HASHER_READY = False


def make_request(request_id: str, token_ids: list[int], hash_block_size: int, max_tokens: int = 4) -> Request:
    global _HASHER_READY
    if not _HASHER_READY:
        init_none_hash(sha256)
        _HASHER_READY = True
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )


def free_queue_ids(manager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


@dataclass
class ReplayStats:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    blocks_allocated: int = 0
    preemptions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class ReplayWorkload:
    """8K prompts, `concurrency` in flight, `repeat_rate` of them replay an earlier prompt."""

    num_requests: int = 256
    prompt_tokens: int = 8192
    prompt_jitter: int = 255  # unaligned tails: lengths in [prompt_tokens, prompt_tokens + jitter]
    concurrency: int = 32
    repeat_rate: float = 0.9
    distinct_prompts: int = 48
    output_tokens: int = 16
    token_budget: int = 8192  # tokens scheduled per step (chunked prefill)
    seed: int = 0


def run_replay(manager, workload: ReplayWorkload, hash_block_size: int) -> ReplayStats:
    """Drive `manager` like a FCFS scheduler with chunked prefill; count prefix hits."""
    rng = random.Random(workload.seed)
    pool_of_prompts: list[list[int]] = []
    pending: list[list[int]] = []
    for _ in range(workload.num_requests):
        if pool_of_prompts and rng.random() < workload.repeat_rate:
            pending.append(rng.choice(pool_of_prompts))
        else:
            length = workload.prompt_tokens + rng.randint(0, workload.prompt_jitter)
            prompt = [rng.randrange(1, 30000) for _ in range(length)]
            if len(pool_of_prompts) < workload.distinct_prompts:
                pool_of_prompts.append(prompt)
            else:
                pool_of_prompts[rng.randrange(len(pool_of_prompts))] = prompt
            pending.append(prompt)
    pending.reverse()

    stats = ReplayStats()
    running: list[dict] = []
    counter = 0
    while pending or running:
        manager.new_step_starts()
        # Admit new requests up to the concurrency.
        while pending and len(running) < workload.concurrency:
            prompt = pending.pop()
            request = make_request(f"r{counter}", prompt, hash_block_size, workload.output_tokens)
            counter += 1
            running.append({"request": request, "prompt": prompt, "admitted": False, "generated": 0})
        budget = workload.token_budget
        progressed = False
        still_running = []
        for state in running:
            request: Request = state["request"]
            if not state["admitted"]:
                hit_blocks, num_hit = computed_blocks(manager, request)
                num_new = min(request.num_tokens - num_hit, budget)
                if num_new <= 0:
                    still_running.append(state)
                    continue
                new_blocks = manager.allocate_slots(
                    request, num_new, num_new_computed_tokens=num_hit, new_computed_blocks=hit_blocks
                )
                if new_blocks is None:  # no room this step: try again next step
                    still_running.append(state)
                    continue
                state["admitted"] = True
                stats.requests += 1
                stats.prompt_tokens += request.num_prompt_tokens
                stats.hit_tokens += num_hit
                state["hit"] = num_hit
                num_computed = num_hit + num_new
            elif state["generated"] >= workload.output_tokens:
                manager.free(request)
                progressed = True
                continue
            else:
                # Prefill chunks, then one token per step (the last sampled one).
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if num_new <= 0:
                    still_running.append(state)
                    continue
                manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
                new_blocks = manager.allocate_slots(request, num_new)
                if new_blocks is None:
                    still_running.append(state)
                    continue
                num_computed = request.num_computed_tokens + num_new
            progressed = True
            budget -= num_new
            stats.blocks_allocated += sum(len(group) for group in new_blocks.blocks)
            request.num_computed_tokens = num_computed
            if num_computed == request.num_tokens:
                # The model ran over every token: sample the next one.
                request.append_output_token_ids(rng.randrange(1, 30000))
                if num_computed > request.num_prompt_tokens:
                    state["generated"] += 1
            still_running.append(state)
        if not progressed and still_running:
            # Out of blocks with nobody able to move: preempt the newest request.
            victim = still_running.pop()
            manager.free(victim["request"])
            stats.preemptions += 1
            if victim["admitted"]:
                stats.requests -= 1
                stats.prompt_tokens -= victim["request"].num_prompt_tokens
                stats.hit_tokens -= victim["hit"]
            pending.append(victim["prompt"])
        running = still_running
    return stats
