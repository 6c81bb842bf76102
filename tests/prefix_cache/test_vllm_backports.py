"""The vLLM prefix-cache backports on the REAL vLLM block pool and managers.

Stack A (vLLM 0.18.1): the patches apply; stack B (vLLM 0.23): they report
skipped-upstream-has-it and upstream's own code runs. The same expectations
hold on both, which is what proves patched A follows upstream's semantics.
Where unpatched A must differ, the test asserts the legacy behaviour too, so
each test can fail.
"""

from __future__ import annotations

from lmcache_ascend.compat.versions import installed_version
import py_compile

import pytest
from packaging.version import Version

from lmcache_ascend.patches import State, registry
from lmcache_ascend.patches.registry import Registry
from tests.prefix_cache.harness import (
    CORE_BACKPORT_PATCHES,
    SCHEDULER_BACKPORT_PATCH,
    HybridModel,
    computed_blocks,
    free_queue_ids,
    make_manager,
    make_request,
    sliding_window_config,
)
from tests.patching import apply_now

REGISTRY = registry.process_registry()
PATCH_NAMES = CORE_BACKPORT_PATCHES + (SCHEDULER_BACKPORT_PATCH,)
VLLM_HAS_RETENTION = Version(installed_version("vllm")) >= Version("0.23")


def _apply_all() -> dict[str, State]:
    return {name: apply_now(REGISTRY, name) for name in PATCH_NAMES}


def _revert_all() -> None:
    for name in reversed(PATCH_NAMES):
        if REGISTRY.state(name) is State.APPLIED:
            REGISTRY.revert(name)


@pytest.fixture(scope="module")
def backports():
    states = _apply_all()
    yield states
    _revert_all()


@pytest.fixture
def unpatched(backports):
    """The stack as shipped: stack A without our patches (stack B is always as shipped)."""
    _revert_all()
    yield
    _apply_all()


def test_states_per_stack(backports):
    expected = State.SKIPPED_UPSTREAM if VLLM_HAS_RETENTION else State.APPLIED
    assert backports == {name: expected for name in PATCH_NAMES}
    for name in PATCH_NAMES:
        assert "capability probe" in REGISTRY.record(name).reason


# A hybrid model whose sliding-window checkpoints are sparse: full attention
# with 64-token blocks, a 16-token window in 16-token blocks; hits align to 64.
HYBRID = HybridModel(
    mla_block_size=64, sliding_window_block_size=16, sliding_window=16, compressed_block_tokens=64, num_blocks=80
)


def _hybrid_manager(num_blocks: int = 64, retention_interval: int | None = None):
    from tests.prefix_cache.harness import hybrid_config

    hybrid = HybridModel(
        mla_block_size=HYBRID.mla_block_size,
        sliding_window_block_size=HYBRID.sliding_window_block_size,
        sliding_window=HYBRID.sliding_window,
        compressed_block_tokens=HYBRID.compressed_block_tokens,
        num_blocks=num_blocks,
    )
    return make_manager(
        hybrid_config(hybrid), hybrid.scheduler_block_size, hybrid.hash_block_size, retention_interval=retention_interval
    )


def _prefill(manager, request) -> None:
    blocks, num_hit = computed_blocks(manager, request)
    assert manager.allocate_slots(
        request, request.num_tokens - num_hit, num_new_computed_tokens=num_hit, new_computed_blocks=blocks
    ) is not None
    request.num_computed_tokens = request.num_tokens


def _cached_positions(manager, request_id: str, group: int) -> list[int]:
    blocks = manager.coordinator.single_type_managers[group].req_to_blocks[request_id]
    return [index for index, block in enumerate(blocks) if block.block_hash is not None]


def test_scheduler_block_size_threaded_to_every_manager(backports):
    manager = _hybrid_manager()
    assert manager.coordinator.scheduler_block_size == 64
    assert [m.scheduler_block_size for m in manager.coordinator.single_type_managers] == [64, 64, 64]


def test_dense_sliding_window_checkpoints(backports):
    manager = _hybrid_manager()
    prompt = list(range(1, 265))  # 264 tokens: 4 aligned segments + a tail
    request = make_request("dense", prompt, HYBRID.hash_block_size)
    _prefill(manager, request)
    assert _cached_positions(manager, "dense", group=0) == [0, 1, 2, 3]
    # Window 16 = one block per hit; only the last block of each 64-token segment can serve one.
    assert _cached_positions(manager, "dense", group=1) == [3, 7, 11, 15]


