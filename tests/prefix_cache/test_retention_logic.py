"""Pure prefix-cache logic: flag mapping, checkpoint masks, block sizes, free order, layer names."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.flags import FlagError, parse_flag
from lmcache_ascend.prefix_cache.block_sizes import (
    aggregated_page_size_bytes,
    compressed_kv_block_size,
    prefix_block_size,
    scheduler_block_size,
    unpack_uniform_spec,
)
from lmcache_ascend.prefix_cache.free_order import split_for_free
from lmcache_ascend.prefix_cache.layer_names import LayerNameMismatchError, check_layer_names
from lmcache_ascend.prefix_cache.retention import (
    RetentionIntervalError,
    SlidingWindowCheckpoints,
    blocks_needed_for_window_hit,
    retention_interval_from_flag,
    validate_retention_interval,
)

RETENTION = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


# ------------------------------------------------------------- retention flag
def test_auto_and_unset_mean_upstream_default_dense():
    assert retention_interval_from_flag(parse_flag(RETENTION, None)) is None
    assert retention_interval_from_flag(parse_flag(RETENTION, "auto")) is None
    assert retention_interval_from_flag(parse_flag(RETENTION, " AUTO ")) is None
    assert retention_interval_from_flag(parse_flag(RETENTION, "512")) == 512


@pytest.mark.parametrize("raw", ["-64", "abc", "1.5", "64k", "1_024", "\uff15\uff11\uff12", str(10**29)])
def test_bad_retention_flag_names_flag_value_and_allowed(raw):
    with pytest.raises(FlagError) as error:
        parse_flag(RETENTION, raw)
    message = str(error.value)
    assert RETENTION in message and repr(raw) in message and "'auto' or an integer 0.." in message


def test_zero_means_latest_boundary_only_as_upstream():
    assert retention_interval_from_flag(parse_flag(RETENTION, "0")) == 0
    validate_retention_interval(0, 256, has_sliding_window_group=True)


def test_interval_must_be_multiple_of_scheduler_block_size():
    validate_retention_interval(512, 256, has_sliding_window_group=True)
    with pytest.raises(RetentionIntervalError, match=r"RETENTION_INTERVAL=300 .*multiple of the scheduler block size \(256\), e\.g\. 512"):
        validate_retention_interval(300, 256, has_sliding_window_group=True)


def test_interval_without_sliding_window_group_is_rejected():
    validate_retention_interval(None, 256, has_sliding_window_group=False)
    with pytest.raises(RetentionIntervalError, match="no sliding-window KV-cache group"):
        validate_retention_interval(512, 256, has_sliding_window_group=False)


# ------------------------------------------------------------- checkpoint masks
def test_blocks_needed_for_window_hit():
    assert blocks_needed_for_window_hit(128, 128, use_eagle=False) == 1
    assert blocks_needed_for_window_hit(128, 64, use_eagle=False) == 2
    assert blocks_needed_for_window_hit(129, 64, use_eagle=False) == 2
    assert blocks_needed_for_window_hit(130, 64, use_eagle=False) == 3
    assert blocks_needed_for_window_hit(128, 64, use_eagle=True) == 3
    with pytest.raises(ValueError, match="sliding_window=0"):
        blocks_needed_for_window_hit(0, 64, use_eagle=False)


def test_dense_checkpoints_keep_the_last_block_of_each_aligned_segment():
    checkpoints = SlidingWindowCheckpoints(block_size=16, sliding_window=16, alignment_tokens=64)
    mask = checkpoints.block_mask(0, 16, num_prompt_tokens=264)
    assert [i for i, keep in enumerate(mask) if keep] == [3, 7, 11, 15]
    assert checkpoints.checkpoint_positions(264, 264) == [64, 128, 192, 256]


def test_interval_checkpoints_plus_replay_boundary():
    checkpoints = SlidingWindowCheckpoints(block_size=16, sliding_window=16, alignment_tokens=64, retention_interval=128)
    # Segments of 128 tokens keep blocks 7 and 15; the replay boundary of a
    # 200-token prompt is 192 (block 11).
    mask = checkpoints.block_mask(0, 16, num_prompt_tokens=200)
    assert [i for i, keep in enumerate(mask) if keep] == [7, 11, 15]
    assert checkpoints.checkpoint_positions(256, 200) == [128, 192, 256]


def test_interval_zero_keeps_only_replay_boundary_and_eagle_shifts_right():
    checkpoints = SlidingWindowCheckpoints(block_size=16, sliding_window=32, alignment_tokens=64, retention_interval=0)
    mask = checkpoints.block_mask(4, 16, num_prompt_tokens=200)
    assert [4 + i for i, keep in enumerate(mask) if keep] == [10, 11]
    eagle = SlidingWindowCheckpoints(block_size=16, sliding_window=16, alignment_tokens=64, use_eagle=True)
    assert [i for i, keep in enumerate(eagle.block_mask(0, 16, None)) if keep] == [3, 4, 7, 8, 11, 12, 15]


def test_window_wider_than_segment_caches_everything():
    checkpoints = SlidingWindowCheckpoints(block_size=64, sliding_window=512, alignment_tokens=128)
    assert checkpoints.block_mask(0, 10, 640) is None


def test_checkpoint_arguments_are_validated():
    with pytest.raises(ValueError, match="alignment_tokens=100 must be a multiple of block_size=64"):
        SlidingWindowCheckpoints(block_size=64, sliding_window=128, alignment_tokens=100)


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([8, 16, 32, 64, 128]),
    window_blocks=st.integers(1, 6),
    window_extra=st.integers(0, 7),
    segment_factor=st.integers(1, 8),
    use_eagle=st.booleans(),
    num_blocks=st.integers(0, 80),
    start=st.integers(0, 80),
)
def test_dense_mask_keeps_exactly_the_windows_of_aligned_hits(
    block_size, window_blocks, window_extra, segment_factor, use_eagle, num_blocks, start
):
    """Property: a block is kept iff it lies in the window run of some aligned hit length."""
    sliding_window = window_blocks * block_size + min(window_extra, block_size - 1) + 1
    alignment = block_size * segment_factor
    checkpoints = SlidingWindowCheckpoints(block_size, sliding_window, alignment, use_eagle)
    start = min(start, num_blocks)
    mask = checkpoints.block_mask(start, num_blocks, None)
    needed = checkpoints.blocks_per_hit
    shift = 1 if use_eagle else 0
    in_some_window = set()
    for run_end in range(shift, num_blocks + needed + 1):
        if (run_end - shift) * block_size % alignment == 0 and run_end - shift > 0:
            in_some_window.update(range(max(0, run_end - needed), run_end))
    expected = [index in in_some_window for index in range(start, num_blocks)]
    if mask is None:
        assert needed >= alignment // block_size
    else:
        assert mask == expected


# ------------------------------------------------------------- block sizes
def test_scheduler_block_size_is_lcm_of_groups():
    assert scheduler_block_size([128, 64, 256]) == 256
    assert scheduler_block_size([128, 96]) == 384
    assert scheduler_block_size([16], single_group_block_size=32) == 32  # dcp/pcp-scaled single group
    with pytest.raises(ValueError, match=r"positive integers; got 0"):
        scheduler_block_size([128, 0])


class _Spec:
    def __init__(self, block_size, compress_ratio=1, storage_block_size=None):
        self.block_size = block_size
        self.compress_ratio = compress_ratio
        self.storage_block_size = storage_block_size


class _UniformBundle:
    """Duck type of vLLM's UniformTypeKVCacheSpecs: members in ``kv_cache_specs``."""

    def __init__(self, members):
        self.kv_cache_specs = members
        self.block_size = next(iter(members.values())).block_size


