"""LMCache's real in-process adapter, scheduler side, with and without the multi-group patch.

Real vLLM SchedulerOutput / NewRequestData / CachedRequestData / Request objects
drive LMCache's real LMCacheConnectorV1Impl.build_connector_meta over a whole
request life (chunked prefill, decode, preemption + load, finish); every row of
every group's slot mapping is compared with the row-at-a-time reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_ascend.kv_worker.device_slots import DeviceSlots
from lmcache_ascend.multigroup.attachments import CONNECTOR_GROUPS, SCHEDULER_STATE, STEP_BLOCK_IDS
from lmcache_ascend.multigroup.connector_state import MultiGroupConfigError, kv_groups_for_connector
from lmcache_ascend.patches import State, registry
from tests.fixtures.kv_cache_configs import (
    DSV4_ASCEND_STATE_GROUPS,
    dsv4_ascend_kv_cache_config,
    dsv4_cuda_kv_cache_config,
    full_and_sliding_window_kv_cache_config,
    single_group_kv_cache_config,
)
from tests.multigroup.cpu_slots import rows_in_chunk_windows
from tests.multigroup.reference import reference_load_slots, reference_raw_slots, reference_store_slots
from tests.multigroup.scheduler_driver import RequestDriver, make_connector_impl
from tests.patching import apply_now

REGISTRY = registry.process_registry()
PATCH = "lmcache-adapter-multigroup"
STATE_GROUPS = {index for index, _ in DSV4_ASCEND_STATE_GROUPS}


@pytest.fixture
def patched():
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    yield
    assert REGISTRY.revert(PATCH) is State.REVERTED


def _specs(fixture):
    """(block_size, compress_ratio, sliding_window) per group, read off the real specs."""
    out = []
    for group in fixture.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        inner = next(iter(spec.kv_cache_specs.values())) if hasattr(spec, "kv_cache_specs") else spec
        out.append((spec.block_size, getattr(inner, "compress_ratio", 1), getattr(inner, "sliding_window", None)))
    return out


def _kv_groups_of(fixture):
    """The groups a worker builds from the fixture's KV-cache config (the scheduler's, rebuilt)."""
    return kv_groups_for_connector(fixture.kv_cache_config, fixture.vllm_block_size, None)


def _block_tracker(impl, req_id):
    """The connector's `GroupBlockTracker` of a request (kept beside upstream's RequestTracker)."""
    return SCHEDULER_STATE.get(impl).block_trackers[req_id]


def _resolve(step, kv_groups, cached_tokens=0):
    """Per group, the slots a worker with `kv_groups` resolves from the shipped block ids (CPU device)."""
    device_slots = DeviceSlots.from_block_ids(step, kv_groups, torch.device("cpu"), cached_tokens)
    flat = device_slots.slots.tolist()
    assert len({g for g, _ in device_slots.offsets}) == len(device_slots.offsets)  # one compress ratio per group here
    return {g: flat[device_slots.offsets[g, ratio] : device_slots.offsets[g, ratio] + device_slots.lengths[g, ratio]]
            for g, ratio in device_slots.offsets}


def _assert_rows(meta, fixture, block_ids_by_group, chunk_size=256, vllm_cached=0, skipped=frozenset()):
    step = STEP_BLOCK_IDS.get(meta)
    assert step is not None
    num_tokens = len(meta.token_ids)
    assert step.num_tokens == num_tokens and step.chunk_size == chunk_size
    assert step.vllm_cached_tokens == vllm_cached
    assert isinstance(step.packed_block_ids, bytes)  # what is pickled to the workers
    assert isinstance(step.block_ids, np.ndarray) and step.block_ids.dtype == np.int64
    kv_groups = _kv_groups_of(fixture)
    assert step.geometry_digest == kv_groups.geometry_digest
    store, load = _resolve(step, kv_groups), _resolve(step, kv_groups, step.vllm_cached_tokens)
    for group, (block_size, ratio, window) in enumerate(_specs(fixture)):
        if group in skipped:
            assert group not in store and group not in step.group_block_ids(kv_groups)
            continue
        ids = block_ids_by_group[group]
        assert step.group_block_ids(kv_groups)[group].tolist() == ids[: kv_groups.groups[group].num_blocks(num_tokens)]
        assert store[group] == reference_raw_slots(block_size, ratio, ids, num_tokens)
        keep = rows_in_chunk_windows(kv_groups.groups[group], len(store[group]), chunk_size)
        assert [slot if kept else -1 for slot, kept in zip(store[group], keep)] == reference_store_slots(
            block_size, ratio, window, ids, num_tokens, chunk_size
        )
        assert load[group] == reference_load_slots(block_size, ratio, ids, num_tokens, vllm_cached)
    return step, store, load


def _dsv4_tables(first: int, num_tokens: int, one_state_block: bool = False) -> tuple[list[int], ...]:
    """Block tables of the 11 DSv4 groups for `num_tokens` tokens, ids from `first` up (`one_state_block`:
    the state groups hold one block, enough only when they are skipped)."""
    tables = []
    for group, (block_size, _, _) in enumerate(_specs(dsv4_ascend_kv_cache_config())):
        if group in STATE_GROUPS and one_state_block:
            tables.append([first + 100 * group])  # state groups hold one state block
        else:
            blocks = -(-num_tokens // block_size)
            tables.append([first + 100 * group + i for i in range(blocks)])
    return tuple(tables)


def _extension(old: tuple[list[int], ...], new: tuple[list[int], ...]) -> tuple[list[int], ...]:
    return tuple(n[len(o) :] for o, n in zip(old, new))


def test_dsv4_request_life_tracks_every_group_row_by_row(patched):
    fixture = dsv4_ascend_kv_cache_config()
    impl = make_connector_impl(fixture, chunk_size=256)
    prompt = [(7 * i) % 1000 + 1 for i in range(1000)]
    driver = RequestDriver(impl, "req-dsv4", prompt)

    # 1. chunked prefill, first 512 tokens
    tables_512 = _dsv4_tables(1, 512)
    meta = driver.start(512, tables_512)
    (req,) = meta.requests
    assert req.token_ids == prompt[:512] and req.save_spec.can_save and req.save_spec.skip_leading_tokens == 0
    tracker = impl._request_trackers["req-dsv4"]
    assert _block_tracker(impl, "req-dsv4").block_id_lists() == [list(t) for t in tables_512]
    assert tracker.allocated_block_ids == tables_512[0]  # upstream's own field is untouched
    slots, store, _ = _assert_rows(req, fixture, tables_512)
    assert slots.transferred_groups(_kv_groups_of(fixture)) == tuple(range(11))  # state groups too
    # Upstream's own slot mapping: group 0's table in its 512-token blocks, owning its memory.
    assert req.slot_mapping.tolist() == reference_raw_slots(512, 1, tables_512[0], 512)
    assert req.slot_mapping.untyped_storage().nbytes() == 512 * 8
    # Sliding window 128 with compress ratio 128: one row per 256-token chunk, widened to
    # the paged block holding it; a block holds 128 rows here, so every row is stored.
    sw_base = tables_512[8][0] * 128
    assert store[8] == [sw_base, sw_base + 1, sw_base + 2, sw_base + 3]

    # 2. rest of the prompt (488 tokens); only growing groups get blocks
    tables_1000 = _dsv4_tables(1, 1000)
    meta = driver.advance(488, _extension(tables_512, tables_1000))
    (req,) = meta.requests
    assert req.is_last_prefill and len(req.token_ids) == 768 and req.save_spec.skip_leading_tokens == 512
    assert _block_tracker(impl, "req-dsv4").block_id_lists() == [list(t) for t in tables_1000]
    _assert_rows(req, fixture, tables_1000)

    # 3. decode one token: nothing to save or load, no new blocks
    meta = driver.advance(1, None, output_token=5)
    assert meta.requests == []
    assert _block_tracker(impl, "req-dsv4").block_id_lists() == [list(t) for t in tables_1000]

    # 4. preempted and resumed: fresh tables (one null block in group 2), load from LMCache
    resumed = list(_dsv4_tables(5000, 1001))
    resumed[2] = [0] + resumed[2][1:]
    meta = driver.resume_after_preemption(233, tuple(resumed), lmcache_cached_tokens=768, vllm_cached_tokens=256)
    (req,) = meta.requests
    assert req.load_spec.can_load and not req.save_spec.can_save
    tracker = impl._request_trackers["req-dsv4"]
    assert _block_tracker(impl, "req-dsv4").block_id_lists() == resumed
    _, store, load = _assert_rows(req, fixture, resumed, vllm_cached=256)
    assert store[2][:128] == [-1] * 128  # the null block is a hole
    assert load[0][:64] == [-1] * 64 and load[0][64] != -1  # 256 vLLM-cached tokens / ratio 4

    # 5. finish
    driver.finish()
    assert "req-dsv4" not in impl._request_trackers and "req-dsv4" not in SCHEDULER_STATE.get(impl).block_trackers


def test_cuda_five_groups_4096_tokens_seed_block_counts(patched):
    fixture = dsv4_cuda_kv_cache_config()
    impl = make_connector_impl(fixture, chunk_size=256)
    counts = (16, 64, 64, 1024, 512)
    tables = tuple([1 + 10_000 * g + i for i in range(n)] for g, n in enumerate(counts))
    driver = RequestDriver(impl, "req-cuda", list(range(1, 4097)))
    (req,) = driver.start(4096, tables).requests
    groups = _block_tracker(impl, "req-cuda")
    assert groups.num_blocks_by_group() == counts
    slots, store, _ = _assert_rows(req, fixture, tables)
    assert [len(store[g]) for g in range(5)] == [4096] * 5
    assert len(slots.block_ids) == sum(counts)  # ids shipped, not 5 x 4096 slots
    # Upstream's slot mapping comes from group 0 (256-token blocks: the largest that divides the chunk).
    assert req.slot_mapping.tolist() == reference_raw_slots(256, 1, tables[0], 4096)


def test_multi_group_without_discard_partial_chunks_fails_naming_the_key(patched):
    impl = make_connector_impl(full_and_sliding_window_kv_cache_config(), discard_partial_chunks=False)
    driver = RequestDriver(impl, "r", list(range(100)))
    with pytest.raises(MultiGroupConfigError, match="discard_partial_chunks"):
        driver.start(100, ([1] * 7, [2] * 7))
    single = make_connector_impl(single_group_kv_cache_config(), discard_partial_chunks=False)
    RequestDriver(single, "r", list(range(100))).start(100, ([1, 2, 3, 4, 5, 6, 7],))


# The single-group life's block table after each step (what vLLM's block table holds then).
SINGLE_FIRST_BLOCKS = [4, 9, 2, 7, 1, 3, 8, 5, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
SINGLE_GROWN_BLOCKS = SINGLE_FIRST_BLOCKS + [20 + i for i in range(19)]
SINGLE_RESUMED_BLOCKS = [50 + i for i in range(38)]
SINGLE_TABLES_BY_STEP = (SINGLE_FIRST_BLOCKS, SINGLE_GROWN_BLOCKS, SINGLE_GROWN_BLOCKS, SINGLE_RESUMED_BLOCKS)


def _single_group_life(impl):
    """A single-group life; returns every ReqMeta and tracker snapshot it produced."""
    prompt = list(range(3, 603))
    driver = RequestDriver(impl, "req-single", prompt)
    outputs = []
    outputs.append(driver.start(300, (list(SINGLE_FIRST_BLOCKS),)))
    outputs.append(driver.advance(300, (SINGLE_GROWN_BLOCKS[len(SINGLE_FIRST_BLOCKS) :],)))
    outputs.append(driver.advance(1, None, output_token=9))
    tables = (list(SINGLE_RESUMED_BLOCKS),)
    outputs.append(driver.resume_after_preemption(89, tables, lmcache_cached_tokens=512, vllm_cached_tokens=128))
    snapshot = vars(impl._request_trackers["req-single"]).copy()
    driver.finish()
    return outputs, snapshot


def _meta_fields(meta):
    return [
        (r.req_id, r.token_ids, r.slot_mapping.dtype, r.slot_mapping.tolist(), r.is_last_prefill, r.save_spec, r.load_spec)
        for r in meta.requests
    ]


def test_single_group_results_identical_to_unpatched_lmcache():
    fixture = single_group_kv_cache_config()
    REGISTRY.revert(PATCH)
    unpatched, unpatched_tracker = _single_group_life(make_connector_impl(fixture))
    assert apply_now(REGISTRY, PATCH) is State.APPLIED
    try:
        patched_out, patched_tracker = _single_group_life(make_connector_impl(fixture))
    finally:
        REGISTRY.revert(PATCH)
    assert [_meta_fields(m) for m in patched_out] == [_meta_fields(m) for m in unpatched]
    # Save in steps 1 and 2, nothing in the decode step, load after the preemption.
    assert [len(meta.requests) for meta in patched_out] == [1, 1, 0, 1]
    ((block_size, _, _),) = _specs(fixture)
    for meta, table in zip(patched_out, SINGLE_TABLES_BY_STEP):
        for req in meta.requests:
            assert STEP_BLOCK_IDS.get(req) is None
            # Both runs against vLLM's slot rule (block id * block size + offset), computed here
            # from the step's block table: equal runs that were both wrong would fail here.
            assert req.slot_mapping.tolist() == reference_raw_slots(block_size, 1, table, len(req.token_ids))
    assert patched_tracker == unpatched_tracker  # no extra attribute on single-group trackers


@pytest.mark.parametrize("skip", [None, "1"], ids=["default", "skip-on"])
def test_state_groups_move_by_default_and_are_skipped_only_on_request(patched, monkeypatch, skip):
    """A resumed DeepSeek-V4 prefill reads compressor state from before the chunk boundary, so the
    default moves every state group; the skip flag (the control) leaves all six out."""
    if skip is None:
        monkeypatch.delenv("LMCACHE_ASCEND_SKIP_STATE_GROUPS", raising=False)
    else:
        monkeypatch.setenv("LMCACHE_ASCEND_SKIP_STATE_GROUPS", skip)
    fixture = dsv4_ascend_kv_cache_config()
    impl = make_connector_impl(fixture)
    tables = _dsv4_tables(1, 256, one_state_block=skip is not None)
    (req,) = RequestDriver(impl, "r", list(range(1, 257))).start(256, tables).requests
    slots = STEP_BLOCK_IDS.get(req)
    kv_groups = CONNECTOR_GROUPS.get(impl)
    skipped = STATE_GROUPS if skip else frozenset()
    assert slots.transferred_groups(kv_groups) == tuple(g for g in range(11) if g not in skipped)
    _assert_rows(req, fixture, tables, skipped=skipped)  # every moved group's rows, the state groups' too


def test_metadata_with_block_ids_survives_pickling_to_workers(patched):
    import pickle

    fixture = dsv4_ascend_kv_cache_config()
    impl = make_connector_impl(fixture)
    tables = _dsv4_tables(1, 512)
    meta = RequestDriver(impl, "r", list(range(1, 513))).start(512, tables)
    payload = pickle.dumps(meta)
    copy = pickle.loads(payload)
    original, restored = STEP_BLOCK_IDS.get(meta.requests[0]), STEP_BLOCK_IDS.get(copy.requests[0])
    assert restored.geometry_digest == original.geometry_digest and restored.num_tokens == original.num_tokens
    assert restored.block_ids.tolist() == original.block_ids.tolist()
    kv_groups = _kv_groups_of(fixture)
    assert _resolve(restored, kv_groups) == _resolve(original, kv_groups)
    # No tensor of the scheduler's beyond upstream's own slot mapping (512 entries, owning its
    # memory): the 16384-token C128 table no longer travels, nor any per-group slot tensor.
    assert len(payload) < 512 * 8 + 8 * 1024
    assert copy.requests[0].slot_mapping.untyped_storage().nbytes() == 512 * 8


def test_rollback_after_failed_load_keeps_tokens_all_groups_cover(patched):
    fixture = dsv4_cuda_kv_cache_config()
    impl = make_connector_impl(fixture, chunk_size=256)
    prompt = list(range(1, 2049))
    sizes = (256, 64, 64, 4, 8)
    tables = tuple([1 + 10_000 * g + i for i in range(1024 // size)] for g, size in enumerate(sizes))
    driver = RequestDriver(impl, "req-rb", prompt)
    driver.start(1024, tables)
    tracker = impl._request_trackers["req-rb"]
    assert len(tracker.token_ids) == 1024
    # vLLM's invalid-block handling lowered num_computed_tokens to 512.
    driver.request.num_computed_tokens = 512
    (req,) = driver.advance(256, None).requests
    # Upstream caps at len(group-0 blocks) * the block size it is handed: with vLLM's (4) that
    # is 16 tokens and the prefix is lost; the step hands it group 0's (256).
    assert tracker.token_ids == prompt[:768]
    assert tracker.num_saved_tokens == 768 and req.token_ids == prompt[:768]
    slots, _, _ = _assert_rows(req, fixture, tables)
    assert slots.num_tokens == 768


class _Tables:
    """vLLM's block tables of one request, per group, as the test hands them out (fresh ids)."""

    def __init__(self, fixture, first_id: int) -> None:
        self.specs = _specs(fixture)
        self.next_id = first_id
        self.tables = [[] for _ in self.specs]

    def grow_to(self, num_tokens: int, fresh: bool = False) -> tuple[list[int], ...]:
        """The new blocks each group needs to hold `num_tokens` tokens (`fresh`: a new table)."""
        if fresh:
            self.tables = [[] for _ in self.specs]
        new = []
        for group, (block_size, _, _) in enumerate(self.specs):
            wanted = -(-num_tokens // block_size)
            count = max(0, wanted - len(self.tables[group]))
            new.append(list(range(self.next_id, self.next_id + count)))
            self.tables[group].extend(new[-1])
            self.next_id += count
        return tuple(new)


def _request_life(fixture, save_decode_cache: bool = False):
    """Two requests in shared steps: chunked prefill, a rollback with new blocks, decode steps
    bringing nothing (vLLM's None, or an empty list per group), decode steps bringing blocks to
    some groups, a rollback while decoding, a preemption with a fresh table. Every step's
    metadata and trackers are checked against vLLM's tables (the test's) and the reference slot
    rule; a block tracker may be retired (None) only while its request decodes on a connector
    that saves nothing then. Returns what each step produced and the requests ever retired."""
    from tests.multigroup.scheduler_driver import step_together

    impl = make_connector_impl(fixture, chunk_size=256)
    impl.config.save_decode_cache = save_decode_cache
    retired = set()
    a = RequestDriver(impl, "req-a", [(3 * i) % 997 + 1 for i in range(766)])
    b = RequestDriver(impl, "req-b", [(5 * i) % 991 + 1 for i in range(600)])
    tables = {"req-a": _Tables(fixture, 1), "req-b": _Tables(fixture, 100_000)}
    record = []

    def check(meta, cached_vllm=None):
        cached_vllm = cached_vllm or {}
        step = []
        for driver in (a, b):
            tracker = impl._request_trackers.get(driver.req_id)
            if tracker is None:
                continue
            model = tables[driver.req_id].tables
            groups = _block_tracker(impl, driver.req_id)
            if groups is None:  # retired: never read again
                assert tracker.is_decode_phase and not save_decode_cache
                retired.add(driver.req_id)
            else:
                assert groups.block_id_lists() == model
            assert tracker.allocated_block_ids == model[0]  # upstream's own field: group 0
            assert not [name for name in vars(tracker) if "ascend" in name]  # nothing of ours on it
            assert tracker.token_ids == driver.request.all_token_ids[: driver.request.num_computed_tokens]
            state = (list(tracker.token_ids), tracker.num_saved_tokens, list(tracker.allocated_block_ids))
            step.append((driver.req_id, *state))
        for req in meta.requests:
            vllm_cached = cached_vllm.get(req.req_id, 0)
            slots, _, _ = _assert_rows(req, fixture, tables[req.req_id].tables, vllm_cached=vllm_cached)
            step.append((
                req.req_id, req.token_ids, req.slot_mapping.tolist(), req.is_last_prefill, req.save_spec,
                req.load_spec, slots.packed_block_ids, slots.num_tokens, slots.vllm_cached_tokens,
            ))
        record.append(step)
        return meta

    def decode_step(meta):
        """A decode step stores only where the connector saves decode KV (A at its 768th token)."""
        assert all(req.save_spec.can_save and req.load_spec is None for req in meta.requests)
        assert save_decode_cache or not meta.requests

    brought = []  # per decode part: "blocks", "none" or "lists"

    def running(driver, num_tokens, nothing_new_as="none", output_token=None):
        """A running request's part of a step: the blocks its new tokens need; a step that needs
        none brings vLLM's None (`nothing_new_as` "none") or an empty list per group ("lists")."""
        new = tables[driver.req_id].grow_to(driver.request.num_computed_tokens + num_tokens)
        if not any(new):
            new = None if nothing_new_as == "none" else new
        brought.append("blocks" if any(new or ()) else nothing_new_as)
        return driver.running(num_tokens, new, output_token)

    # Prefill: A's first 512 tokens, B's first 256 (each a step of its own).
    check(a.start(512, tables["req-a"].grow_to(512)))
    check(b.start(256, tables["req-b"].grow_to(256)))
    # A failed load rolled A back to 256 tokens; the same step brings A's and B's last prompt blocks.
    a.request.num_computed_tokens = 256
    meta = check(step_together(impl, [running(a, 510), running(b, 344)]))
    assert {req.req_id for req in meta.requests} == {"req-a", "req-b"}
    # Decode, nothing to store: steps bringing nothing (None or empty lists) or some groups' blocks.
    token = iter(range(1, 1000))
    brought.clear()
    for step in range(6):
        forms = ("none", "lists") if step % 2 else ("lists", "none")
        parts = [running(a, 1, forms[0], next(token)), running(b, 1, forms[1], next(token))]
        decode_step(check(step_together(impl, parts)))
    assert {"blocks", "none", "lists"} <= set(brought)
    # A rolled back by one token while decoding; B preempted, resuming with a fresh table and
    # loading 512 tokens from LMCache (256 still in vLLM).
    a.request.num_computed_tokens -= 1
    b_total = len(b.request.all_token_ids)
    fresh_b = tables["req-b"].grow_to(b_total, fresh=True)
    meta = check(
        step_together(impl, [running(a, 1, "lists", next(token)), b.resuming(b_total - 512, fresh_b, 512, 256)]),
        {"req-b": 256},
    )
    assert [req.req_id for req in meta.requests] == ["req-b"]
    for step in range(4):
        parts = [running(a, 1, "none", next(token)), running(b, 1, "lists", next(token))]
        decode_step(check(step_together(impl, parts)))
    a.finish()
    b.finish()
    assert impl._request_trackers == {} and SCHEDULER_STATE.get(impl).block_trackers == {}
    return record, retired


@pytest.mark.parametrize("make_fixture, retiring", [
    (dsv4_cuda_kv_cache_config, {"req-a", "req-b"}),
    (dsv4_ascend_kv_cache_config, {"req-a"}),  # B gets no block while decoding in these groups
])
def test_shared_steps_agree_with_vllm_tables(patched, make_fixture, retiring):
    record, retired = _request_life(make_fixture())
    # Steps that built metadata: A's prefill, B's prefill, both after A's rollback, B's resume.
    assert sum(1 for step in record for entry in step if len(entry) > 4) == 5
    # The decoding requests that got a block were retired (with the CUDA groups B before its
    # preemption: its resume loaded from a fresh tracker). A connector that saves decode KV keeps
    # every tracker: A's decode save at its 768th token was checked row by row like every other.
    assert retired == retiring
    record, retired = _request_life(make_fixture(), save_decode_cache=True)
    assert sum(1 for step in record for entry in step if len(entry) > 4) == 6 and not retired


def test_trackers_retire_only_under_the_decode_save_rule_they_were_checked_against(patched, monkeypatch):
    """The pinned LMCache's rule is one retiring was checked against; where upstream's source is
    another, no tracker is retired and the same steps still agree with vLLM's tables."""
    from lmcache_ascend.patches.lmcache import adapter_multigroup

    fixture = dsv4_cuda_kv_cache_config()
    impl = make_connector_impl(fixture)
    RequestDriver(impl, "req-rule", list(range(1, 17))).start(16, _cuda_tables(16))
    assert SCHEDULER_STATE.get(impl).decode_rule_read
    monkeypatch.setitem(adapter_multigroup._DECODE_SAVE_RULE, "ReqMeta.from_request_tracker", ("another",))
    _, retired = _request_life(fixture)
    assert retired == set()


def _decode_past_a_chunk(impl, fixture, req_id: str, flip_save_decode_cache_at: int | None = None):
    """A 250-token prompt, then decode steps up to 260 tokens, each growing the tables as vLLM
    would: the 256th token ends LMCache's first chunk. Returns the step that saves it, with the
    tables then, and the tables at the end."""
    tables = _Tables(fixture, 1)
    driver = RequestDriver(impl, req_id, [(11 * i) % 983 + 1 for i in range(250)])
    assert driver.start(250, tables.grow_to(250)).requests[0].save_spec.can_save  # (nothing whole to save yet)
    saving = None
    for token in range(1, 11):
        if token == flip_save_decode_cache_at:
            impl.config.save_decode_cache = True
        new = tables.grow_to(driver.request.num_computed_tokens + 1)
        meta = driver.advance(1, new if any(new) else None, output_token=token)
        if meta.requests:
            saving = (meta.requests[0], [list(t) for t in tables.tables])
    return saving, tables.tables


@pytest.mark.parametrize("make_fixture", [dsv4_cuda_kv_cache_config, dsv4_ascend_kv_cache_config])
def test_decode_saves_carry_every_group_s_blocks(patched, make_fixture):
    """With save_decode_cache on, upstream saves a decoding request at its chunk boundary; its
    tracker followed every block (none retired), and every row of the save is vLLM's."""
    fixture = make_fixture()
    impl = make_connector_impl(fixture, chunk_size=256)
    impl.config.save_decode_cache = True
    (req, tables), final_tables = _decode_past_a_chunk(impl, fixture, "req-dec")
    assert req.save_spec.can_save and len(req.token_ids) == 256
    _assert_rows(req, fixture, tables)
    assert _block_tracker(impl, "req-dec").block_id_lists() == final_tables


def test_a_retired_request_that_upstream_saves_is_refused(patched):
    """A save for a request whose tracker was retired (here: save_decode_cache turned on while it
    decodes) is refused at the step, naming the request, rather than shipped without its blocks."""
    fixture = dsv4_cuda_kv_cache_config()
    impl = make_connector_impl(fixture, chunk_size=256)
    with pytest.raises(RuntimeError, match="request 'req-late' makes LMCache store KV while decoding, after its "
                                           "block tracker was retired"):
        _decode_past_a_chunk(impl, fixture, "req-late", flip_save_decode_cache_at=5)


def _cuda_tables(num_tokens: int) -> tuple[list[int], ...]:
    """Blocks of DeepSeek-V4's five CUDA groups (256/64/64/4/8 tokens) for `num_tokens` tokens."""
    return tuple(list(range(1000 * g + 1, 1000 * g + 1 + -(-num_tokens // b))) for g, b in enumerate((256, 64, 64, 4, 8)))


def _first_step_with_a_load_spec(fixture, kv_role: str, can_load: bool):
    """A new request's first step on a connector that saves nothing (LMCache's force_skip_save),
    with a load spec that can or cannot load (LMCache holds 256 tokens, vLLM none)."""
    from lmcache.integration.vllm.vllm_v1_adapter import LoadSpec

    impl = make_connector_impl(fixture, chunk_size=256)
    impl.kv_role, impl.force_skip_save = kv_role, True
    driver = RequestDriver(impl, "req-load", list(range(1, 513)))
    impl.load_specs["req-load"] = LoadSpec(vllm_cached_tokens=0, lmcache_cached_tokens=256, can_load=can_load)
    driver.request.num_computed_tokens = 0
    impl.update_state_after_alloc(driver.request, 256 if can_load else 0)
    impl.update_state_after_alloc = lambda request, num_external_tokens: None  # (done: the driver's call is not vLLM's)
    tables = _dsv4_tables(1, 512)
    return impl, tables, driver.start(512, tables)


def _decision(meta):
    """What upstream decided per request: the tokens it names and its save and load specs."""
    return [(req.req_id, list(req.token_ids), req.save_spec, req.load_spec) for req in meta.requests]


@pytest.mark.parametrize("kv_role", ["kv_both", "kv_consumer", "kv_producer"])
@pytest.mark.parametrize("can_load", [False, True])
def test_block_ids_only_for_metadata_that_stores_or_loads(kv_role, can_load):
    """Upstream returns a ReqMeta that moves nothing when it carries a load spec that cannot load
    (for the workers' metrics) and saves nothing: no block ids are built for it, unless the worker
    stores it anyway (a producer stores whatever its save spec says). Upstream's decisions are the
    same with and without the patch."""
    fixture = dsv4_ascend_kv_cache_config()
    _, _, upstream = _first_step_with_a_load_spec(fixture, kv_role, can_load)
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    try:
        _, tables, meta = _first_step_with_a_load_spec(fixture, kv_role, can_load)
    finally:
        assert REGISTRY.revert(PATCH) is State.REVERTED
    assert _decision(meta) == _decision(upstream)
    (req,) = meta.requests
    assert not req.save_spec.can_save and req.load_spec.can_load is can_load
    if can_load or kv_role == "kv_producer":
        _assert_rows(req, fixture, tables, vllm_cached=0)
    else:
        assert STEP_BLOCK_IDS.get(req) is None


@pytest.mark.parametrize(
    "make_fixture, make_tables, group_zero_block_size",
    [(dsv4_cuda_kv_cache_config, _cuda_tables, 256), (dsv4_ascend_kv_cache_config, lambda n: _dsv4_tables(1, n), 512)],
)
def test_step_hands_upstream_group_zero_s_block_size_and_restores_vllm_s(
    patched, make_fixture, make_tables, group_zero_block_size
):
    """For the step, upstream's loop passes group 0's block size (its tracker keeps group 0's table);
    the connector's own (vLLM's) block size is back after the step, also when upstream raises."""
    from lmcache.integration.vllm.vllm_v1_adapter import ReqMeta

    fixture = make_fixture()
    impl = make_connector_impl(fixture, chunk_size=256)
    vllm_block_size = impl._block_size
    assert vllm_block_size != group_zero_block_size  # else the swap could not be seen
    seen = []
    installed = ReqMeta.__dict__["from_request_tracker"]

    def spy(tracker, block_size, *args, **kwargs):
        seen.append((block_size, impl._block_size))
        return installed.__func__(tracker, block_size, *args, **kwargs)

    ReqMeta.from_request_tracker = staticmethod(spy)
    try:
        driver = RequestDriver(impl, "r", list(range(1, 769)))
        tables = make_tables(768)
        (req,) = driver.start(768, tables).requests
    finally:
        ReqMeta.from_request_tracker = installed
    assert seen == [(group_zero_block_size, group_zero_block_size)] and impl._block_size == vllm_block_size
    assert req.slot_mapping.tolist() == reference_raw_slots(group_zero_block_size, 1, tables[0], 768)
    # Trimmed to its tokens before it is pickled (upstream's is a view of every block's slots).
    assert req.slot_mapping.untyped_storage().nbytes() == 768 * 8
    assert impl._request_trackers["r"].allocated_block_ids == tables[0]
    _assert_rows(req, fixture, tables)

    def failing(tracker, block_size, *args, **kwargs):
        raise RuntimeError("upstream failed")

    ReqMeta.from_request_tracker = staticmethod(failing)
    try:
        with pytest.raises(RuntimeError, match="upstream failed"):
            RequestDriver(impl, "s", list(range(1, 257))).start(256, make_tables(256))
    finally:
        ReqMeta.from_request_tracker = installed
    assert impl._block_size == vllm_block_size
