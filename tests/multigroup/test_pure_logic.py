"""Pure multi-group logic: specs, state policy, tracker, slicing, slot mappings."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.flags import flag_value
from lmcache_ascend.multigroup.connector_state import (
    MultiGroupConfigError,
    check_chunk_size,
    check_discard_partial_chunks,
    kv_groups_for_connector,
    policy_for_config,
)
from lmcache_ascend.multigroup.slicing import (
    group_block_range,
    prefix_bound_in_vllm_blocks,
)
from lmcache_ascend.kv_worker.errors import KVCacheShapeError
from lmcache_ascend.kv_worker import device_slots as slot_module
from lmcache_ascend.kv_worker.device_slots import DeviceSlots
from lmcache_ascend.multigroup.attachments import STEP_BLOCK_IDS, Attachment
from lmcache_ascend.multigroup.slots import GeometryMismatchError, StepBlockIds, step_block_ids
from lmcache_ascend.multigroup.specs import (
    KVGroupSpec,
    KVGroups,
    geometry_digest,
    kv_groups_from_specs,
)
from lmcache_ascend.multigroup.state_skip import (
    DEFAULT_STATE_SPEC_CLASS_NAMES,
    StateGroupPolicy,
    policy_from_values,
)
from lmcache_ascend.multigroup.tracker import GroupBlockTracker, unpack_block_ids
from tests.fixtures.kv_cache_configs import dsv4_cuda_kv_cache_config
from tests.multigroup.cpu_slots import build_group_slot_mappings, raw_slot_mapping_for_group, rows_in_chunk_windows
from tests.multigroup.reference import reference_load_slots, reference_raw_slots, reference_store_slots

CUDA_BLOCK_SIZES = (256, 64, 64, 4, 8)


def block_counts_for_tokens(num_tokens, group_block_sizes, vllm_block_size):
    """Blocks per group covering the whole vLLM blocks of `num_tokens` tokens (by the slice rule)."""
    end_vllm_block = num_tokens // vllm_block_size
    return tuple(group_block_range(0, end_vllm_block, size, vllm_block_size)[1] for size in group_block_sizes)


def policy_from_environment(environ):
    """The state-group policy from the flag table, read as the connector reads it."""
    return policy_from_values(
        flag_value("LMCACHE_ASCEND_SKIP_STATE_GROUPS", environ),
        flag_value("LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST", environ),
    )


# ----------------------------------------------------------------- slicing (seed 001)
def test_seed_numbers_4096_tokens_per_group_block_counts():
    assert block_counts_for_tokens(4096, CUDA_BLOCK_SIZES, 4) == (16, 64, 64, 1024, 512)


def test_slice_rule_divides_for_larger_and_multiplies_for_smaller_group_blocks():
    assert group_block_range(8, 1024, 256, 4) == (0, 16)
    assert group_block_range(64, 128, 8, 4) == (32, 64)
    assert group_block_range(3, 5, 4, 16) == (12, 20)  # group blocks smaller than vLLM's
    assert group_block_range(3, 5, 16, 16) == (3, 5)


def test_prefix_bound_counts_a_missing_group_as_zero():
    sizes = dict(enumerate(CUDA_BLOCK_SIZES))
    full = dict(enumerate((16, 64, 64, 1024, 512)))
    assert prefix_bound_in_vllm_blocks(full, sizes, 4) == 1024
    missing_group_3 = {g: n for g, n in full.items() if g != 3}
    assert prefix_bound_in_vllm_blocks(missing_group_3, sizes, 4) == 0
    short_group_0 = {**full, 0: 10}
    assert prefix_bound_in_vllm_blocks(short_group_0, sizes, 4) == 640


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: group_block_range(0, 4, 6, 4), "must divide one another"),
        (lambda: group_block_range(5, 4, 8, 4), "need 0 <= start <= end"),
        (lambda: prefix_bound_in_vllm_blocks({0: 1}, {}, 4), "at least one KV-cache group"),
        (lambda: prefix_bound_in_vllm_blocks({7: 1}, {0: 4}, 4), "unknown groups"),
    ],
)
def test_slicing_rejects_bad_input_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@settings(max_examples=300, deadline=None)
@given(
    vllm_exp=st.integers(0, 5),
    group_exp=st.integers(0, 9),
    start=st.integers(0, 2000),
    length=st.integers(0, 2000),
)
def test_slice_rule_matches_token_arithmetic(vllm_exp, group_exp, start, length):
    vllm_bs, group_bs = 2**vllm_exp, 2**group_exp
    end = start + length
    got = group_block_range(start, end, group_bs, vllm_bs)
    # Reference: convert to tokens and count whole group blocks from token 0.
    assert got == (start * vllm_bs // group_bs, end * vllm_bs // group_bs)


# ------------------------------------------------------------------------ specs / policy
def test_group_spec_validation_names_the_bad_attribute():
    with pytest.raises(ValueError, match="block_size=0"):
        KVGroupSpec(2, "X", 0)
    with pytest.raises(ValueError, match="compress_ratio=3"):
        KVGroupSpec(2, "X", 128, compress_ratio=3)
    with pytest.raises(ValueError, match="sliding_window=-1"):
        KVGroupSpec(2, "X", 128, sliding_window=-1)
    spec = KVGroupSpec(1, "C4", 512, compress_ratio=4, sliding_window=128)
    assert (spec.rows_per_block, spec.num_rows(1001)) == (128, 251)


def test_layout_rejects_groups_out_of_order_and_all_skipped():
    groups = (KVGroupSpec(1, "A", 16), KVGroupSpec(0, "B", 16))
    with pytest.raises(ValueError, match="vLLM's order"):
        KVGroups(groups, 16)
    only_state = (KVGroupSpec(0, "C4AttnKVState", 16, is_state=True),)
    with pytest.raises(ValueError, match="every KV-cache group would be skipped"):
        kv_groups_from_specs(only_state, 16, StateGroupPolicy(skip_state_groups=True))


def test_state_policy_default_allowlist_and_switch():
    assert "C4IndexerKV" not in DEFAULT_STATE_SPEC_CLASS_NAMES
    assert {name for name in DEFAULT_STATE_SPEC_CLASS_NAMES if name.endswith("State")} == {
        "C4AttnKVState", "C4AttnScoreState", "C4IndexerKVState", "C4IndexerScoreState", "C128AttnKVState",
        "C128AttnScoreState",
    }
    # Moved by default: a resumed DeepSeek-V4 prefill reads compressor state from before the chunk boundary.
    default = policy_from_environment({})
    assert not default.skip_state_groups and default.state_spec_class_names == DEFAULT_STATE_SPEC_CLASS_NAMES
    assert default == StateGroupPolicy()
    custom = policy_from_environment({"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST": "C4AttnKVState, C128AttnKVState"})
    assert custom.state_spec_class_names == frozenset({"C4AttnKVState", "C128AttnKVState"})
    # A misspelt name would leave every other state group moved: refused, naming it.
    with pytest.raises(ValueError, match="names C4AttnKVStat, which is no known KV-cache spec type"):
        policy_from_environment({"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST": "C4AttnKVStat, C128AttnKVState"})
    on = policy_from_environment({"LMCACHE_ASCEND_SKIP_STATE_GROUPS": "1"})
    assert on.skip_state_groups and on.state_spec_class_names == DEFAULT_STATE_SPEC_CLASS_NAMES
    with pytest.raises(ValueError, match="LMCACHE_ASCEND_SKIP_STATE_GROUPS='maybe'"):
        policy_from_environment({"LMCACHE_ASCEND_SKIP_STATE_GROUPS": "maybe"})
    with pytest.raises(ValueError, match="LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"):
        policy_from_values(True, ("not a name",))


def test_flag_beats_lmcache_config_value(monkeypatch):
    class Config:
        ascend_skip_state_groups = True
        ascend_skip_state_spec_allowlist = ("C128AttnKVState",)

    monkeypatch.delenv("LMCACHE_ASCEND_SKIP_STATE_GROUPS", raising=False)
    monkeypatch.delenv("LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST", raising=False)
    assert policy_for_config(Config()) == StateGroupPolicy(True, frozenset({"C128AttnKVState"}))
    monkeypatch.setenv("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "0")
    assert flag_value("LMCACHE_ASCEND_SKIP_STATE_GROUPS", lmcache_config=Config()) is False
    assert policy_for_config(None) == StateGroupPolicy()


def test_config_checks_name_the_settings():
    kv_groups = kv_groups_from_specs((KVGroupSpec(0, "A", 512, 4), KVGroupSpec(1, "B", 512, 128)), 128, StateGroupPolicy())
    with pytest.raises(MultiGroupConfigError, match="discard_partial_chunks.*save_unfull_chunk"):
        check_discard_partial_chunks(kv_groups, False)
    check_discard_partial_chunks(kv_groups, True)
    with pytest.raises(MultiGroupConfigError, match="chunk_size=192 is not a multiple of compress_ratio=128"):
        check_chunk_size(kv_groups, 192)
    check_chunk_size(kv_groups, 256)


# ----------------------------------------------------------------------------- tracker
def test_tracker_follows_new_cached_and_resumed_requests():
    tracker = GroupBlockTracker.for_new_request(([1, 2], [0, 5], []), 3)
    tracker.append_new_blocks(([3], None, [9]))
    tracker.append_new_blocks(None)
    assert tracker.block_id_lists() == [[1, 2, 3], [0, 5], [9]]
    # A resumed request's fresh table is a new tracker (adapter_scheduler._resume).
    tracker = GroupBlockTracker.for_new_request(([7], [8], [0, 10]), 3)
    assert tracker.block_id_lists() == [[7], [8], [0, 10]]
    assert tracker.num_blocks_by_group() == (1, 1, 2)


def test_tracker_copies_vllm_lists_and_rejects_wrong_group_counts():
    source = ([1, 2], [3])
    tracker = GroupBlockTracker.for_new_request(source, 2)
    source[0].append(99)
    assert tracker.block_id_lists()[0] == [1, 2]
    with pytest.raises(ValueError, match="block ids for 1 KV-cache groups, expected 2"):
        tracker.append_new_blocks(([4],))
    with pytest.raises(ValueError, match="flat list of 2 block ids but the model has 2"):
        tracker.append_new_blocks([4, 5])
    single = GroupBlockTracker.for_new_request([4, 5], 1)
    assert single.block_id_lists() == [[4, 5]]


# ------------------------------------------------------------------------ slot mappings
CPU = torch.device("cpu")
_REAL_EXPAND = slot_module._expand_block_ids  # the real one, while `_resolved` wraps it


def _kv_groups(*groups: KVGroupSpec) -> KVGroups:
    return kv_groups_from_specs(groups, 4, StateGroupPolicy())


def _expand_poisoned(block_ids, groups, out):
    """The expansion into a poisoned output: every row must be written."""
    out[:] = -7
    _REAL_EXPAND(block_ids, groups, out)
    assert -7 not in out.tolist()


def _resolved(step: StepBlockIds, kv_groups: KVGroups, cached_tokens: int = 0) -> dict[int, list[int]]:
    """What a worker with `layout` resolves from the shipped block ids, per group (CPU device)."""
    slot_module._expand_block_ids = _expand_poisoned
    try:
        device_slots = DeviceSlots.from_block_ids(step, kv_groups, CPU, cached_tokens)
    finally:
        slot_module._expand_block_ids = _REAL_EXPAND
    flat = device_slots.slots.tolist()
    assert len({g for g, _ in device_slots.offsets}) == len(device_slots.offsets)  # one compress ratio per group here
    return {g: flat[device_slots.offsets[g, ratio] : device_slots.offsets[g, ratio] + device_slots.lengths[g, ratio]]
            for g, ratio in device_slots.offsets}


def _store_rows(step: StepBlockIds, kv_groups: KVGroups, group: int, slots: list[int]) -> list[int]:
    """`slots` with the rows no chunk stores (`chunk_row_window`) set to -1."""
    keep = rows_in_chunk_windows(kv_groups.groups[group], len(slots), step.chunk_size)
    return [slot if kept else -1 for slot, kept in zip(slots, keep)]


def test_oracle_raw_slots_compressed_group_with_null_block_row_by_row():
    group = KVGroupSpec(0, "C4AttnKV", block_size=16, compress_ratio=4)  # 4 rows per block
    slots = raw_slot_mapping_for_group(group, [5, 0, 9], 37)  # ceil(37/4)=10 rows
    assert slots.dtype == torch.long
    assert slots.tolist() == [20, 21, 22, 23, -1, -1, -1, -1, 36, 37]


def test_step_block_ids_need_enough_blocks():
    kv_groups = _kv_groups(KVGroupSpec(0, "Full", block_size=16), KVGroupSpec(1, "Full", block_size=16))
    tracker = GroupBlockTracker.for_new_request(([1, 2, 3], [1, 2]), 2)
    with pytest.raises(ValueError, match="group 1 .*33 tokens need 3 blocks of 16 tokens but only 2"):
        step_block_ids(kv_groups, tracker, 33, 16)


def test_step_block_ids_ship_compact_numpy_ids_and_resolve_per_direction():
    # The state group is skipped on request, so the step also shows a group that ships nothing.
    groups = (
        KVGroupSpec(0, "C4AttnKV", 16, 4),
        KVGroupSpec(1, "C4AttnKVState", 4, is_state=True),
        KVGroupSpec(2, "SWA", 8, 1, sliding_window=4),
    )
    kv_groups = kv_groups_from_specs(groups, 4, StateGroupPolicy(skip_state_groups=True))
    tracker = GroupBlockTracker.for_new_request(([1, 2, 9], [3, 4, 5, 6], [7, 8, 9, 10, 11]), 3)
    step = step_block_ids(kv_groups, tracker, num_tokens=32, chunk_size=16, vllm_cached_tokens=8)
    assert step.transferred_groups(kv_groups) == (0, 2)
    # Only the blocks 32 tokens occupy, of transferred groups, packed in one bytes object of int64s.
    assert isinstance(step.packed_block_ids, bytes) and len(step.packed_block_ids) == 6 * 8
    assert isinstance(step.block_ids, np.ndarray) and step.block_ids.dtype == np.int64
    assert step.block_ids.tolist() == [1, 2, 7, 8, 9, 10]
    assert {g: ids.tolist() for g, ids in step.group_block_ids(kv_groups).items()} == {0: [1, 2], 2: [7, 8, 9, 10]}
    store, load = _resolved(step, kv_groups), _resolved(step, kv_groups, step.vllm_cached_tokens)
    assert set(store) == {0, 2}
    assert store[0] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert load[0] == [-1, -1, 6, 7, 8, 9, 10, 11]
    # Window of 4 tokens at the end of each 16-token chunk (tokens 12..15 and 28..31),
    # widened to the 8-token blocks holding them: tokens 8..15 and 24..31.
    assert store[2] == list(range(56, 88))
    assert _store_rows(step, kv_groups, 2, store[2]) == [-1] * 8 + list(range(64, 72)) + [-1] * 8 + list(range(80, 88))
    assert load[2] == [-1] * 8 + list(range(64, 88))
    # What ships is read-only (the tracker builds the next step's array on it) and the tracker's ids stay.
    with pytest.raises(ValueError, match="read-only"):
        step.block_ids[0] = 99
    assert tracker.block_id_lists()[0] == [1, 2, 9] and step.block_ids.tolist() == [1, 2, 7, 8, 9, 10]


def test_packed_block_ids_follow_every_table_change():
    tracker = GroupBlockTracker.for_new_request(([1, 2], [3, 4, 5], [6]), 3)

    def ids(groups, counts) -> list[int]:
        return unpack_block_ids(tracker.packed_block_ids(groups, counts)).tolist()

    first = tracker.packed_block_ids((0, 1), (2, 2))
    assert unpack_block_ids(first).tolist() == [1, 2, 3, 4] and not unpack_block_ids(first).flags.writeable
    assert first == struct.pack("<4q", 1, 2, 3, 4)  # the wire format: little-endian int64s
    big = 2**40 + 7  # ids past 32 bits keep every byte
    tracker.append_new_blocks(([big], [], []))
    assert ids((0,), (3,)) == [1, 2, big]
    tracker = GroupBlockTracker.for_new_request(([1, 2], [3, 4, 5], [6]), 3)
    tracker.append_new_blocks(([7], [8], []))
    assert ids((0, 1), (3, 4)) == [1, 2, 7, 3, 4, 5, 8]
    assert unpack_block_ids(first).tolist() == [1, 2, 3, 4]  # the earlier step's bytes are left as they were
    # Fewer blocks than last time (a rolled-back request), other groups, then a new table.
    assert ids((0, 1), (1, 2)) == [1, 3, 4]
    assert ids((0, 1), (2, 4)) == [1, 2, 3, 4, 5, 8]
    assert ids((1, 2), (3, 1)) == [3, 4, 5, 6]
    tracker = GroupBlockTracker.for_new_request(([20, 21, 22], [23, 24, 25, 26], [27]), 3)
    assert ids((1, 2), (3, 1)) == [23, 24, 25, 27]
    assert ids((0, 1, 2), (0, 0, 0)) == []
    with pytest.raises(ValueError, match=r"counts \(4, 1\) of groups \(0, 2\) exceed the tracked blocks \(3, 4, 1\)"):
        tracker.packed_block_ids((0, 2), (4, 1))
    with pytest.raises(ValueError, match=r"counts \(3, 5\) of groups \(0, 1\) exceed the tracked blocks"):
        tracker.packed_block_ids((0, 1), (3, 5))  # a short group before a full one


def test_step_block_ids_attachment_reads_the_documented_attribute():
    class Meta:
        pass

    meta = Meta()
    assert STEP_BLOCK_IDS.get(meta) is None
    value = StepBlockIds(0, b"", 0, 256)
    STEP_BLOCK_IDS.set(meta, value)
    assert STEP_BLOCK_IDS.get(meta) is value and vars(meta) == {"ascend_step_block_ids": value}


def test_an_attachment_name_must_be_ours():
    """Attachments are read with plain attribute access, so a name upstream could use is refused."""
    with pytest.raises(ValueError, match=r"attachment name 'block_ids' is not allowed; it must start with one of"):
        Attachment("block_ids", "anything")
    for name in ("ascend_x", "_ascend_x", "lmcache_ascend_x"):
        assert Attachment(name, "anything").name == name


def test_device_slots_refuse_ids_made_for_other_groups_or_of_the_wrong_length():
    kv_groups = _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "C4", 16, 4))
    tracker = GroupBlockTracker.for_new_request(([1, 2], [3]), 2)
    step = step_block_ids(kv_groups, tracker, 16, 16)
    mismatch = "KV-cache group geometry .* differs between scheduler and worker"
    for other in (
        _kv_groups(KVGroupSpec(0, "Full", 8)),  # a group fewer
        _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "C4", 32, 4)),  # another block size
        _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "C4", 16, 4, sliding_window=16)),  # a window
    ):
        with pytest.raises(GeometryMismatchError, match=f"{step.geometry_digest:016x} .*{other.geometry_digest:016x}.*{mismatch}"):
            DeviceSlots.from_block_ids(step, other, CPU)
        with pytest.raises(GeometryMismatchError, match=mismatch):
            step.first_storable_token(other)
    # A worker that sees the group's layers compress at ratios 4 and 16 (vLLM's scheduler saw one layer's
    # spec) takes the same ids: one slot mapping per ratio, each from the group's one list of ids.
    worker = _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "C4", 16, 4, layer_ratios=(("a", 4), ("b", 16))))
    slots = DeviceSlots.from_block_ids(step, worker, CPU)
    assert dict(slots.offsets) == {(0, 1): 0, (1, 4): 16, (1, 16): 20}
    assert slots.slots.tolist() == [*range(8, 24), 12, 13, 14, 15, 3]
    assert step.first_storable_token(worker) == 0
    short = StepBlockIds(kv_groups.geometry_digest, step.packed_block_ids[:-8], 16, 16)
    with pytest.raises(ValueError, match="carries 2 block ids; its 2 transferred groups need 3 for 16 tokens"):
        DeviceSlots.from_block_ids(short, kv_groups, CPU)
    torn = StepBlockIds(kv_groups.geometry_digest, step.packed_block_ids[:-4], 16, 16)  # not whole ids
    with pytest.raises(ValueError, match="carries 2.5 block ids; its 2 transferred groups need 3"):
        DeviceSlots.from_block_ids(torn, kv_groups, CPU)
    with pytest.raises(ValueError, match="carries 2.5 block ids"):
        torn.group_block_ids(kv_groups)


def test_geometry_digest_is_fixed_by_the_group_fields_alone():
    groups = (KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "SWA", 8, sliding_window=16), KVGroupSpec(2, "C4", 16, 4))
    kv_groups = _kv_groups(*groups)
    # The same groups in another process, another order or another layout object: the same digest.
    assert _kv_groups(*groups).geometry_digest == kv_groups.geometry_digest == geometry_digest(reversed(kv_groups.groups))
    script = (
        "from lmcache_ascend.multigroup.specs import KVGroupSpec, kv_groups_from_specs;"
        "from lmcache_ascend.multigroup.state_skip import StateGroupPolicy;"
        "print(kv_groups_from_specs((KVGroupSpec(0, 'Full', 8), KVGroupSpec(1, 'SWA', 8, sliding_window=16),"
        " KVGroupSpec(2, 'C4', 16, 4)), 4, StateGroupPolicy()).geometry_digest)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other_process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert int(other_process.stdout) == kv_groups.geometry_digest
    assert 0 <= kv_groups.geometry_digest < 2**64
    # Any field that the shipped ids depend on changes it, the vLLM block size (not a group field) does not.
    changed = [
        (KVGroupSpec(0, "Full", 16), *groups[1:]),
        (KVGroupSpec(0, "Other", 8), *groups[1:]),
        (groups[0], KVGroupSpec(1, "SWA", 8, sliding_window=8), groups[2]),
        (groups[0], KVGroupSpec(1, "SWA", 8, 2, sliding_window=16), groups[2]),  # a window's tail rows: its ratio
        (*groups[:2], KVGroupSpec(2, "C4", 16, 4, is_state=True)),
    ]
    digests = {kv_groups.geometry_digest} | {_kv_groups(*other).geometry_digest for other in changed}
    assert len(digests) == len(changed) + 1
    assert kv_groups_from_specs(groups, 8, StateGroupPolicy()).geometry_digest == kv_groups.geometry_digest
    # A group without a window ships ceil(tokens / block_size) ids whatever its layers' ratios: vLLM's
    # scheduler sees one layer's spec of a group whose layers compress at several ratios, its workers all.
    scheduler_view = (*groups[:2], KVGroupSpec(2, "C4", 16, 4))
    worker_view = (*groups[:2], KVGroupSpec(2, "C4", 16, 4, layer_ratios=(("a", 4), ("b", 16), ("c", 4))))
    assert _kv_groups(*scheduler_view).geometry_digest == _kv_groups(*worker_view).geometry_digest
    assert _kv_groups(*groups[:2], KVGroupSpec(2, "C4", 16, 8)).geometry_digest == kv_groups.geometry_digest


@dataclass(frozen=True)
class _StepBlockIdsWithGroups:
    """What a step's block ids were before the digest: the same fields with the groups' specs shipped."""

    groups: tuple
    packed_block_ids: bytes
    num_tokens: int
    chunk_size: int
    vllm_cached_tokens: int = 0


def test_pickled_step_block_ids_carry_a_digest_not_the_groups():
    """DeepSeek-V4's five CUDA groups: the groups' specs no longer travel with every request and step."""
    fixture = dsv4_cuda_kv_cache_config()
    kv_groups = kv_groups_for_connector(fixture.kv_cache_config, fixture.vllm_block_size, None)
    assert kv_groups.num_groups == 5
    tables = tuple(list(range(1000 * g + 1, 1000 * g + 1 + -(-1024 // b))) for g, b in enumerate(kv_groups.block_sizes))
    step = step_block_ids(kv_groups, GroupBlockTracker.for_new_request(tables, 5), 1024, 256)
    payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    before = pickle.dumps(
        _StepBlockIdsWithGroups(kv_groups.groups, step.packed_block_ids, step.num_tokens, step.chunk_size),
        protocol=pickle.HIGHEST_PROTOCOL,
    )
    assert len(before) - len(payload) > 300, (len(payload), len(before))  # the specs of five groups
    for name in (b"KVGroupSpec", b"FullAttentionSpec", b"SlidingWindowSpec", b"compress_ratio", b"sliding_window"):
        assert name not in payload and name in before
    restored = pickle.loads(payload)
    assert restored == step and restored.geometry_digest == kv_groups.geometry_digest
    assert restored.group_block_counts(kv_groups) == {0: 4, 1: 16, 2: 16, 3: 256, 4: 128}


def test_device_slots_of_nothing_hold_one_skipped_slot():
    kv_groups = _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "Full", 8))
    step = step_block_ids(kv_groups, GroupBlockTracker.for_new_request(([], []), 2), 0, 16)
    slots = DeviceSlots.from_block_ids(step, kv_groups, CPU)
    assert slots.slots.tolist() == [-1] and dict(slots.lengths) == {(0, 1): 0, (1, 1): 0}


def test_many_requests_resolve_in_one_upload_each_as_it_would_alone():
    """`DeviceSlots.for_requests`: one tensor for a step's requests; each request's slots (a view
    of it) equal what `from_block_ids` resolves for it alone, with its own cached prefix."""
    kv_groups = _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "C4", 16, 4), KVGroupSpec(2, "SW", 8, 1, 8))
    steps = {
        ("a", True): (step_block_ids(kv_groups, GroupBlockTracker.for_new_request(([1, 2, 3], [4, 10], [5, 6, 7]), 3), 20, 16), 0),
        ("a", False): (step_block_ids(kv_groups, GroupBlockTracker.for_new_request(([1, 2, 3], [4, 10], [5, 6, 7]), 3), 20, 16), 9),
        ("empty", True): (step_block_ids(kv_groups, GroupBlockTracker.for_new_request(([], [], []), 3), 0, 16), 0),
        ("b", True): (step_block_ids(kv_groups, GroupBlockTracker.for_new_request(([9, 0], [8], [0, 3]), 3), 16, 16), 0),
    }
    together = DeviceSlots.for_requests(steps, kv_groups, CPU)
    assert list(together) == list(steps)
    storages = {slots.slots.untyped_storage().data_ptr() for slots in together.values()}
    assert len(storages) == 1  # one upload
    for key, (step, cached) in steps.items():
        alone = DeviceSlots.from_block_ids(step, kv_groups, CPU, cached)
        assert together[key].slots.tolist() == alone.slots.tolist(), key
        assert (dict(together[key].offsets), dict(together[key].lengths)) == (dict(alone.offsets), dict(alone.lengths))
    assert together[("a", False)].slots.tolist() != together[("a", True)].slots.tolist()  # the load masks its prefix
    assert DeviceSlots.for_requests({}, kv_groups, CPU) == {}


@st.composite
def _group_case(draw, index=0):
    compress_ratio = 2 ** draw(st.integers(0, 7))
    rows_per_block = 2 ** draw(st.integers(0, 6))
    block_size = compress_ratio * rows_per_block
    # A window is whole rows (KVGroupSpec refuses any other).
    sliding_window = draw(st.one_of(st.none(), st.integers(1, max(1, 600 // compress_ratio)).map(lambda rows: rows * compress_ratio)))
    transferred = index == 0 or draw(st.booleans())
    return KVGroupSpec(index, "G", block_size, compress_ratio, sliding_window, is_state=not transferred)


@st.composite
def _request_case(draw):
    groups = [draw(_group_case(index)) for index in range(draw(st.integers(1, 4)))]
    largest_ratio = max(group.compress_ratio for group in groups)
    chunk_size = largest_ratio * 2 ** draw(st.integers(0, 4)) * draw(st.sampled_from([1, 2, 4]))
    num_tokens = draw(st.integers(0, 3000))
    tables = []
    for group in groups:
        num_blocks = group.num_blocks(num_tokens) + draw(st.integers(0, 2))
        tables.append(draw(st.lists(st.integers(0, 500), min_size=num_blocks, max_size=num_blocks)))
    vllm_cached = draw(st.integers(0, num_tokens))
    return tuple(groups), chunk_size, num_tokens, tables, vllm_cached


def _hole_chunks_reference(step: StepBlockIds, kv_groups: KVGroups, tables) -> tuple[int, ...]:
    """Chunks with a row a store keeps (row-by-row window reference) on a null block."""
    holes = set()
    for g in step.transferred_groups(kv_groups):
        group = kv_groups.groups[g]
        args = (group.block_size, group.compress_ratio)
        null_rows = reference_raw_slots(*args, tables[g], step.num_tokens)
        no_nulls = [block + 1000 for block in tables[g]]
        kept = reference_store_slots(*args, group.sliding_window, no_nulls, step.num_tokens, step.chunk_size)
        for row, (slot, keep) in enumerate(zip(null_rows, kept)):
            if slot == -1 and keep != -1:
                holes.add(row * group.compress_ratio // step.chunk_size)
    return tuple(sorted(holes))


@settings(max_examples=400, deadline=None)
@given(_request_case())
def test_device_resolution_matches_row_by_row_reference_and_the_cpu_builder(case):
    groups, chunk_size, num_tokens, tables, vllm_cached = case
    kv_groups = kv_groups_from_specs(groups, 1, StateGroupPolicy())
    tracker = GroupBlockTracker.for_new_request(tuple(tables), len(groups))
    step = step_block_ids(kv_groups, tracker, num_tokens, chunk_size, vllm_cached)
    oracle = build_group_slot_mappings(kv_groups, tracker, num_tokens, chunk_size, vllm_cached)
    store, load = _resolved(step, kv_groups), _resolved(step, kv_groups, vllm_cached)
    assert step.transferred_groups(kv_groups) == oracle.transferred_groups == tuple(store) == tuple(load)
    for g in step.transferred_groups(kv_groups):
        group = groups[g]
        args = (group.block_size, group.compress_ratio)
        # Every element: device resolution == row-by-row reference == the old CPU builder.
        assert store[g] == reference_raw_slots(*args, tables[g], num_tokens) == oracle.slot_mappings[g].tolist()
        assert load[g] == reference_load_slots(*args, tables[g], num_tokens, vllm_cached)
        assert load[g] == oracle.load_slot_mapping(g).tolist()
        assert _store_rows(step, kv_groups, g, store[g]) == reference_store_slots(
            *args, group.sliding_window, tables[g], num_tokens, chunk_size
        ) == oracle.store_slot_mapping(g).tolist()
    assert step.store_hole_chunks(kv_groups) == _hole_chunks_reference(step, kv_groups, tables)
    holes = step.store_hole_chunks(kv_groups)
    assert step.first_storable_token(kv_groups) == (min(num_tokens, (holes[-1] + 1) * chunk_size) if holes else 0)


@settings(max_examples=150, deadline=None)
@given(
    rows_per_block=st.sampled_from([1, 2, 8, 32]),
    compress_ratio=st.sampled_from([1, 4, 128]),
    steps=st.lists(st.lists(st.integers(0, 300), max_size=6), min_size=1, max_size=6),
    reset_at=st.integers(0, 6),
)
def test_shipped_ids_follow_appends_and_resets(rows_per_block, compress_ratio, steps, reset_at):
    block_size = rows_per_block * compress_ratio
    kv_groups = kv_groups_from_specs((KVGroupSpec(0, "G", block_size, compress_ratio),), 1, StateGroupPolicy())
    tracker = GroupBlockTracker.for_new_request(([],), 1)
    for index, new_ids in enumerate(steps):
        if index == reset_at:
            tracker = GroupBlockTracker.for_new_request((list(reversed(tracker.block_ids_by_group[0])),), 1)
        tracker.append_new_blocks((new_ids,))
        ids = tracker.block_id_lists()[0]
        for num_tokens in {0, len(ids) * block_size // 2, len(ids) * block_size}:
            step = step_block_ids(kv_groups, tracker, num_tokens, 1024)
            assert step.block_ids.tolist() == ids[: kv_groups.groups[0].num_blocks(num_tokens)]
            assert _resolved(step, kv_groups)[0] == reference_raw_slots(block_size, compress_ratio, ids, num_tokens)


def test_store_hole_chunks_names_chunks_with_null_rows_that_must_be_stored():
    kv_groups = _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "SWA", 8, sliding_window=8))
    # Group 1 lost blocks 0 and 2 to the null block: block 0 (tokens 0..7) is
    # outside chunk 0's window (tokens 8..15), block 2 (16..23) is outside
    # chunk 1's window (24..31), so neither is a hole; group 0's null block 3
    # (tokens 24..31) is one, in chunk 1.
    tracker = GroupBlockTracker.for_new_request(([1, 2, 3, 0], [0, 5, 0, 7]), 2)
    assert step_block_ids(kv_groups, tracker, num_tokens=32, chunk_size=16).store_hole_chunks(kv_groups) == (1,)
    tracker = GroupBlockTracker.for_new_request(([1, 2, 3, 4], [0, 0, 6, 7]), 2)
    assert step_block_ids(kv_groups, tracker, 32, 16).store_hole_chunks(kv_groups) == (0,)
    tracker = GroupBlockTracker.for_new_request(([1, 2, 3, 4], [0, 5, 0, 7]), 2)
    assert step_block_ids(kv_groups, tracker, 32, 16).store_hole_chunks(kv_groups) == ()


def test_first_storable_token_skips_past_the_last_hole_chunk():
    kv_groups = _kv_groups(KVGroupSpec(0, "Full", 8), KVGroupSpec(1, "SWA", 8, sliding_window=8))
    # Hole in chunk 1 (group 0's null block 3): nothing before token 32 may be stored.
    tracker = GroupBlockTracker.for_new_request(([1, 2, 3, 0], [0, 5, 0, 7]), 2)
    assert step_block_ids(kv_groups, tracker, 32, 16).first_storable_token(kv_groups) == 32
    # Hole in chunk 0 only: chunk 1 may still be stored.
    tracker = GroupBlockTracker.for_new_request(([1, 2, 3, 4], [0, 0, 6, 7]), 2)
    assert step_block_ids(kv_groups, tracker, 32, 16).first_storable_token(kv_groups) == 16
    # No hole: everything may be stored.
    tracker = GroupBlockTracker.for_new_request(([1, 2, 3, 4], [0, 5, 0, 7]), 2)
    assert step_block_ids(kv_groups, tracker, 32, 16).first_storable_token(kv_groups) == 0
