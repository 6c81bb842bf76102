"""Fixed transfer cases from past failures, runnable on any backend and device.

`merged L=1 [int8x1 bs=1 nb=1 count=1] x 2, plane 1 slot out of range` failed once
under Triton's interpreter ("store wrote wrong chunk bytes"): plane 1's only slot
(1) is one past its cache, so nothing may be written to plane 1's region. Here the
case runs with every neighbour of the slot arrays poisoned with values that would
be VALID slots if misread (0), with the slot arrays on either side of each other
in memory (negative and positive distances from the slot anchor), with an empty
first plane (the anchor must then be another plane), and with the per-group
tables rebuilt between calls, so a read of a wrong slot, a stale or short table,
or a wrong anchor shows up as a changed byte.
"""

from __future__ import annotations

import itertools

import torch

from lmcache_ascend.kernels import PagedGroup, PagedPlane, PlaneSlots, transfer_group
from tests.kernels._cases import TransferCase, PlaneCase

# Hypothesis's minimal failing example, verbatim.
MINIMAL_OUT_OF_RANGE = TransferCase(
    format="merged",
    layer_count=1,
    planes=(
        PlaneCase(torch.int8, 1, 1, 1, (0,), 0, 1, 1),
        PlaneCase(torch.int8, 1, 1, 1, (1,), 0, 1, 1),
    ),
    chunk_offset=0,
    alignment=32,
    seed=0,
)


def _pooled_slots(values_by_plane: list[list[int]], order: list[int], poison: int, device: str) -> list[torch.Tensor]:
    """Each plane's slots as a view into one pool, in `order`, separated by poison entries."""
    gap = 5
    pool = torch.full((gap + sum(len(v) + gap for v in values_by_plane),), poison, dtype=torch.int64)
    views: dict[int, tuple[int, int]] = {}
    cursor = gap
    for plane in order:
        values = values_by_plane[plane]
        pool[cursor : cursor + len(values)] = torch.tensor(values, dtype=torch.int64)
        views[plane] = (cursor, len(values))
        cursor += len(values) + gap
    pool = pool.to(device)
    return [pool[views[plane][0] : views[plane][0] + views[plane][1]] for plane in range(len(values_by_plane))]


def out_of_range_slot_cases(backend: str, device: str = "cpu") -> int:
    """Run the poisoned variants of the minimal failing case; return how many were checked."""
    checked = 0
    for reverse, poison, empty_first in itertools.product((False, True), (0, -1), (False, True)):
        both = torch.tensor([[[[11]]], [[[22]]]], dtype=torch.int8, device=device)  # merged K/V, 1 block of 1 row
        first = [] if empty_first else [0]
        slot_values = [first, [1]]  # plane 1's slot 1 is past its 1-row cache: skipped
        order = [1, 0] if reverse else [0, 1]
        slots = _pooled_slots(slot_values, order, poison, device)
        group = PagedGroup((PagedPlane((both[0],), 1, 1, name="k"), PagedPlane((both[1],), 1, 1, name="v")))
        chunk = torch.full((72,), 0xAB, dtype=torch.uint8, device=device)
        plane_slots = (PlaneSlots(slots[0], 0, len(first), region_rows=1), PlaneSlots(slots[1], 0, 1))
        transfer_group(group, plane_slots, chunk, store=True, backend=backend)
        expected = torch.full((72,), 0xAB, dtype=torch.uint8)
        if not empty_first:
            expected[0] = 11
        where = f"reverse={reverse} poison={poison} empty_first={empty_first} backend={backend}"
        assert torch.equal(chunk.cpu(), expected), f"store wrote wrong chunk bytes ({where}): {chunk.cpu().tolist()}"
        # Load back into a fresh cache: only plane 0's row may change.
        target = torch.tensor([[[[-5]]], [[[-6]]]], dtype=torch.int8, device=device)
        target_group = PagedGroup((PagedPlane((target[0],), 1, 1), PagedPlane((target[1],), 1, 1)))
        transfer_group(target_group, plane_slots, chunk, store=False, backend=backend)
        expected_target = [-5 if empty_first else 11, -6]
        assert target.flatten().cpu().tolist() == expected_target, f"load wrote wrong paged bytes ({where})"
        group.backend_cache.clear()  # the next variant rebuilds every table
        checked += 1
    return checked