def test_prefix_block_size_unpacks_uniform_bundles_first():
    compressed = _Spec(block_size=32, compress_ratio=128, storage_block_size=32)
    bundle = _UniformBundle({"layer.0": compressed, "layer.1": compressed})
    assert prefix_block_size(compressed) == 4096
    assert prefix_block_size(bundle) == 4096  # reading the bundle directly would give 32
    assert unpack_uniform_spec(compressed) is compressed
    assert prefix_block_size(_Spec(block_size=128)) == 128
    assert math.lcm(prefix_block_size(bundle), 128) == 4096
    with pytest.raises(ValueError, match="no member specs"):
        unpack_uniform_spec(type("EmptyBundle", (), {"kv_cache_specs": {}})())


def test_compressed_block_size_only_for_ratio_128():
    assert compressed_kv_block_size(128, 32) == 32
    assert compressed_kv_block_size(128, 128) == 128
    assert compressed_kv_block_size(4, 32) == 128
    with pytest.raises(ValueError, match=r"COMPRESSED_KV_BLOCK_SIZE=48 is not allowed; allowed: 32 \| 64 \| 128"):
        compressed_kv_block_size(128, 48)


@pytest.mark.parametrize("raw", ["16", "256", "x", "32.0"])
def test_compressed_block_size_flag_rejects(raw):
    with pytest.raises(FlagError, match="VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE"):
        parse_flag("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", raw)
    assert parse_flag("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", None) == 128


def test_aggregated_page_size():
    assert aggregated_page_size_bytes([4096, 1024, 64]) == 5184
    with pytest.raises(ValueError, match="non-empty"):
        aggregated_page_size_bytes([])


# ------------------------------------------------------------- free order, layer names
def test_split_for_free_keeps_order_within_each_side():
    split = split_for_free([5, 4, 3, 2, 1], is_cached=lambda block: block % 2 == 1)
    assert split.to_front == [4, 2]
    assert split.to_back == [5, 3, 1]


def test_layer_name_mismatch_lists_missing_and_extra():
    check_layer_names({"a": 1, "b": 2}, ["b", "a"])
    with pytest.raises(LayerNameMismatchError) as error:
        check_layer_names({"a": 1, "z": 2}, ["a", "b", "c"])
    assert error.value.missing == ["b", "c"] and error.value.extra == ["z"]
    assert "missing tensors for 2 layer(s) ['b', 'c']" in str(error.value)
    assert "tensors without a spec for 1 layer(s) ['z']" in str(error.value)
