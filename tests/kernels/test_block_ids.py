"""Block ids as the slot array (`rows_per_id` > 1): the kernels expand them, byte for byte as the slots.

The control is the same transfer given the slots themselves (`slots[r] = ids[r // n] * n + r % n`,
worked out here with numpy; the slot form is tested against independent expectations in
test_transfer_roundtrip and test_chunk_batch). Chunks and caches start poisoned and are compared
whole. The Triton kernel runs under TRITON_INTERPRET=1 on the CPU (in a subprocess) and on a CUDA
device when there is one.
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

ROWS_PER_ID = 4


def _case(device: str, seed: int = 0):
    """Two planes (fp16 rows of 16 bytes in 2-row blocks, int8 rows of 12 in 4-row blocks), 3 layers,
    and 12 block ids of 4 rows: distinct ids inside both caches, one -1, and ids past either cache."""
    generator = torch.Generator().manual_seed(seed)
    caches_a = [torch.randint(0, 256, (10, 2, 16), dtype=torch.uint8, generator=generator).to(device)
                .view(torch.float16) for _ in range(3)]
    caches_b = [torch.randint(0, 256, (7, 4, 12), dtype=torch.uint8, generator=generator).to(device).view(torch.int8)
                for _ in range(3)]
    group = PagedGroup((PagedPlane(tuple(caches_a), 2, 16, name="a"), PagedPlane(tuple(caches_b), 4, 12, name="b")))
    ids = torch.randperm(5, generator=generator).tolist()  # blocks of 4 rows: 0..4 lie in both caches (20 rows)
    ids += [-1, 6, 1_000_000] + torch.randperm(5, generator=generator).add(10).tolist()[:4]
    return group, torch.tensor(ids, dtype=torch.int64, device=device), caches_a + caches_b


def _expanded(ids: torch.Tensor, rows_per_id: int) -> torch.Tensor:
    """The slots block ids stand for, worked out on the host: what the kernels must read them as."""
    values = ids.cpu().numpy()
    rows = np.arange(len(values) * rows_per_id)
    owners = values[rows // rows_per_id]
    slots = np.where(owners >= 0, owners * rows_per_id + rows % rows_per_id, -1)
    return torch.from_numpy(slots).to(ids.device)


def _poisoned(size: int, device: str, seed: int = 99) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).to(device)


def _single(device: str, backend: str, store: bool, as_ids: bool, start: int, count: int):
    group, ids, caches = _case(device)
    slots = ids if as_ids else _expanded(ids, ROWS_PER_ID)
    per_id = ROWS_PER_ID if as_ids else 1
    regions = group.chunk_regions([count, count])
    chunk = _poisoned(regions.total_bytes + 40, device)
    transfer_group(group, tuple(PlaneSlots(slots, start, count, rows_per_id=per_id) for _ in range(2)), chunk,
                   store=store, chunk_offset=8, backend=backend, regions=regions)
    return chunk, caches


def _batch(device: str, backend: str, store: bool, as_ids: bool):
    group, ids, caches = _case(device)
    slots = ids if as_ids else _expanded(ids, ROWS_PER_ID)
    # rows of one plane disjoint across chunks: a load of one slot from two chunks writes either
    starts = np.array([[0, 4], [8, 20], [30, 12], [44, 36]], dtype=np.int64)
    counts = np.array([[8, 8], [8, 3], [5, 8], [4, 8]], dtype=np.int64)
    regions = group.chunk_regions([8, 8])
    chunks = [_poisoned(regions.total_bytes + 24, device, seed) for seed in range(len(starts))]
    batch = resolve_chunk_batch(slots, chunks, chunk_rows(group, regions, starts, counts), store=store,
                                chunk_offset=16, rows_per_id=ROWS_PER_ID if as_ids else 1)
    launch_counter.reset()
    assert transfer_chunk_batches([batch], backend=backend) == 1
    return chunks, caches


def _bytes(result) -> list[torch.Tensor]:
    chunks, caches = result
    chunks = chunks if isinstance(chunks, list) else [chunks]
    if chunks[0].device.type == "cuda":
        torch.cuda.synchronize()
    return [c.view(torch.uint8).cpu().clone() for c in (*chunks, *caches)]


def _assert_block_ids_move_as_their_slots(device: str, backend: str) -> None:
    for store in (True, False):
        for start, count in ((0, 48), (3, 29), (21, 6)):
            ours = _bytes(_single(device, backend, store, True, start, count))
            control = _bytes(_single(device, backend, store, False, start, count))
            assert all(torch.equal(a, b) for a, b in zip(ours, control)), (store, start, count)
            untouched = _bytes((_poisoned(len(ours[0]), device), _case(device)[2]))
            assert not all(torch.equal(a, b) for a, b in zip(ours, untouched)), "nothing moved"
        ours, control = _bytes(_batch(device, backend, store, True)), _bytes(_batch(device, backend, store, False))
        assert all(torch.equal(a, b) for a, b in zip(ours, control)), store


def test_reference_moves_block_ids_as_their_slots():
    _assert_block_ids_move_as_their_slots("cpu", "torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_moves_block_ids_as_their_slots_on_cuda():
    _assert_block_ids_move_as_their_slots("cuda", "triton")


def test_triton_moves_block_ids_as_their_slots_interpreted(interpreted):
    interpreted("from tests.kernels.test_block_ids import _assert_block_ids_move_as_their_slots as check\n"
                "check('cpu', 'triton')")


def test_block_id_inputs_are_refused_naming_them():
    group, ids, _ = _case("cpu")
    regions = group.chunk_regions([8, 8])
    chunk = torch.zeros(regions.total_bytes, dtype=torch.uint8)
    with pytest.raises(TransferError, match=r"rows_per_id=0 is not allowed; allowed: an int > 0"):
        PlaneSlots(ids, 0, 8, rows_per_id=0)
    with pytest.raises(TransferError, match=r"start=44 \+ count=8 exceeds its 48 rows \(12 block ids of 4 rows\)"):
        transfer_group(group, (PlaneSlots(ids, 44, 8, rows_per_id=4),) * 2, chunk, store=True, regions=regions)
    with pytest.raises(TransferError, match=r"slots\[1\] has rows_per_id=1 but slots\[0\] has 4"):
        transfer_group(group, (PlaneSlots(ids, 0, 8, rows_per_id=4), PlaneSlots(ids, 0, 8)), chunk, store=True,
                       regions=regions)
    with pytest.raises(TransferError, match=r"slots\[1\] holds block ids in another tensor than slots\[0\]"):
        transfer_group(group, (PlaneSlots(ids, 0, 8, rows_per_id=4), PlaneSlots(ids.clone(), 0, 8, rows_per_id=4)),
                       chunk, store=True, regions=regions)
    rows = chunk_rows(group, regions, np.array([[44, 0]]), np.array([[8, 8]]))
    with pytest.raises(TransferError, match=r"start=44 \+ count=8 exceeds the 48 slots"):
        resolve_chunk_batch(ids, [chunk], rows, store=True, rows_per_id=4)
    with pytest.raises(TransferError, match=r"rows_per_id=-4 is not allowed"):
        resolve_chunk_batch(ids, [chunk], rows, store=True, rows_per_id=-4)