def test_dense_checkpoints_legacy_on_unpatched_stack_a(unpatched):
    manager = _hybrid_manager()
    request = make_request("legacy", list(range(1, 265)), HYBRID.hash_block_size)
    _prefill(manager, request)
    expected = [3, 7, 11, 15] if VLLM_HAS_RETENTION else list(range(16))
    assert _cached_positions(manager, "legacy", group=1) == expected


def test_retention_interval_checkpoints(backports):
    manager = _hybrid_manager(retention_interval=128)
    request = make_request("sparse", list(range(1, 201)), HYBRID.hash_block_size)  # 200 tokens
    _prefill(manager, request)
    # Every 128 tokens (block 7) plus the replay boundary 192 (block 11).
    assert _cached_positions(manager, "sparse", group=1) == [7, 11]


@pytest.mark.parametrize(
    ("raw", "message"),
    [(100, "multiple of scheduler_block_size|multiple of the scheduler block size")],
)
def test_retention_interval_not_a_multiple_is_rejected(backports, raw, message):
    with pytest.raises(ValueError, match=message):
        _hybrid_manager(retention_interval=raw)


def test_retention_interval_without_sliding_window_group_is_rejected(backports):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    import torch

    spec = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["f"], spec)])
    with pytest.raises(ValueError, match="no sliding-window"):
        make_manager(config, 64, 64, retention_interval=128)


def test_free_puts_scratch_first_and_cached_last(backports):
    manager = make_manager(sliding_window_config(block_size=16, sliding_window=32, num_blocks=16), 16, 16)
    request = make_request("r", list(range(1, 101)), 16)  # 6 full (cached) blocks + 1 partial
    _prefill(manager, request)
    used = [block.block_id for block in manager.coordinator.single_type_managers[0].req_to_blocks["r"]]
    assert used == [1, 2, 3, 4, 5, 6, 7]
    manager.free(request)
    # Upstream 0.23: the uncached partial block first, then never-used blocks,
    # then the cached blocks tail-first.
    assert free_queue_ids(manager) == [7, *range(8, 16), 6, 5, 4, 3, 2, 1]


def test_free_order_legacy_on_unpatched_stack_a(unpatched):
    manager = make_manager(sliding_window_config(block_size=16, sliding_window=32, num_blocks=16), 16, 16)
    request = make_request("r", list(range(1, 101)), 16)
    _prefill(manager, request)
    manager.free(request)
    expected = [7, *range(8, 16), 6, 5, 4, 3, 2, 1] if VLLM_HAS_RETENTION else [*range(8, 16), 7, 6, 5, 4, 3, 2, 1]
    assert free_queue_ids(manager) == expected


def test_skipped_blocks_split_scratch_first(backports):
    manager = make_manager(sliding_window_config(block_size=16, sliding_window=32, num_blocks=16), 16, 16)
    request = make_request("w", list(range(1, 97)), 16)  # 6 full blocks
    _prefill(manager, request)
    pool = manager.block_pool
    # Drop the hash of block 2 so it is scratch, then let the window move past blocks 0..3.
    blocks = manager.coordinator.single_type_managers[0].req_to_blocks["w"]
    pool.cached_block_hash_to_block.pop(blocks[1].block_hash, blocks[1].block_id)
    blocks[1].reset_hash()
    manager.remove_skipped_blocks("w", 96)  # skips 96 - 32 + 1 = 65 tokens = 4 blocks
    assert free_queue_ids(manager) == [2, *range(7, 16), 4, 3, 1]


def _replay_hit_after_burst(manager) -> tuple[int, int]:
    prompt = [7 + (i * 31) % 997 for i in range(264)]
    first = make_request("first", prompt, HYBRID.hash_block_size)
    _prefill(manager, first)
    manager.free(first)
    replay = make_request("replay", prompt, HYBRID.hash_block_size)
    _, hit_before = computed_blocks(manager, replay)
    # A burst of scratch allocations as large as the free queue minus what
    # upstream keeps behind the scratch: 63 free blocks; the first request left
    # 5 full-attention + 5 compressed blocks (4 cached + 1 partial each) and
    # 17 window blocks (4 cached checkpoints). Upstream's queue is then
    # [13 window scratch, 36 never used, mla partial, mla 3..0, window 15/11/7/3,
    # compressed partial + 3..0], so 50 allocations stop right before mla block 3.
    assert manager.block_pool.get_num_free_blocks() == 63
    burst = 50
    manager.block_pool.get_new_blocks(burst)
    _, hit_after = computed_blocks(manager, make_request("replay2", prompt, HYBRID.hash_block_size))
    return hit_before, hit_after


