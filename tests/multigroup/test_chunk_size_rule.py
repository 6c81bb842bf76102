"""A chunk_size that is not whole blocks of some moved group is refused when the connector starts.

A chunk must be whole blocks of every KV-cache group LMCache moves (and a multiple of
every compress ratio); only a compressed group may hold several chunks in one block.
Anything else makes a load write part of a block, and vLLM's CPU backend does not store
a block's tokens as rows (its K is transposed across the block: see
`tests/kv_worker/test_cpu_attention_blocks.py`); the engine then gave other tokens.  The refusal names the key, its value, the
block sizes and the nearest allowed values, on the real in-process adapter (patched)
for multi-group models, one-group models and vLLM's hybrid manager off alike.
"""

from __future__ import annotations

import dataclasses

import pytest

from lmcache_ascend.multigroup.adapter_scheduler import connector_kv_groups
from lmcache_ascend.multigroup.connector_state import (
    MultiGroupConfigError,
    check_chunk_size,
    check_single_group_chunk_size,
    nearest_chunk_sizes,
)
from lmcache_ascend.multigroup.specs import KVGroupSpec, kv_groups_from_specs, kv_groups_from_config
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.patches import State, registry
from tests.fixtures.kv_cache_configs import (
    dsv4_ascend_kv_cache_config,
    dsv4_cuda_kv_cache_config,
    full_and_sliding_window_kv_cache_config,
    single_group_kv_cache_config,
)
from tests.multigroup.scheduler_driver import RequestDriver, make_connector_impl
from tests.patching import apply_now

REGISTRY = registry.process_registry()
PATCH = "lmcache-adapter-multigroup"


@pytest.fixture
def patched():
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    yield
    assert REGISTRY.revert(PATCH) is State.REVERTED


def _kv_groups(fixture):
    return kv_groups_from_config(fixture.kv_cache_config, fixture.vllm_block_size, StateGroupPolicy())


@pytest.mark.parametrize(
    "chunk_size, blocks, nearest",
    [
        (200, [(128, 1)], (128, 256)),
        (192, [(128, 1)], (128, 256)),
        (64, [(128, 1)], (128,)),  # inside one block of an uncompressed group: nothing below
        (100, [(256, 1), (64, 1), (4, 1), (8, 1)], (256,)),
        (64, [(128, 1), (512, 4)], (128,)),
        (256, [(512, 4), (384, 128)], (128, 1536)),  # compressed: inside a block or whole blocks
    ],
)
def test_nearest_allowed_chunk_sizes(chunk_size, blocks, nearest):
    assert nearest_chunk_sizes(chunk_size, blocks) == nearest


@pytest.mark.parametrize("chunk_size", [200, 192, 96, 64, 16, 384 + 64])
def test_one_group_refuses_chunks_that_are_not_whole_blocks(chunk_size):
    with pytest.raises(MultiGroupConfigError) as raised:
        check_single_group_chunk_size(128, chunk_size)
    message = str(raised.value)
    assert f"chunk_size={chunk_size} " in message and "128 (vLLM block_size)" in message
    allowed = " or ".join(str(size) for size in nearest_chunk_sizes(chunk_size, [(128, 1)]))
    assert message.endswith(f"set chunk_size to {allowed}")


@pytest.mark.parametrize("chunk_size", [128, 256, 768, 4096])
def test_one_group_keeps_chunks_of_whole_blocks(chunk_size):
    check_single_group_chunk_size(128, chunk_size)


def test_every_moved_group_counts_and_a_skipped_state_group_does_not():
    cuda = _kv_groups(dsv4_cuda_kv_cache_config())  # 256 / 64 / 64 / 4 / 8, none compressed
    check_chunk_size(cuda, 256)
    check_chunk_size(cuda, 512)
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=64 .*256 \(group 0 FullAttentionSpec\).*set chunk_size to 256$"):
        check_chunk_size(cuda, 64)  # inside a 256-token block of an uncompressed group
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=192 .*256 \(group 0 FullAttentionSpec\)"):
        check_chunk_size(cuda, 128 + 64)
    ascend = _kv_groups(dsv4_ascend_kv_cache_config())  # 512 (ratio 4) / 16384 (128) / 128 / 512 (4) moved
    check_chunk_size(ascend, 256)  # several chunks in one block of each compressed group
    with pytest.raises(MultiGroupConfigError, match="set chunk_size to 256 or 512"):
        check_chunk_size(ascend, 384)
    # A state group is moved by default, so it constrains the chunk; skipped on request, it does not.
    groups = (KVGroupSpec(0, "Full", 128), KVGroupSpec(1, "C4AttnKVState", 96, is_state=True))
    with pytest.raises(MultiGroupConfigError, match=r"96 \(group 1 C4AttnKVState\)"):
        check_chunk_size(kv_groups_from_specs(groups, 32, StateGroupPolicy()), 256)
    kv_groups = kv_groups_from_specs(groups, 32, StateGroupPolicy(skip_state_groups=True))
    assert kv_groups.transferred == (True, False)
    check_chunk_size(kv_groups, 256)


def test_compress_ratio_rule_still_comes_first():
    kv_groups = kv_groups_from_specs((KVGroupSpec(0, "A", 512, 4), KVGroupSpec(1, "B", 16384, 128)), 128, StateGroupPolicy())
    with pytest.raises(MultiGroupConfigError, match="chunk_size=192 is not a multiple of compress_ratio=128"):
        check_chunk_size(kv_groups, 192)
    check_chunk_size(kv_groups, 256)


@pytest.mark.parametrize(
    "fixture",
    [full_and_sliding_window_kv_cache_config(), single_group_kv_cache_config()],
    ids=["two-groups", "one-group"],
)
def test_real_adapter_refuses_at_start_naming_key_value_and_block_sizes(patched, fixture):
    impl = make_connector_impl(fixture, chunk_size=40)  # 16-token blocks
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=40 does not fit .*16 \(group 0 .*set chunk_size to 32 or 48"):
        connector_kv_groups(impl)
    # The scheduler's first step goes through the same check: nothing is tracked or stored.
    with pytest.raises(MultiGroupConfigError, match="chunk_size=40"):
        RequestDriver(impl, "r", list(range(100))).start(100, tuple([1] * 7 for _ in fixture.kv_cache_config.kv_cache_groups))
    assert impl._request_trackers == {}
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=8 does not fit .*set chunk_size to 16$"):
        connector_kv_groups(make_connector_impl(fixture, chunk_size=8))  # half a block
    for allowed in (16, 32, 256):
        connector_kv_groups(make_connector_impl(fixture, chunk_size=allowed))


def test_real_adapter_without_a_kv_cache_config_checks_vllms_block_size(patched):
    """vLLM's hybrid manager off on a release that gives the connector no KVCacheConfig: vLLM's block size."""
    fixture = dataclasses.replace(single_group_kv_cache_config(), vllm_block_size=128)
    impl = make_connector_impl(fixture, chunk_size=200)
    impl._parent._kv_cache_config = None
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=200 does not fit .*128 \(vLLM block_size\).*128 or 256"):
        connector_kv_groups(impl)
    control = make_connector_impl(fixture, chunk_size=256)
    control._parent._kv_cache_config = None
    assert connector_kv_groups(control) is None
