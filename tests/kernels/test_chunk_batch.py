"""Multi-chunk launches (`transfer_chunk_batches`): every chunk equals its own single-chunk transfer, byte for byte.

The control is the single-chunk op (`transfer_group`, itself tested against the
independent expectation in test_transfer_roundtrip); chunks are poisoned and the
whole caches compared, so a byte written where it must not be shows up. The
Triton kernel runs under TRITON_INTERPRET=1 on the CPU (in a subprocess) and on a
CUDA device when there is one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_ascend.kernels import (
    PagedGroup,
    PagedPlane,
    PlaneSlots,
    TransferError,
    chunk_rows,
    launch_counter,
    resolve_chunk_batch,
    transfer_chunk_batches,
    transfer_group,
)


def _case(device: str, seed: int = 0):
    """Two planes (fp16 rows of 8, int8 rows of 12 in 4-row blocks), 3 layers, 5 chunks with holes."""
    generator = torch.Generator().manual_seed(seed)
    caches_a = [torch.randint(0, 256, (9, 2, 16), dtype=torch.uint8, generator=generator).to(device).view(torch.float16)
                for _ in range(3)]
    caches_b = [torch.randint(0, 256, (7, 4, 12), dtype=torch.uint8, generator=generator).to(device).view(torch.int8)
                for _ in range(3)]
    group = PagedGroup((PagedPlane(tuple(caches_a), 2, 16, name="a"), PagedPlane(tuple(caches_b), 4, 12, name="b")))
    # Distinct slots per plane (which of two equal slots a load writes is unspecified):
    # plane a reads entries 0..19 (-1 and 18 skipped), plane b entries 20..39.
    slots = torch.cat([torch.randperm(20, generator=generator) - 1, torch.randperm(28, generator=generator)[:20]])
    slots[3] = 10_000  # out of range: skipped
    slots = slots.to(device)
    chunks = 5
    starts = np.array([[4 * c, 20 + 3 * c] for c in range(chunks)], dtype=np.int64)
    counts = np.array([[4, 3], [4, 0], [2, 3], [4, 3], [0, 1]], dtype=np.int64)
    regions = group.chunk_regions([4, 3])
    return group, slots, starts, counts, regions, caches_a + caches_b


def _poisoned_chunks(regions, count: int, device: str, chunk_offset: int):
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(0, 256, (chunk_offset + regions.total_bytes + 7,), dtype=torch.uint8, generator=generator)
            .to(device) for _ in range(count)]


def _run(device: str, backend: str, store: bool, chunk_offset: int = 32):
    """(chunks, caches) after a batched transfer, and the same after one single-chunk call per chunk."""
    results = []
    for batched in (True, False):
        group, slots, starts, counts, regions, caches = _case(device)
        chunks = _poisoned_chunks(regions, len(starts), device, chunk_offset)
        if batched:
            batch = resolve_chunk_batch(slots, chunks, chunk_rows(group, regions, starts, counts), store=store,
                                        chunk_offset=chunk_offset)
            launch_counter.reset()
            assert transfer_chunk_batches([batch], backend=backend) == 1
            assert launch_counter.triton + launch_counter.torch == 1
        else:
            for index, chunk in enumerate(chunks):
                plane_slots = tuple(PlaneSlots(slots, int(s), int(c), region_rows=r)
                                    for s, c, r in zip(starts[index], counts[index], regions.region_rows))
                transfer_group(group, plane_slots, chunk, store=store, chunk_offset=chunk_offset, backend=backend,
                               regions=regions)
        if device == "cuda":
            torch.cuda.synchronize()
        results.append(([c.cpu() for c in chunks], [c.view(torch.uint8).cpu() for c in caches]))
    return results


def _second_group(device: str, slots: torch.Tensor):
    """One plane of 24-byte rows in 3-row blocks, 2 layers; its slots at entries 40..51 of a longer slot tensor."""
    generator = torch.Generator().manual_seed(7)
    caches = [torch.randint(0, 256, (6, 3, 24), dtype=torch.uint8, generator=generator).to(device) for _ in range(2)]
    group = PagedGroup((PagedPlane(tuple(caches), 3, 24, name="c"),))
    slots = torch.cat([slots, (torch.randperm(17, generator=generator)[:12] - 1).to(device)])
    starts = np.array([[40 + 2 * c] for c in range(5)], dtype=np.int64)
    counts = np.array([[2], [1], [0], [2], [2]], dtype=np.int64)
    return group, slots, starts, counts, group.chunk_regions([2]), caches


def _run_groups(device: str, backend: str, store: bool, chunk_offset: int = 32):
    """(chunks, caches) after ONE batched call moving two groups at their offsets in each chunk, and the
    same after one single-chunk call per group and chunk."""
    results = []
    for batched in (True, False):
        group, slots, starts, counts, regions, caches = _case(device)
        second, slots, second_starts, second_counts, second_regions, second_caches = _second_group(device, slots)
        second_offset = chunk_offset + regions.total_bytes + 8
        generator = torch.Generator().manual_seed(99)
        chunks = [torch.randint(0, 256, (second_offset + second_regions.total_bytes + 5,), dtype=torch.uint8,
                                generator=generator).to(device) for _ in range(len(starts))]
        parts = ((group, starts, counts, regions, chunk_offset),
                 (second, second_starts, second_counts, second_regions, second_offset))
        if batched:
            batches = [resolve_chunk_batch(slots, chunks, chunk_rows(g, lay, s, c), store=store, chunk_offset=o)
                       for g, s, c, lay, o in parts]
            launch_counter.reset()
            launched = transfer_chunk_batches(batches, backend=backend)
            assert launched == (1 if backend == "triton" else 2) == launch_counter.triton + launch_counter.torch
        else:
            for g, s, c, lay, o in parts:
                for index, chunk in enumerate(chunks):
                    plane_slots = tuple(PlaneSlots(slots, int(a), int(b), region_rows=r)
                                        for a, b, r in zip(s[index], c[index], lay.region_rows))
                    transfer_group(g, plane_slots, chunk, store=store, chunk_offset=o, backend=backend, regions=lay)
        if device == "cuda":
            torch.cuda.synchronize()
        results.append(([c.cpu() for c in chunks], [c.view(torch.uint8).cpu() for c in caches + second_caches]))
    return results


def _assert_same(results):
    (batched_chunks, batched_caches), (single_chunks, single_caches) = results
    for a, b in zip(batched_chunks, single_chunks):
        assert torch.equal(a, b)
    for a, b in zip(batched_caches, single_caches):
        assert torch.equal(a, b)


@pytest.mark.parametrize("store", [True, False])
def test_reference_batch_equals_single_chunk_calls(store):
    _assert_same(_run("cpu", "torch", store))
    _assert_same(_run_groups("cpu", "torch", store))


def test_groups_of_one_call_all_move():
    """Control for the two-group case: on a store, both groups' regions of the poisoned chunks change."""
    chunks = _run_groups("cpu", "torch", True)[0][0]
    regions = _case("cpu")[4]
    second_offset = 32 + regions.total_bytes + 8
    generator = torch.Generator().manual_seed(99)  # the poison `_run_groups` fills the chunks with
    poisoned = [torch.randint(0, 256, (chunk.numel(),), dtype=torch.uint8, generator=generator) for chunk in chunks]
    assert any(not torch.equal(a[:second_offset], b[:second_offset]) for a, b in zip(poisoned, chunks))
    assert any(not torch.equal(a[second_offset:], b[second_offset:]) for a, b in zip(poisoned, chunks))


