"""The byte oracle's check on hand-made records: it accepts computed bytes and names any other."""

from __future__ import annotations

import pytest

from tests.engine.kv_oracle import _prompt_key, assert_loaded_blocks_were_computed

PROMPT = list(range(10, 30))  # 20 tokens: blocks of 4 -> 5 whole blocks


def _record(digests: list[str | None]) -> dict:
    return {"prompt": _prompt_key(PROMPT), "blocks": {"layer": {"block_size": 4, "digests": digests}}}


def test_loaded_blocks_equal_to_computed_ones_pass():
    cold = _record(["a", "b", "c", "d", "e"])
    warm = _record(["a", None, "c", "d", "e"])  # block 1 outside a window: not filled
    assert assert_loaded_blocks_were_computed([cold, warm], [PROMPT, PROMPT], [0, 16]) == 3


def test_a_loaded_block_with_other_bytes_is_named():
    cold = _record(["a", "b", "c", "d", "e"])
    warm = _record(["a", "b", "X", "d", "e"])
    with pytest.raises(AssertionError, match=r"prompt 1 \(16 tokens supplied\), layer, block 2 \(tokens \[8, 12\)\)"):
        assert_loaded_blocks_were_computed([cold, warm], [PROMPT, PROMPT], [0, 16])


def test_bytes_vllm_only_loaded_are_no_reference():
    """Blocks below a hit were loaded, not computed: they cannot vouch for another load."""
    first = _record(["a", "b", "c", "d", "e"])
    with pytest.raises(AssertionError, match="never computed this prefix"):
        assert_loaded_blocks_were_computed([first, first], [PROMPT, PROMPT], [8, 8])


def _scheduler_output(new=(), cached=(), finished=(), preempted=()):
    """One step's message from vLLM's scheduler to its runner, built from vLLM's own classes."""
    output_module = pytest.importorskip("vllm.v1.core.sched.output", reason="vLLM's scheduler output needs vLLM")
    steps = output_module.CachedRequestData.make_empty()
    for request_id, computed, added in cached:
        steps.req_ids.append(request_id)
        steps.num_computed_tokens.append(computed)
        steps.new_block_ids.append(added)
    return output_module.SchedulerOutput(
        scheduled_new_reqs=[output_module.NewRequestData(
            req_id=request_id, prompt_token_ids=list(prompt), mm_features=[], sampling_params=None,
            pooling_params=None, block_ids=blocks, num_computed_tokens=computed, lora_request=None)
            for request_id, prompt, blocks, computed in new],
        scheduled_cached_reqs=steps, num_scheduled_tokens={}, total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0, 0],
        finished_req_ids=set(finished), free_encoder_mm_hashes=[], preempted_req_ids=set(preempted))


def test_block_ids_followed_from_the_scheduler_as_the_runner_keeps_them():
    """Where the runner keeps its request table on the device (vLLM's second model runner), the oracle
    follows each request's block ids per group from the scheduler's messages: new, added, dropped."""
    from tests.engine.kv_oracle import _follow

    requests: dict = {}
    _follow(requests, _scheduler_output(new=[("a", PROMPT, ([1, 2], [7]), 0), ("b", PROMPT[:8], ([3], [8]), 4)]))
    _follow(requests, _scheduler_output(cached=[("a", 8, ([4], [])), ("b", 8, None)]))
    assert [requests["a"].block_ids, requests["a"].num_computed_tokens] == [([1, 2, 4], [7]), 8]
    assert [requests["b"].block_ids, requests["b"].num_computed_tokens] == [([3], [8]), 8]
    assert requests["a"].prompt_token_ids == PROMPT
    _follow(requests, _scheduler_output(finished=["b"], preempted=["a"]))
    assert requests == {}
    _follow(requests, _scheduler_output(new=[("a", PROMPT, ([5], [9]), 0)]))  # a preempted request comes back new
    assert requests["a"].block_ids == ([5], [9])
