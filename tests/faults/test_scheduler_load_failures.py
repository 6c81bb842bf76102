"""vLLM's real scheduler and KV-cache manager, a failed load of a hybrid model (every stack).

The patched ``Scheduler._handle_invalid_blocks`` runs on a scheduler object holding vLLM's
real ``KVCacheManager`` of a three-group hybrid config and real requests whose blocks it
allocated; only the scheduler's constructor is skipped (it needs a model config) and its
``_preempt_request`` is recorded instead of run (the engine tests run it for real on stack D,
`tests/engine/test_engine_faults.py`). Upstream, the same call raises or fails to unpack.
"""

from __future__ import annotations

import inspect

import pytest

from lmcache_ascend.patches import State, registry
from tests.prefix_cache.harness import HybridModel, hybrid_config, make_manager, make_request
from tests.patching import apply_now

REGISTRY = registry.process_registry()
PATCH = "vllm-multigroup-load-failures"
HYBRID = HybridModel()
TOKENS = 1024


@pytest.fixture
def load_failure_patch():
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    yield
    REGISTRY.revert(PATCH)


def _scheduler(recompute: bool = True):
    """A scheduler object over a real manager with requests "a" and "b" running (distinct tokens)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    config = hybrid_config(HYBRID)
    block_sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
    manager = make_manager(config, scheduler_block_size=max(block_sizes), hash_block_size=min(block_sizes))
    scheduler = object.__new__(Scheduler)
    requests = []
    for index, request_id in enumerate(("a", "b")):
        request = make_request(request_id, [index * 1000 + token for token in range(TOKENS)], min(block_sizes))
        assert manager.allocate_slots(request, TOKENS) is not None
        request.status = RequestStatus.RUNNING
        requests.append(request)
    preempted = []
    scheduler.kv_cache_manager = manager
    scheduler.kv_cache_config = config
    scheduler.requests = {request.request_id: request for request in requests}
    scheduler.running = list(requests)
    scheduler.recompute_kv_load_failures = recompute
    scheduler.failed_recving_kv_req_ids = set()
    scheduler.prev_step_scheduled_req_ids = {"a", "b"}
    # Upstream's handler scans the requests waiting for an asynchronous load too (named per version).
    scheduler.skipped_waiting = scheduler.kv_holding_waiting = []
    scheduler._preempt_request = lambda request, timestamp, **options: preempted.append((request.request_id, options))
    return scheduler, manager, preempted


def _handle(scheduler, invalid: set[int]):
    from vllm.v1.core.sched.scheduler import Scheduler

    takes_scheduled = "num_scheduled_tokens" in inspect.signature(Scheduler._handle_invalid_blocks).parameters
    return scheduler._handle_invalid_blocks(invalid, {}) if takes_scheduled else scheduler._handle_invalid_blocks(invalid)


def _cached(manager, block_ids) -> list[int]:
    return [block_id for block_id in block_ids if manager.block_pool.blocks[block_id].block_hash is not None]


def _all_blocks(manager, request_id: str) -> set[int]:
    return {block_id for group in manager.get_block_ids(request_id) for block_id in group} - {0}


@pytest.mark.parametrize("group", [0, 1, 2])
def test_an_invalid_block_of_any_group_preempts_its_request_and_uncaches_its_blocks(load_failure_patch, group):
    scheduler, manager, preempted = _scheduler()
    a_blocks, b_blocks = _all_blocks(manager, "a"), _all_blocks(manager, "b")
    b_cached = _cached(manager, b_blocks)
    assert _cached(manager, a_blocks) and b_cached, "the manager cached no blocks: nothing to check"
    invalid = {[block for block in manager.get_block_ids("a")[group] if block][-1]}
    assert _handle(scheduler, invalid) == {"a"}
    assert [request_id for request_id, _ in preempted] == ["a"]
    assert [request.request_id for request in scheduler.running] == ["b"]
    assert "a" not in scheduler.prev_step_scheduled_req_ids
    assert _cached(manager, a_blocks) == [], "a's blocks stay in vLLM's prefix cache: a retry would hit bad KV"
    assert _cached(manager, b_blocks) == b_cached, "the innocent request's cached blocks were dropped"


def test_the_null_block_and_unknown_ids_fail_nobody(load_failure_patch):
    scheduler, manager, preempted = _scheduler()
    assert _handle(scheduler, {0, manager.block_pool.num_gpu_blocks - 1} - _all_blocks(manager, "a")
                   - _all_blocks(manager, "b")) == set()
    assert preempted == [] and len(scheduler.running) == 2


def test_policy_fail_leaves_the_request_to_vllm_and_still_uncaches_its_blocks(load_failure_patch):
    scheduler, manager, preempted = _scheduler(recompute=False)
    a_blocks = _all_blocks(manager, "a")
    assert _handle(scheduler, {max(a_blocks)}) == {"a"}
    assert preempted == [] and len(scheduler.running) == 2
    assert _cached(manager, a_blocks) == []


def test_upstream_refuses_the_same_failure():
    """The control: without the patch vLLM's own handler does not survive a hybrid model's failed load."""
    assert REGISTRY.record(PATCH).state is not State.APPLIED
    scheduler, manager, _ = _scheduler()
    with pytest.raises((RuntimeError, ValueError)):
        _handle(scheduler, {max(_all_blocks(manager, "a"))})