def test_a_batch_moves_bytes_at_all():
    """Control: the poisoned chunks change on store (else equality above proves nothing)."""
    group, slots, starts, counts, regions, _ = _case("cpu")
    chunks = _poisoned_chunks(regions, len(starts), "cpu", 0)
    before = [c.clone() for c in chunks]
    transfer_chunk_batches([resolve_chunk_batch(slots, chunks, chunk_rows(group, regions, starts, counts), store=True)],
                           backend="torch")
    assert sum(not torch.equal(a, b) for a, b in zip(before, chunks)) >= 3


def test_batch_inputs_are_refused_naming_them():
    group, slots, starts, counts, regions, _ = _case("cpu")
    chunks = _poisoned_chunks(regions, len(starts), "cpu", 0)
    rows = chunk_rows(group, regions, starts, counts)
    with pytest.raises(TransferError, match="exceeds the 40 slots"):
        bad = starts.copy()
        bad[2, 1] = 39
        resolve_chunk_batch(slots, chunks, chunk_rows(group, regions, bad, counts), store=True)
    with pytest.raises(TransferError, match="chunk 0 plane 0: start=0 \\+ count=4 exceeds the 3 slots"):
        resolve_chunk_batch(slots[:3], chunks, rows, store=True)
    with pytest.raises(TransferError, match="region_rows"):
        bad = counts.copy()
        bad[0, 0] = 5
        chunk_rows(group, regions, starts, bad)
    with pytest.raises(TransferError, match="must be >= 0"):
        chunk_rows(group, regions, -starts, counts)
    with pytest.raises(TransferError, match="do not fit"):
        resolve_chunk_batch(slots, [c[:10] for c in chunks], rows, store=True)
    with pytest.raises(TransferError, match="2 chunks but rows for 5 chunks"):
        resolve_chunk_batch(slots, chunks[:2], rows, store=True)
    with pytest.raises(TransferError, match=r"\(chunks, planes\)"):
        chunk_rows(group, regions, starts[:, :1], counts[:, :1])
    with pytest.raises(TransferError, match="allowed: ChunkRows"):
        resolve_chunk_batch(slots, chunks, (starts, counts), store=True)
    with pytest.raises(TransferError, match=r"chunks\[1\] = torch.int16"):
        resolve_chunk_batch(slots, [chunks[0], chunks[1][:-1].view(torch.int16)], chunk_rows(group, regions, starts[:2], counts[:2]),
                            store=True)
    # Rows are kept and reused: the caller's arrays may change afterwards, the rows may not.
    before = rows.starts.copy()
    starts[0, 0] = 17
    assert np.array_equal(rows.starts, before)
    with pytest.raises(ValueError):
        rows.starts[0, 0] = 1


