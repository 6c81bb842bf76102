"""`ChunkMover.move_chunks` (many full chunks of every layer group at once) equals `move` chunk by chunk.

Stored chunks are compared byte for byte over poisoned buffers, loaded caches over
whole poisoned caches; host memory objects go through mapped memory and through
staging waves (a small staging budget forces several waves and both halves).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lmcache_ascend.kv_worker.staging as staging
from lmcache_ascend.kernels import launch_counter
from lmcache_ascend.kv_worker import ChunkMover, plan_kv_caches
from tests.kv_worker._geometry import geometry as group_geometry

CHUNK = 16


def _mover(device: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    geometry = {
        0: group_geometry(0),
        1: group_geometry(1, compress_ratio=4, block_rows=2),
        2: group_geometry(2, sliding_window=8, block_rows=4),
    }
    kv_caches = {
        "full": (torch.randint(0, 256, (80, 1, 24), dtype=torch.uint8, generator=generator).to(device),),
        "c4": (torch.randint(0, 256, (12, 2, 8), dtype=torch.uint8, generator=generator).to(device).view(torch.int8),
               torch.randint(0, 256, (12, 2, 2), dtype=torch.uint8, generator=generator).to(device).view(torch.float16)),
        "swa": (torch.randint(0, 256, (20, 4, 16), dtype=torch.uint8, generator=generator).to(device).view(torch.bfloat16),),
    }
    plane_groups = {"full": (0,), "c4": (1,), "swa": (2,)}
    _, planner = plan_kv_caches(kv_caches, plane_groups, geometry, CHUNK)
    tokens = 4 * CHUNK
    slots = {
        0: torch.randperm(79, generator=generator)[:tokens] + 1,
        1: torch.randperm(23, generator=generator)[: tokens // 4] + 1,
        2: torch.randperm(79, generator=generator)[:tokens] + 1,
    }
    slots[0][5] = -1  # a null-block row
    return ChunkMover(planner, backend=None), kv_caches, slots, [0, CHUNK, 2 * CHUNK, 3 * CHUNK]


def _cache_bytes(kv_caches):
    return [plane.view(torch.uint8).clone() for planes in kv_caches.values() for plane in planes]


def _set_caches(kv_caches, saved):
    for plane, value in zip([p for planes in kv_caches.values() for p in planes], saved):
        plane.view(torch.uint8).copy_(value)


def _round_trip(device: str, host: bool, pad: int = 0, mover_parts=None, events=None):
    """Store then load through `move_chunks` against `move` chunk by chunk (host chunks: staged, where the
    caches are not on the CPU or the test says so); with `events` (a list) the load's slots are given as a
    function, which appends "slots" to it when called."""
    mover, kv_caches, slots, starts = mover_parts or _mover(device)
    total = mover.planner.full_plan.total_bytes
    pinned = host and device == "cuda"
    place = "cpu" if host else device
    spacing = total + pad  # pad: bytes between chunks that belong to none of them

    def chunks(poison):
        pool = torch.full((len(starts) * spacing,), poison, dtype=torch.uint8, device=place)
        if pinned:
            pool = pool.pin_memory()
        return pool, [pool[i * spacing : i * spacing + total] for i in range(len(starts))]

    # The reference: one `move` per chunk, on device copies of the poisoned chunks, under two
    # poisons: the bytes where they agree are the ones rows fill.
    references = []
    for poison in (0xA5, 0x5A):
        single_pool, single = chunks(poison)
        for chunk, start in zip(single, starts):
            on_device = chunk.to(device)
            mover.move(on_device, start, start + CHUNK, slots, store=True)
            chunk.copy_(on_device.to(chunk.device))
        references.append(single_pool.cpu())
    filled = references[0] == references[1]
    assert int(filled.sum()) > 0 and not bool(filled.all())
    batched_pool, batched = chunks(0xA5)
    launch_counter.reset()
    launches = mover.move_chunks(batched, starts, slots, store=True)
    if device == "cuda":
        torch.cuda.synchronize()
    if host:  # bytes no row fills are unspecified through staging
        assert torch.equal(batched_pool.cpu()[filled], references[0][filled])
        gaps = torch.ones(len(starts) * spacing, dtype=torch.bool)
        for index in range(len(starts)):
            gaps[index * spacing : index * spacing + total] = False
        assert bool((batched_pool.cpu()[gaps] == 0xA5).all())  # bytes of no chunk are never written
    else:
        assert torch.equal(batched_pool.cpu(), references[0])
    original = _cache_bytes(kv_caches)
    poisoned = [torch.full_like(saved, 0x3C) for saved in original]
    _set_caches(kv_caches, poisoned)
    for chunk, start in zip(single, starts):
        mover.move(chunk.to(device), start, start + CHUNK, mover.upload(slots, cached_tokens=CHUNK), store=False)
    expected = _cache_bytes(kv_caches)
    _set_caches(kv_caches, poisoned)
    load_slots = mover.upload(slots, cached_tokens=CHUNK)
    if events is not None:
        resolved = load_slots
        load_slots = lambda: (events.append("slots"), resolved)[1]  # noqa: E731
    mover.move_chunks(batched, starts, load_slots, store=False)
    if device == "cuda":
        torch.cuda.synchronize()
    for got, want, before in zip(_cache_bytes(kv_caches), expected, poisoned):
        assert torch.equal(got, want)
    assert any(not torch.equal(a, b) for a, b in zip(expected, poisoned))
    return launches, len(mover.planner.layer_groups)


def test_batched_chunks_equal_single_chunks_on_cpu():
    launches, layer_groups = _round_trip("cpu", host=False)
    assert launches == layer_groups  # the reference counts one per layer group for all 4 chunks


@pytest.mark.parametrize("pad", [0, 24, 100_000])
@pytest.mark.parametrize("capacity_chunks", [1, 2, 8])
def test_staging_waves_and_spans_equal_single_chunks_on_cpu(pad, capacity_chunks, monkeypatch):
    """The staged path run on the CPU (no streams; same waves, spans and copies): chunks back to back
    (one copy per span), with bytes of no chunk between them (never written), or far apart."""
    parts = _mover("cpu")
    mover = parts[0]
    monkeypatch.setattr(staging, "STAGING_BYTES", capacity_chunks * (mover.planner.full_plan.total_bytes + 256))
    monkeypatch.setattr(mover, "reachable", lambda chunks: False)
    copies = []
    real_copy = staging._copy_spans
    monkeypatch.setattr(staging, "_copy_spans", lambda *a, **k: (copies.append(len(a[2])), real_copy(*a, **k))[1])
    launches, layer_groups = _round_trip("cpu", host=True, pad=pad, mover_parts=parts)
    waves = len(staging.staging_waves(4, capacity_chunks))
    assert launches == waves * layer_groups
    # store copies: one per span (chunks back to back) or per chunk (padding between is not theirs)
    assert sum(copies[:waves]) == (waves if pad == 0 else 4)


def test_staging_spans_join_only_neighbours_one_copy_can_reach():
    """Chunks of 100 bytes, staging stride 128: a gap past the stride, or (for a store) bytes between
    that are not the chunk's own, start a new span; each chunk keeps its distance in its span."""
    addresses, sizes = [1000, 1100, 1228, 1400, 1500], [100, 128, 100, 100, 100]
    assert staging._joined_neighbours(addresses, sizes, 100, 128, store=False) == [True, True, False, True]
    assert staging._joined_neighbours(addresses, [100] * 5, 100, 128, store=True) == [True, False, False, True]
    joined = staging._joined_neighbours(addresses, sizes, 100, 128, store=True)
    assert joined == [True, True, False, True]
    spans, offsets = staging._staging_spans(addresses, joined, 0, 5, 100, base=512)
    # [0, 3) spans 1000..1328 (328 bytes, aligned up to 512), [3, 5) follows at 1024
    assert spans == [(0, 3, 512), (3, 5, 1024)]
    assert offsets == (512, 612, 740, 1024, 1124)
    assert staging._staging_spans(addresses, joined, 1, 4, 100, base=0) == ([(1, 3, 0), (3, 4, 256)], (0, 128, 256))
    assert staging._staging_spans(addresses, [], 2, 3, 100, base=0) == ([(2, 3, 0)], (0,))


