"""The torch path of multi-chunk transfers (`torch_transfer_chunks`) equals the reference, byte for byte.

The control is `reference_transfer_chunks` (itself tested against single-chunk calls and
the independent expectation of test_transfer_roundtrip). Both run on copies of the same
poisoned chunks and random caches; every byte of every chunk and cache is compared, so
a byte written where the reference leaves it alone shows up. Each case also says which
way it must have gone (its own path, or the reference for holes): a fast path that
quietly falls back fails here.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from lmcache_ascend.kernels import (
    PagedGroup,
    PagedPlane,
    chunk_rows,
    pool_chunk_buffers,
    resolve_chunk_batch,
)
from lmcache_ascend.kernels import torch_batch
from lmcache_ascend.kernels.reference import reference_transfer_chunks
from lmcache_ascend.kernels.spec import strided_chunk_regions

CHUNKS = 6


def _caches(generator, layers: int, blocks: int, block_size: int, row_bytes: int, dtype, spare: int):
    """Per layer a paged cache: views into a blob whose blocks lie `spare` bytes further apart than a block."""
    element = torch.empty(0, dtype=dtype).element_size()
    caches = []
    for _ in range(layers):
        blob = torch.randint(0, 256, (blocks, block_size * row_bytes + spare), dtype=torch.uint8, generator=generator)
        caches.append(blob[:, : block_size * row_bytes].view(dtype).view(blocks, block_size, row_bytes // element))
    return caches


def _case(seed: int, *, padded: bool, per_id: int, layout: str, holes: bool, odd_stride: bool = False):
    """(group, slots, starts, counts, regions): two planes (fp16 rows of 64 bytes in 4-row blocks,
    int8 rows of 24 bytes in 4-row blocks), 3 layers, CHUNKS chunks of 8 rows per plane."""
    generator = torch.Generator().manual_seed(seed)
    block_size, blocks, rows = 4, 40, 8
    group = PagedGroup((
        PagedPlane(tuple(_caches(generator, 3, blocks, block_size, 64, torch.float16, 192 if padded else 0)),
                   block_size, 64, "k"),
        PagedPlane(tuple(_caches(generator, 3, blocks, block_size, 24, torch.int8, 8 if odd_stride else 0)),
                   block_size, 24, "v"),
    ))
    if per_id == 1:  # distinct slots: which of two equal slots a load writes is unspecified
        slots = torch.randperm(blocks * block_size, generator=generator)[: 2 * CHUNKS * rows]
    else:  # block ids, each standing for `per_id` = block_size consecutive slots
        slots = torch.randperm(blocks, generator=generator)[: 2 * CHUNKS * rows // per_id]
    if holes:
        slots[5] = -1
    slots = slots.to(torch.int64).contiguous()
    plane_rows = CHUNKS * rows  # plane k's rows first, then plane v's
    starts = np.array([[c * rows, plane_rows + c * rows] for c in range(CHUNKS)], dtype=np.int64)
    counts = np.full((CHUNKS, 2), rows, dtype=np.int64)
    counts[1, 0], counts[4, 1], counts[5, 0] = 5, 0, 1  # chunks move different numbers of rows
    if layout == "packed":  # rows back to back, no padding: the moved rows cover the chunk's part
        regions = group.chunk_regions([rows, rows], alignment=1)
    elif layout == "aligned":  # regions padded to 256 bytes
        regions = group.chunk_regions([rows, rows], alignment=256)
    elif layout == "spare-rows":  # regions of 10 rows, 8 moved
        regions = group.chunk_regions([rows + 2, rows + 2], alignment=1)
    else:  # token-major: each token's k row then v row, then the next token (pitches > row bytes)
        regions = strided_chunk_regions([64, 24], [rows, rows], [0, 64], [88, 88], rows * 88, 3)
    return group, slots, starts, counts, regions


def _poisoned(regions, offset: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (offset + regions.total_bytes + 9,), dtype=torch.uint8, generator=generator)
            for _ in range(CHUNKS)]


def _all_bytes(group, chunks) -> list[torch.Tensor]:
    caches = [cache for plane in group.planes for cache in plane.caches]
    return [c.clone() for c in chunks] + [cache.view(torch.uint8).clone() for cache in caches]


def _run(monkeypatch, case: dict, store: bool, fast: bool, pooled: bool = False):
    """Every byte after one transfer; and how many times the reference ran."""
    group, slots, starts, counts, regions = _case(**case)
    offset = 40
    chunks = _poisoned(regions, offset, seed=7)
    buffers = chunks
    if pooled:
        stride = offset + regions.total_bytes + 9
        pool = torch.cat(chunks)
        buffers = pool_chunk_buffers(pool, np.arange(CHUNKS, dtype=np.int64) * stride, stride)
    batch = resolve_chunk_batch(slots, buffers, chunk_rows(group, regions, starts, counts), store=store,
                                chunk_offset=offset, rows_per_id=case["per_id"])
    calls = []
    monkeypatch.setattr(torch_batch, "reference_transfer_chunks",
                        lambda b: (calls.append(b), reference_transfer_chunks(b)))
    (torch_batch.torch_transfer_chunks if fast else reference_transfer_chunks)(batch)
    if pooled:
        chunks = list(pool.split(stride))
    return _all_bytes(group, chunks), len(calls)


CASES = [dict(seed=seed, padded=padded, per_id=per_id, layout=layout, holes=False)
         for seed, (padded, per_id, layout) in enumerate(itertools.product(
             (False, True), (1, 4), ("packed", "aligned", "spare-rows", "token-major")))]


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['layout']}-{'padded' if c['padded'] else 'dense'}-ids{c['per_id']}")
def test_the_torch_path_equals_the_reference_byte_for_byte(monkeypatch, case, store):
    fast, fallbacks = _run(monkeypatch, case, store, fast=True)
    reference, _ = _run(monkeypatch, case, store, fast=False)
    assert fallbacks == 0, "a batch without holes went to the reference"
    for index, (ours, theirs) in enumerate(zip(fast, reference)):
        assert torch.equal(ours, theirs), f"tensor {index} differs from the reference"
    before = _all_bytes(*_before(case))
    assert any(not torch.equal(a, b) for a, b in zip(fast, before)), "the transfer moved nothing"


def _before(case: dict):
    group, *_, regions = _case(**case)
    return group, _poisoned(regions, 40, seed=7)


# (case, pooled chunks, how many batches the reference moves): pool buffers take the torch path;
# a hole, or a block stride of no whole rows, is the reference's.
ROUTES = {
    "pool": ({**CASES[0]}, True, 0),
    "hole": ({**CASES[1], "holes": True}, False, 1),
    "odd-block-stride": ({**CASES[0], "odd_stride": True}, False, 1),
}


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_each_batch_takes_its_route_and_equals_the_reference(monkeypatch, route, store):
    case, pooled, reference_batches = ROUTES[route]
    ours, fallbacks = _run(monkeypatch, case, store, fast=True, pooled=pooled)
    reference, _ = _run(monkeypatch, case, store, fast=False)
    assert fallbacks == reference_batches
    for index, (mine, theirs) in enumerate(zip(ours, reference)):
        assert torch.equal(mine, theirs), f"tensor {index} differs from the reference"
