"""What a request meets where a KV-cache group of its cached prefix was not restored.

`install(worker, groups, value)` runs in each vLLM worker (through
``LLM.collective_rpc``) before the first prompt. It wraps the model runner's
``execute_model``: when a request is first scheduled with a cached prefix
(vLLM's ``num_computed_tokens`` > 0), every non-null block of each named
KV-cache group that lies wholly below that prefix is filled with `value`
(a float; integer caches get its bytes' pattern 0x55) before the step runs.
That is what the request would compute from if a connector had loaded the
prefix but skipped those groups: bytes of no computation of this prompt. If the
outputs stay those of a cold prefill, the step never read those blocks, and a
connector may skip the group when a prefix ends where this one ended; if they
change, the group must be stored and loaded.

`report` hands back (group, cached tokens, blocks filled) per request.

`poison(worker, value)` fills every block of every KV cache with `value` at once, for a
connector that loads a prefix before the request's first step (LMCache's MP connector
loads while the request waits for its KV): called between rounds, with nothing in
flight and vLLM's own prefix cache emptied, every block a warm request then reads
holds either what this step computes or what the connector loaded.
"""

from __future__ import annotations

__all__ = ["install", "poison", "report"]


def install(worker, groups: list[int], value: float) -> bool:
    runner = worker.model_runner
    context = runner.vllm_config.compilation_config.static_forward_context
    targets = {
        index: (group.kv_cache_spec.block_size, list(group.layer_names))
        for index, group in enumerate(runner.kv_cache_config.kv_cache_groups)
        if index in groups
    }
    filled: list[list[int]] = []
    original = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        for request in scheduler_output.scheduled_new_reqs:
            cached = request.num_computed_tokens
            if cached <= 0:
                continue
            for index, (block_size, names) in targets.items():
                count = 0
                for position, block_id in enumerate(request.block_ids[index]):
                    if block_id == 0 or (position + 1) * block_size > cached:
                        continue  # vLLM's null block, or a block the step computes into
                    for name in names:
                        cache = _cache(context, name)
                        cache[block_id].fill_(value if cache.dtype.is_floating_point else 0x55)
                    count += 1
                filled.append([index, cached, count])
        return original(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
    runner._skipped_groups = filled
    return True


def report(worker) -> list[list[int]]:
    return list(getattr(worker.model_runner, "_skipped_groups", None) or [])


def poison(worker, value: float) -> int:
    """Every KV cache of the worker filled with `value` (integer caches with 0x55); the caches filled."""
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    filled = 0
    for group in worker.model_runner.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            cache = _cache(context, name)
            cache.fill_(value if cache.dtype.is_floating_point else 0x55)
            filled += 1
    return filled


def _cache(context, name: str):
    """Layer `name`'s KV cache in vLLM's forward context (a one-element list on some versions)."""
    cache = context[name].kv_cache
    return cache[0] if isinstance(cache, (list, tuple)) else cache