def test_chunks_of_a_pool_move_like_separate_chunks(backend: str = "torch"):
    """`pool_chunk_buffers` (staging) addresses chunks by offset: same bytes as separate tensors."""
    from lmcache_ascend.kernels import pool_chunk_buffers

    group, slots, starts, counts, regions, _ = _case("cpu")
    rows = chunk_rows(group, regions, starts, counts)
    stride = regions.total_bytes + 40
    pool = torch.full((len(starts) * stride + 8,), 0xA5, dtype=torch.uint8)
    separate = [torch.full((regions.total_bytes,), 0xA5, dtype=torch.uint8) for _ in range(len(starts))]
    offsets = np.arange(len(starts), dtype=np.int64) * stride + 8
    transfer_chunk_batches([resolve_chunk_batch(slots, pool_chunk_buffers(pool, offsets, regions.total_bytes), rows,
                                                store=True)], backend=backend)
    transfer_chunk_batches([resolve_chunk_batch(slots, separate, rows, store=True)], backend="torch")
    for index, chunk in enumerate(separate):
        assert torch.equal(pool[8 + index * stride : 8 + index * stride + regions.total_bytes], chunk)
    assert int((pool[:8] != 0xA5).sum()) == 0  # nothing outside the chunks
    assert sum(not bool((chunk == 0xA5).all()) for chunk in separate) >= 3
    with pytest.raises(TransferError, match="do not fit the pool"):
        pool_chunk_buffers(pool, offsets + stride, regions.total_bytes)


# Launch shapes every multi-chunk launch is checked under (each forced on every region) as (rows
# per program, row bytes per step, warps): the default, CUDA's, the small-region one, one whose rows
# take several steps, and one whose step is wider than every row.
_SHAPES = ((64, 128, 4), (16, 256, 4), (16, 128, 4), (8, 16, 2), (4, 512, 4))


def _run_shapes(device: str, store: bool, chunk_offset: int = 32):
    from lmcache_ascend.kernels import triton_transfer as tt

    saved = tt.CHUNK_LAUNCH_SHAPES
    try:
        for tile, segment, warps in _SHAPES:
            tt.CHUNK_LAUNCH_SHAPES = ((2**40, tt.LaunchShape(tile, segment, warps)),)
            _assert_same(_run(device, "triton", store, chunk_offset))
            _assert_same(_run_groups(device, "triton", store, chunk_offset))
        # The first group's largest region is 64 bytes, the second's 48: the launch takes the shape
        # of the largest region of all.
        small = tt.LaunchShape(8, 32, 2)
        for limit, picked in ((50, tt.default_launch_shape(torch.device(device))), (64, small)):
            tt.CHUNK_LAUNCH_SHAPES = ((limit, small),)
            tt._chunks_launches.clear()
            _assert_same(_run_groups(device, "triton", store, chunk_offset))
            assert {launch.shape for launch in tt._chunks_launches.values()} == {picked}
    finally:
        tt.CHUNK_LAUNCH_SHAPES = saved