def test_cached_blocks_survive_a_burst_of_scratch_allocations(backports):
    assert _replay_hit_after_burst(_hybrid_manager()) == (256, 256)


def test_burst_evicts_the_prefix_on_unpatched_stack_a(unpatched):
    expected = (256, 256) if VLLM_HAS_RETENTION else (256, 0)
    assert _replay_hit_after_burst(_hybrid_manager()) == expected


def test_guard_on_pyc_only_target_falls_back_to_versions(tmp_path, monkeypatch):
    """Without source text the guard can't tell; the version gate alone decides."""
    import sys

    from lmcache_ascend.compat.guards import evaluate_guard
    from lmcache_ascend.compat.guards import Verdict
    from lmcache_ascend.patches.vllm import free_queue_prepend

    package = tmp_path / "pyc_only_vllm_core"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = tmp_path / "kv_cache_utils_source.py"
    source.write_text("class FreeKVCacheBlockQueue:\n    def append_n(self, blocks):\n        pass\n")
    py_compile.compile(str(source), cfile=str(package / "kv_cache_utils.pyc"))
    monkeypatch.syspath_prepend(str(tmp_path))
    target = "pyc_only_vllm_core.kv_cache_utils"
    guard = free_queue_prepend.PATCH.guard
    result = evaluate_guard(guard, target, None)
    assert result.verdict is Verdict.UNKNOWN and "no source" in result.how

    for requirement, expected in ((">=0.18.0", State.APPLIED), ("<0.18", State.SKIPPED_VERSION)):
        patch = free_queue_prepend.PATCH.replace(
            target=target, guard=guard._replace(probe=None),
            requires={"vllm": requirement},
        )
        local = Registry([patch])
        state = apply_now(local, patch.name)
        assert state is expected, local.record(patch.name).reason
        if state is State.APPLIED:
            module = sys.modules[target]
            assert callable(module.FreeKVCacheBlockQueue.prepend_n)
            local.revert(patch.name)
            assert not hasattr(module.FreeKVCacheBlockQueue, "prepend_n")
    sys.modules.pop(target, None)
    sys.modules.pop("pyc_only_vllm_core", None)


def test_retention_interval_zero_keeps_only_the_replay_boundary(backports):
    """0 is upstream's "latest boundary only": the backport gives it the same meaning."""
    manager = _hybrid_manager(retention_interval=0)
    request = make_request("latest", list(range(1, 201)), HYBRID.hash_block_size)  # 200 tokens
    _prefill(manager, request)
    assert _cached_positions(manager, "latest", group=1) == [11]  # the replay boundary 192 only


def test_scheduler_takes_upstreams_hash_block_size_keyword(backports):
    """Callers written for vLLM 0.23 pass Scheduler(block_size=..., hash_block_size=...)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    assert "hash_block_size" in inspect.signature(Scheduler.__init__).parameters
    # No engine config here: the original __init__ stops on it, after taking the keyword.
    with pytest.raises(AttributeError, match="NoneType"):
        Scheduler.__init__(object.__new__(Scheduler), None, None, None, block_size=64, hash_block_size=16)


@pytest.mark.parametrize("wraps", [True, False], ids=["functools-wraps", "opaque-wrapper"])
def test_signature_guards_see_through_third_party_wrappers(unpatched, monkeypatch, wraps):
    """A wrapper hides upstream's signature: follow __wrapped__, else say the probe can't tell."""
    import functools

    from lmcache_ascend.compat.guards import evaluate_guard
    from lmcache_ascend.compat.guards import Verdict
    from vllm.v1.core import kv_cache_coordinator as module

    record = REGISTRY.record("vllm-coordinator-scheduler-block-size")
    original = module.KVCacheCoordinator.__dict__["__init__"]

    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(module.KVCacheCoordinator, "__init__", functools.wraps(original)(wrapper) if wraps else wrapper)
    guard = evaluate_guard(record.patch.guard, record.patch.target, module)
    assert guard.verdict is (Verdict.HAS_FIX if VLLM_HAS_RETENTION else Verdict.LACKS_FIX)
    assert ("capability probe" in guard.how) if wraps else ("probe could not tell" in guard.how)
