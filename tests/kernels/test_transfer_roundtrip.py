"""Fuzz round trip of the transfer contract on CPU (torch reference), byte exact.

Every buffer starts as random poison; a store must write exactly the valid rows
of the chunk (nothing else, caches untouched) and a load into fresh poisoned
caches must write exactly the valid rows back (rows with -1 or out-of-range
slots keep their poison).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings

from lmcache_ascend.kernels import PagedGroup, PagedPlane, PlaneSlots, launch_counter, transfer_group
from tests.kernels._cases import (
    build,
    describe,
    expected_chunk_after_store,
    expected_storages_after_load,
    transfer_cases,
    move_layers,
    poisoned_chunk,
)

FUZZ_EXAMPLES = 1000


def round_trip(case, backend: str, device: str = "cpu") -> None:
    """Store then load `case` with `backend`, checking every byte of every buffer."""
    source = build(case, device=device, seed_offset=0)
    source_before = [storage.clone() for storage in source.storages]
    chunk = poisoned_chunk(source.chunk_bytes, case.seed + 1, device=device)
    expected_chunk = expected_chunk_after_store(source, case, chunk)
    transfer_group(source.group, source.slots, chunk, store=True, chunk_offset=case.chunk_offset,
                   alignment=case.alignment, backend=backend)
    assert torch.equal(chunk, expected_chunk), f"store wrote wrong chunk bytes for {describe(case)}"
    for before, after in zip(source_before, source.storages):
        assert torch.equal(before, after), f"store wrote into the paged caches for {describe(case)}"

    target = build(case, device=device, seed_offset=1)  # the same geometry, different poison
    expected_target = expected_storages_after_load(target, case, chunk)
    chunk_before_load = chunk.clone()
    transfer_group(target.group, target.slots, chunk, store=False, chunk_offset=case.chunk_offset,
                   alignment=case.alignment, backend=backend)
    assert torch.equal(chunk, chunk_before_load), f"load wrote into the chunk for {describe(case)}"
    for expected, actual in zip(expected_target, target.storages):
        assert torch.equal(expected, actual), f"load wrote wrong paged bytes for {describe(case)}"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=transfer_cases())
def test_fuzz_store_then_load_is_byte_exact(case):
    round_trip(case, backend="torch")


def test_minus_one_rows_are_untouched_and_chunk_rows_keep_their_poison():
    caches = [torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3) + 100 * layer for layer in range(2)]
    slots = torch.tensor([5, -1, 0, 8], dtype=torch.int64)  # 8 is past the 8 rows: skipped
    chunk = torch.full((2 * 64,), 0xEE, dtype=torch.uint8)
    move_layers(caches, slots, chunk, store=True, block_size=2, row_bytes=12)
    layer0 = chunk[:48].view(4, 12)
    assert torch.equal(layer0[0], caches[0][2, 1].view(torch.uint8))
    assert torch.equal(layer0[2], caches[0][0, 0].view(torch.uint8))
    assert bool((layer0[1] == 0xEE).all()) and bool((layer0[3] == 0xEE).all())
    assert bool((chunk[48:64] == 0xEE).all()), "the alignment padding must stay untouched"
    assert torch.equal(chunk[64:112].view(4, 12)[0], caches[1][2, 1].view(torch.uint8))

    targets = [torch.full((4, 2, 3), -7.0) for _ in range(2)]
    move_layers(targets, slots, chunk, store=False, block_size=2, row_bytes=12)
    for layer in range(2):
        touched = torch.zeros(4, 2, dtype=torch.bool)
        touched[2, 1] = touched[0, 0] = True
        assert torch.equal(targets[layer][touched], caches[layer][touched])
        assert bool((targets[layer][~touched] == -7.0).all())


def test_dense_multi_layer_layout_with_alignment_one_matches_lmcache_layout():
    caches = [torch.randn(3, 4, 5) for _ in range(3)]
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.int64)
    chunk = torch.empty(3, 7, 5)  # LMCache's [layers, tokens, hidden]
    move_layers(caches, slots, chunk, store=True, block_size=4, row_bytes=20, alignment=1)
    for layer in range(3):
        assert torch.equal(chunk[layer], caches[layer].reshape(12, 5)[:7])


def test_bundled_group_is_one_call_per_chunk():
    planes = (
        PagedPlane([torch.zeros(2, 4, 8, dtype=torch.int8) for _ in range(3)], 4, 8),
        PagedPlane([torch.zeros(2, 2, 1, dtype=torch.float16) for _ in range(3)], 2, 2),
    )
    group = PagedGroup(planes)
    chunk = torch.zeros(group.chunk_regions([4, 2]).total_bytes, dtype=torch.uint8)
    launch_counter.reset()
    transfer_group(group, [PlaneSlots(torch.arange(4)), PlaneSlots(torch.arange(2))], chunk, store=True,
                   backend="torch")
    assert launch_counter.torch == 1 and launch_counter.triton == 0