def test_launch_shape_is_picked_by_the_largest_region():
    pytest.importorskip("triton")
    from lmcache_ascend.kernels import triton_transfer as tt

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # (devices are only named: nothing runs)
    small = tt.chunk_launch_shape(1152, cpu)
    assert small.tile < tt.DEFAULT_LAUNCH_SHAPE.tile
    for device in (cpu, cuda):
        assert tt.chunk_launch_shape(8192, device) == small
    assert tt.chunk_launch_shape(8193, cpu) == tt.chunk_launch_shape(294912, cpu) == tt.DEFAULT_LAUNCH_SHAPE
    # CUDA's wider steps, and the NPU's (triton-ascend) default, untimed there
    assert tt.chunk_launch_shape(8193, cuda) == tt.chunk_launch_shape(294912, cuda) == tt.CUDA_LAUNCH_SHAPE
    assert tt.default_launch_shape(torch.device("privateuseone")) == tt.DEFAULT_LAUNCH_SHAPE  # torch_npu's backend


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("store", [True, False])
def test_triton_batch_equals_single_chunk_calls_on_cuda(store):
    _assert_same(_run("cuda", "triton", store))
    _assert_same(_run_groups("cuda", "triton", store))
    _run_shapes("cuda", store)


def test_triton_batch_equals_single_chunk_calls_interpreted(interpreted):
    code = (
        "from tests.kernels.test_chunk_batch import _run, _assert_same\n"
        "from tests.kernels.test_chunk_batch import _run_groups\n"
        "for store in (True, False):\n"
        "    for offset in (0, 32, 40):\n"
        "        _assert_same(_run('cpu', 'triton', store, offset))\n"
        "        _assert_same(_run_groups('cpu', 'triton', store, offset))\n"
        "from tests.kernels.test_chunk_batch import test_chunks_of_a_pool_move_like_separate_chunks as pool\n"
        "pool('triton')\n"
        "from tests.kernels.test_chunk_batch import _run_shapes\n"
        "for store in (True, False):\n"
        "    _run_shapes('cpu', store, 40)\n"
    )
    interpreted(code)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_back_to_back_launches_each_move_their_own_chunks_on_cuda():
    """Multi-chunk launches keep their address table per stream and reuse it: launches queued one
    after another (no wait between them) over other chunk buffers must each read their own
    addresses. A launch on a second stream gets a table of its own."""
    group, slots, starts, counts, regions, caches = _case("cuda")
    rows = chunk_rows(group, regions, starts, counts)
    rounds = [_poisoned_chunks(regions, len(starts), "cuda", 32) for _ in range(6)]
    for chunks in rounds:
        for chunk in chunks:
            chunk.fill_(0xA5)
    side = torch.cuda.Stream()
    for index, chunks in enumerate(rounds):
        batch = resolve_chunk_batch(slots, chunks, rows, store=True, chunk_offset=32)
        if index % 3 == 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                transfer_chunk_batches([batch], backend="triton")
            torch.cuda.current_stream().wait_stream(side)
        else:
            transfer_chunk_batches([batch], backend="triton")
    torch.cuda.synchronize()
    expected = _poisoned_chunks(regions, len(starts), "cuda", 32)
    for chunk in expected:
        chunk.fill_(0xA5)
    batch = resolve_chunk_batch(slots, expected, rows, store=True, chunk_offset=32)
    transfer_chunk_batches([batch], backend="torch")
    assert any(bool((chunk != 0xA5).any()) for chunk in expected), "the control moved nothing"
    for chunks in rounds:
        for got, want in zip(chunks, expected):
            assert torch.equal(got, want)


@pytest.fixture(params=[True, False], ids=["raw launcher", "compiled kernel's runner (as on an NPU)"])
def relaunch_through(request):
    """Launches made again through CUDA's raw launcher, and through the compiled kernel's runner."""
    from lmcache_ascend.kernels import launcher, triton_transfer

    launcher._raw_launch["enabled"] = request.param
    triton_transfer._chunks_launches.clear()  # relaunches are made anew under this launcher
    yield request.param
    launcher._raw_launch["enabled"] = True
    triton_transfer._chunks_launches.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pooled", [False, True], ids=["separate chunks", "chunks of a pool (staging waves)"])
