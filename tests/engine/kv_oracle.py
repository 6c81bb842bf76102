"""The byte oracle: every KV block LMCache filled holds bytes vLLM itself computed for the same tokens.

`install` runs in each vLLM worker (through ``LLM.collective_rpc``) before the
first prompt. It wraps the model runner's ``execute_model``: after the step in
which a request's prompt is complete in the paged cache (loaded, computed, or
both), it digests each whole block of that prompt in every attention layer,
reading vLLM's own structures only: the request's block ids per KV-cache group
(``model_runner.requests``; vLLM's second model runner, the GPU default for dense
models since 0.2x, keeps them on the device, so there they are followed from the
scheduler's own messages to the runner, as that runner does: a new request's ids,
then each step's additions) and the layer's cache tensor, indexed by block id on
axis 0 (vLLM 0.32 describes every per-layer KV cache as ``[blocks, ...]`` in
logical order, `vllm.v1.kv_cache_layout`). Null blocks (id 0: outside a sliding
window) are recorded as None. `report` hands the records back.

`assert_loaded_blocks_were_computed` then checks, for each prompt LMCache
supplied N tokens to, that each non-null block below N holds the bytes of a
block vLLM computed for the same token prefix in a step where it computed that
block itself. Nothing of lmcache-ascend is used to find or read the blocks.
"""

from __future__ import annotations

import hashlib

__all__ = ["assert_loaded_blocks_were_computed", "install", "loaded_blocks_checked", "record", "report"]


def _sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()[:20]


def _prompt_key(tokens) -> str:
    return _sha(repr(list(tokens)).encode())


class _Followed:
    """A request as the scheduler described it to the runner: prompt, block ids per group, and the
    tokens computed before the step being run."""

    def __init__(self, new) -> None:
        self.prompt_token_ids = list(new.prompt_token_ids)
        self.block_ids = tuple(list(ids) for ids in new.block_ids)
        self.num_computed_tokens = new.num_computed_tokens


def _follow(requests: dict, scheduler_output) -> None:
    for request_id in set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ()):
        requests.pop(request_id, None)  # a preempted request comes back as a new one
    for new in scheduler_output.scheduled_new_reqs:
        requests[new.req_id] = _Followed(new)
    cached = scheduler_output.scheduled_cached_reqs
    for request_id, computed, added in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids):
        request = requests.get(request_id)
        if request is None:
            continue
        request.num_computed_tokens = computed
        for ids, more in zip(request.block_ids, added or ()):
            ids.extend(more)


def install(worker) -> bool:
    runner = worker.model_runner
    if getattr(runner, "_kv_oracle", None) is not None:
        return False
    import torch

    records: list[dict] = []
    done: set[str] = set()
    context = runner.vllm_config.compilation_config.static_forward_context
    layers = {}  # attention layer -> (group index, block size)
    for index, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        # A bundle (UniformTypeKVCacheSpecs, DeepSeek-V4) holds one spec per layer: each layer's own
        # kind decides; every one of its layers pages the group's blocks (rows of block_size tokens).
        inner = getattr(spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            kind = type(inner.get(name, spec)).__name__
            if "Attention" not in kind and not (inner and "Mamba" not in kind):
                continue  # state-space groups hold a state per request, not blocks of tokens
            layers[name] = (index, spec.block_size)

    def cache_of(name: str) -> torch.Tensor:
        cache = context[name].kv_cache
        return cache[0] if isinstance(cache, (list, tuple)) else cache

    def snapshot(request) -> dict:
        prompt = list(request.prompt_token_ids)
        blocks = {}
        for name, (group, block_size) in layers.items():
            cache = cache_of(name)
            digests = []
            for block in range(len(prompt) // block_size):
                block_id = request.block_ids[group][block]
                if block_id == 0:
                    digests.append(None)
                    continue
                row = cache[block_id].contiguous().cpu()  # a GPU engine's cache too
                digests.append(_sha(row.view(torch.uint8).numpy().tobytes()))
            blocks[name] = {"block_size": block_size, "digests": digests}
        return {"prompt": _prompt_key(prompt), "blocks": blocks}

    original = runner.execute_model
    followed: dict | None = None if hasattr(runner, "requests") else {}

    def execute_model(scheduler_output, *args, **kwargs):
        if followed is not None:
            _follow(followed, scheduler_output)
        result = original(scheduler_output, *args, **kwargs)
        if not runner._kv_oracle_on:
            return result
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        for request_id, count in scheduled.items():
            request = (runner.requests if followed is None else followed).get(request_id)
            if request_id in done or request is None or request.prompt_token_ids is None:
                continue
            if request.num_computed_tokens + count >= len(request.prompt_token_ids):
                done.add(request_id)
                records.append(snapshot(request))
        return result

    runner.execute_model = execute_model
    runner._kv_oracle = records
    runner._kv_oracle_on = True
    return True


def record(worker, on: bool) -> None:
    """Start or stop taking snapshots (a benchmark times requests with the oracle stopped)."""
    worker.model_runner._kv_oracle_on = on


def report(worker) -> list[dict]:
    return list(getattr(worker.model_runner, "_kv_oracle", None) or [])


def assert_loaded_blocks_were_computed(records: list[dict], prompts: list[list[int]], supplied: list[int]) -> int:
    """Check every block LMCache filled against vLLM's own computations; returns how many were checked.

    `prompts` and `supplied` are the run's prompts in the order they were sent
    and vLLM's ``num_cached_tokens`` for each (one engine, one prompt per
    occurrence, sent round after round).
    """
    return sum(loaded_blocks_checked(records, prompts, supplied).values())


def loaded_blocks_checked(records: list[dict], prompts: list[list[int]], supplied: list[int]) -> dict[str, int]:
    """`assert_loaded_blocks_were_computed`, the blocks checked counted per attention layer (every layer
    of the records, 0 where none was)."""
    by_prompt: dict[str, list[dict]] = {}
    for record in records:
        by_prompt.setdefault(record["prompt"], []).append(record)
    seen: dict[str, int] = {}
    occurrences = []
    for tokens, hit in zip(prompts, supplied, strict=True):
        key = _prompt_key(tokens)
        index = seen.get(key, 0)
        seen[key] = index + 1
        assert index < len(by_prompt.get(key, [])), f"no KV snapshot of prompt occurrence {len(occurrences)}"
        occurrences.append((tokens, hit, by_prompt[key][index]))

    computed: dict[tuple[str, str], set[str]] = {}
    for tokens, hit, record in occurrences:
        for name, layer in record["blocks"].items():
            size = layer["block_size"]
            for block, digest in enumerate(layer["digests"]):
                if block * size >= hit and digest is not None:
                    computed.setdefault((name, _prompt_key(tokens[: (block + 1) * size])), set()).add(digest)

    checked: dict[str, int] = {}
    for number, (tokens, hit, record) in enumerate(occurrences):
        for name, layer in record["blocks"].items():
            checked.setdefault(name, 0)
            size = layer["block_size"]
            for block in range(hit // size):
                digest = layer["digests"][block]
                if digest is None:
                    continue  # outside the window vLLM keeps: nothing to fill
                expected = computed.get((name, _prompt_key(tokens[: (block + 1) * size])))
                assert expected, f"prompt {number}, {name}, block {block}: vLLM never computed this prefix itself"
                assert digest in expected, (
                    f"prompt {number} ({hit} tokens supplied), {name}, block {block} (tokens "
                    f"[{block * size}, {(block + 1) * size})): the loaded bytes are not what vLLM computed"
                )
                checked[name] += 1
    return checked
