"""A chunk_size that does not nest with some moved group's blocks is refused when the connector starts.

A chunk must lie inside one block or be whole blocks of every KV-cache group LMCache
moves (and a multiple of every compress ratio).  Anything else ends a chunk inside a
block that also holds the next chunk's tokens; the engine then gave other tokens for
every load not ending on a block boundary.  The refusal names the key, its value, the
block sizes and the nearest allowed values, on the real in-process adapter (patched)
for multi-group models, one-group models and vLLM's hybrid manager off alike.
"""

from __future__ import annotations

import dataclasses

import pytest

from lmcache_ascend.multigroup.adapter_scheduler import connector_layout
from lmcache_ascend.multigroup.connector_state import (
    MultiGroupConfigError,
    check_chunk_size,
    check_single_group_chunk_size,
    nearest_chunk_sizes,
)
from lmcache_ascend.multigroup.specs import KVGroupSpec, layout_from_groups, layout_from_kv_cache_config
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.patches import State, registry
from tests.fixtures.kv_cache_configs import (
    dsv4_ascend_kv_cache_config,
    dsv4_cuda_kv_cache_config,
    full_and_sliding_window_kv_cache_config,
    single_group_kv_cache_config,
)
from tests.multigroup.scheduler_driver import RequestDriver, make_connector_impl

PATCH = "lmcache-adapter-multigroup"


@pytest.fixture
def patched():
    assert registry.apply_now(PATCH) is State.APPLIED, registry.record(PATCH).reason
    yield
    assert registry.revert(PATCH) is State.REVERTED


def _layout(fixture):
    return layout_from_kv_cache_config(fixture.kv_cache_config, fixture.vllm_block_size, StateGroupPolicy())


@pytest.mark.parametrize(
    "chunk_size, block_sizes, ratios, nearest",
    [
        (200, [128], [], (128, 256)),
        (192, [128], [], (128, 256)),
        (100, [256, 64, 64, 4, 8], [], (64, 128)),
        (1, [16], [], (2,)),  # nothing below 1
        (256, [512, 384], [4, 128], (128, 1536)),
    ],
)
def test_nearest_allowed_chunk_sizes(chunk_size, block_sizes, ratios, nearest):
    assert nearest_chunk_sizes(chunk_size, block_sizes, ratios) == nearest


@pytest.mark.parametrize("chunk_size", [200, 192, 96, 384 + 64])
def test_one_group_refuses_chunks_that_end_inside_a_block(chunk_size):
    with pytest.raises(MultiGroupConfigError) as raised:
        check_single_group_chunk_size(128, chunk_size)
    message = str(raised.value)
    assert f"chunk_size={chunk_size} " in message and "128 (vLLM block_size)" in message
    below, above = nearest_chunk_sizes(chunk_size, [128])
    assert message.endswith(f"set chunk_size to {below} or {above}")


@pytest.mark.parametrize("chunk_size", [1, 16, 64, 128, 256, 768, 4096])
def test_one_group_keeps_chunks_that_nest_with_its_blocks(chunk_size):
    check_single_group_chunk_size(128, chunk_size)


def test_every_moved_group_counts_and_a_skipped_state_group_does_not():
    cuda = _layout(dsv4_cuda_kv_cache_config())  # 256 / 64 / 64 / 4 / 8
    check_chunk_size(cuda, 256)
    check_chunk_size(cuda, 64)  # inside a 256-token block, whole 4 / 8-token blocks
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=192 .*256 \(group 0 FullAttentionSpec\)"):
        check_chunk_size(cuda, 128 + 64)
    ascend = _layout(dsv4_ascend_kv_cache_config())  # 512 / 16384 / 128 / 512 moved; state groups of 128
    check_chunk_size(ascend, 256)
    with pytest.raises(MultiGroupConfigError, match="set chunk_size to 256 or 512"):
        check_chunk_size(ascend, 384)
    # A group that is not moved does not constrain the chunk.
    groups = (KVGroupSpec(0, "Full", 128), KVGroupSpec(1, "C4AttnKVState", 96, is_state=True))
    layout = layout_from_groups(groups, 32, StateGroupPolicy())
    assert layout.transferred == (True, False)
    check_chunk_size(layout, 256)
    with pytest.raises(MultiGroupConfigError, match=r"96 \(group 1 C4AttnKVState\)"):
        check_chunk_size(layout_from_groups(groups, 32, StateGroupPolicy(skip_state_groups=False)), 256)


def test_compress_ratio_rule_still_comes_first():
    layout = layout_from_groups((KVGroupSpec(0, "A", 512, 4), KVGroupSpec(1, "B", 16384, 128)), 128, StateGroupPolicy())
    with pytest.raises(MultiGroupConfigError, match="chunk_size=192 is not a multiple of compress_ratio=128"):
        check_chunk_size(layout, 192)
    check_chunk_size(layout, 256)


@pytest.mark.parametrize(
    "fixture",
    [full_and_sliding_window_kv_cache_config(), single_group_kv_cache_config()],
    ids=["two-groups", "one-group"],
)
def test_real_adapter_refuses_at_start_naming_key_value_and_block_sizes(patched, fixture):
    impl = make_connector_impl(fixture, chunk_size=40)  # 16-token blocks
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=40 does not fit .*16 \(group 0 .*set chunk_size to 32 or 48"):
        connector_layout(impl)
    # The scheduler's first step goes through the same check: nothing is tracked or stored.
    with pytest.raises(MultiGroupConfigError, match="chunk_size=40"):
        RequestDriver(impl, "r", list(range(100))).start(100, tuple([1] * 7 for _ in fixture.kv_cache_config.kv_cache_groups))
    assert impl._request_trackers == {}
    for allowed in (8, 16, 32, 256):
        connector_layout(make_connector_impl(fixture, chunk_size=allowed))


def test_real_adapter_without_a_kv_cache_config_checks_vllms_block_size(patched):
    """vLLM's hybrid manager off on a release that gives the connector no KVCacheConfig: vLLM's block size."""
    fixture = dataclasses.replace(single_group_kv_cache_config(), vllm_block_size=128)
    impl = make_connector_impl(fixture, chunk_size=200)
    impl._parent._kv_cache_config = None
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=200 does not fit .*128 \(vLLM block_size\).*128 or 256"):
        connector_layout(impl)
    control = make_connector_impl(fixture, chunk_size=256)
    control._parent._kv_cache_config = None
    assert connector_layout(control) is None