def test_a_launch_made_again_reads_each_calls_addresses_on_cuda(pooled, relaunch_through):
    """From its second call a multi-chunk launch of the same rows is made again with only the new
    address table (or pool and offsets) and slot tensor (`_ChunksLaunch.relaunches`): calls
    alternating between two slot tensors, and over other chunks or pool offsets, must each move by
    their own."""
    from lmcache_ascend.kernels import pool_chunk_buffers, triton_transfer

    group, slots, starts, counts, regions, caches = _case("cuda")
    rows = chunk_rows(group, regions, starts, counts)
    other = slots.flip(0).contiguous()  # other slots, same entries: another row order
    stride = regions.total_bytes + 48
    results, expected = [], []
    for index in range(4):
        used = slots if index % 2 == 0 else other
        expected_chunks = [torch.full((regions.total_bytes,), 0xA5, dtype=torch.uint8, device="cuda")
                           for _ in range(len(starts))]
        transfer_chunk_batches([resolve_chunk_batch(used, expected_chunks, rows, store=True)], backend="torch")
        expected.append(expected_chunks)
        if pooled:
            pool = torch.full((len(starts) * stride + 64 * (index + 1),), 0xA5, dtype=torch.uint8, device="cuda")
            offsets = np.arange(len(starts), dtype=np.int64) * stride + 16 * index  # other offsets each call
            chunks = pool_chunk_buffers(pool, offsets, regions.total_bytes)
            got = [pool[offset : offset + regions.total_bytes] for offset in offsets.tolist()]
        else:
            got = [torch.full((regions.total_bytes,), 0xA5, dtype=torch.uint8, device="cuda")
                   for _ in range(len(starts))]
            chunks = got
        transfer_chunk_batches([resolve_chunk_batch(used, chunks, rows, store=True)], backend="triton")
        results.append(got)
    torch.cuda.synchronize()
    kept = [relaunch for launch in triton_transfer._chunks_launches._entries.values()
            for relaunch in launch.relaunches.values()]
    assert any(relaunch is not None for relaunch in kept), "no launch was kept to be made again"
    assert not all(torch.equal(a, b) for a, b in zip(expected[0], expected[1])), "both slot tensors move alike"
    for got_chunks, want_chunks in zip(results, expected):
        for got, want in zip(got_chunks, want_chunks):
            assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_kept_relaunch_outlives_the_launch_cache_on_cuda():
    """A launch kept for later calls (LMCache's repeated block calls keep one) holds the device tables
    its addresses point into: after the launch cache lets them go and their memory is handed out
    again (filled with other bytes), the kept launch still moves the right bytes."""
    import gc

    from lmcache_ascend.kernels import triton_transfer
    from lmcache_ascend.kernels.dispatch import prepare_chunks_relaunch

    group, slots, starts, counts, regions, caches = _case("cuda")
    rows = chunk_rows(group, regions, starts, counts)
    chunks = _poisoned_chunks(regions, len(starts), "cuda", 0)
    batch = resolve_chunk_batch(slots, chunks, rows, store=True)
    transfer_chunk_batches([batch], backend="triton")
    relaunch = prepare_chunks_relaunch(batch)
    assert relaunch is not None
    triton_transfer._chunks_launches.clear()
    gc.collect()
    # take the freed memory back (the caching allocator hands out freed blocks first) and dirty it
    grabbed = [torch.full((n,), 0x7F, dtype=torch.uint8, device="cuda") for n in (64, 128, 256, 512, 1024) * 8]
    again = _poisoned_chunks(regions, len(starts), "cuda", 0)
    for chunk in again:
        chunk.fill_(0xA5)
    addresses = np.array([chunk.data_ptr() for chunk in again], dtype=np.int64)
    assert relaunch(addresses, slots)
    expected = _poisoned_chunks(regions, len(starts), "cuda", 0)
    for chunk in expected:
        chunk.fill_(0xA5)
    transfer_chunk_batches([resolve_chunk_batch(slots, expected, rows, store=True)], backend="torch")
    torch.cuda.synchronize()
    del grabbed
    for got, want in zip(again, expected):
        assert torch.equal(got, want)