def test_staging_waves_start_small_and_double():
    assert staging.staging_waves(64, 23) == [(0, 4), (4, 12), (12, 28), (28, 51), (51, 64)]
    assert staging.staging_waves(64, 23, first=2) == [(0, 2), (2, 6), (6, 14), (14, 30), (30, 53), (53, 64)]
    assert staging.staging_waves(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert staging.staging_waves(0, 4) == []
    with pytest.raises(ValueError, match="capacity=0"):
        staging.staging_waves(4, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host", [False, True])
def test_batched_chunks_equal_single_chunks_on_cuda(host, monkeypatch):
    mover, *_ = _mover("cuda")
    # Two chunks per staging half at most: 4 chunks take 2 waves, both halves.
    monkeypatch.setattr(staging, "STAGING_BYTES", 4 * (mover.planner.full_plan.total_bytes + 256))
    launches, layer_groups = _round_trip("cuda", host)
    waves = 2 if host else 1
    assert layer_groups == 3 and launches == waves  # on Triton every layer group of a wave in one launch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staged_load_queues_first_copies_before_resolving_slots(monkeypatch):
    """A staged load given its slots as a function queues one wave per staging half before calling it,
    then the next wave's copies before each wave's launches; the bytes equal the single-chunk path."""
    mover, *rest = _mover("cuda")
    monkeypatch.setattr(staging, "STAGING_BYTES", 2 * (mover.planner.full_plan.total_bytes + 256))  # 1 chunk a half
    events: list[str] = []
    real_copy = staging._copy_spans
    monkeypatch.setattr(staging, "_copy_spans",
                        lambda *a, **k: (events.append("copy_in" if k["to_staging"] else "copy_out"),
                                         real_copy(*a, **k))[1])
    real_move_batch = mover.move_batch
    monkeypatch.setattr(mover, "move_batch",
                        lambda *a, **k: (events.append("launch"), real_move_batch(*a, **k))[1])
    _round_trip("cuda", host=True, mover_parts=(mover, *rest), events=events)
    load = events[events.index("copy_in"):]
    assert load == ["copy_in", "copy_in", "slots", "launch", "copy_in", "launch", "copy_in", "launch", "launch"]


def _record_staged_steps(monkeypatch, mover, events: list) -> None:
    """Append each host check (`("check", chunks)`), copy and launch of the staged path to `events`."""
    real_check, real_copy, real_move_batch = staging.chunk_buffers, staging._copy_spans, mover.move_batch
    monkeypatch.setattr(staging, "chunk_buffers",
                        lambda chunks, **k: (events.append(("check", len(chunks))), real_check(chunks, **k))[1])
    monkeypatch.setattr(staging, "_copy_spans",
                        lambda *a, **k: (events.append("copy_in" if k["to_staging"] else "copy_out"),
                                         real_copy(*a, **k))[1])
    monkeypatch.setattr(mover, "move_batch", lambda *a, **k: (events.append("launch"), real_move_batch(*a, **k))[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staged_first_wave_is_issued_before_the_other_chunks_are_checked(monkeypatch):
    """The first wave's chunks are checked alone and its work queued (a store's launches and copies out,
    a load's copies in) before the rest are checked; the bytes equal the single-chunk path."""
    mover, *rest = _mover("cuda")
    monkeypatch.setattr(staging, "STAGING_BYTES", 4 * (mover.planner.full_plan.total_bytes + 256))  # 2 a half
    events: list = []
    _record_staged_steps(monkeypatch, mover, events)
    _round_trip("cuda", host=True, mover_parts=(mover, *rest), events=events)
    store = events[events.index(("check", 2)):]
    load = store[store.index(("check", 2), 1):]
    store = store[: len(store) - len(load)]
    assert store == [("check", 2), "launch", "copy_out", ("check", 4), "launch", "copy_out"]
    assert load == [("check", 2), "copy_in", ("check", 4), "copy_in", "slots", "launch", "launch"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_staged_chunk_too_small_past_the_first_wave_is_refused(device, monkeypatch):
    """A short host chunk after the first wave is named; a load writes no cache byte, a store writes
    only chunks it checked, and the next call runs as if nothing had failed."""
    mover, kv_caches, slots, starts = _mover(device)
    total = mover.planner.full_plan.total_bytes
    monkeypatch.setattr(staging, "STAGING_BYTES", 4 * (total + 256))  # 2 chunks a half: waves of 2
    if device == "cpu":
        monkeypatch.setattr(mover, "reachable", lambda chunks: False)
    pinned = device == "cuda"
    pool = torch.full((4 * total,), 0xA5, dtype=torch.uint8)
    pool = pool.pin_memory() if pinned else pool
    chunks = [pool[i * total : (i + 1) * total] for i in range(4)]
    short = chunks[:3] + [chunks[3][:-1]]
    before = _cache_bytes(kv_caches)
    with pytest.raises(ValueError, match=f"chunk 3 holds {total - 1} bytes; a full chunk needs {total}"):
        mover.move_chunks(short, starts, mover.upload(slots, cached_tokens=CHUNK), store=False)
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(got, want) for got, want in zip(_cache_bytes(kv_caches), before))
    with pytest.raises(ValueError, match="chunk 3 holds"):
        mover.move_chunks(short, starts, slots, store=True)
    if device == "cuda":
        torch.cuda.synchronize()
    assert bool((pool[2 * total :] == 0xA5).all())  # past the first wave: untouched
    mover.move_chunks(chunks, starts, slots, store=True)
    if device == "cuda":
        torch.cuda.synchronize()
    reference = torch.full((total,), 0xA5, dtype=torch.uint8, device=device)
    mover.move(reference, starts[3], starts[3] + CHUNK, slots, store=True)
    filled = reference.cpu() != 0xA5
    assert bool(filled.any()) and torch.equal(chunks[3][filled], reference.cpu()[filled])
