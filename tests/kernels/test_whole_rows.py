"""Chunks of token rows moved whole (`kernels.whole_rows`): byte for byte as the torch reference moves them.

The chunks are LMCache's plane-tuple objects in small: per layer, token rows that hold every
plane side by side (gaps between planes included, which nothing may write), three chunks of two
8-row blocks each, the last one moving one block; rows short and long enough to take one, four
and eight steps a block. The block ids come on the device and include
one only the first plane's cache holds (the other planes' columns of that block stay as they
were), one -1 (nothing moves), and a block moved twice (by two chunks: a load writes it from
either; the test keeps those bytes equal in both chunks). Chunks and caches start poisoned and are
compared whole against the reference's run of the same call; a layout whose rows the per-plane
kernel moves 16 bytes wide is the control that takes the per-plane kernel. The Triton kernel runs
under TRITON_INTERPRET=1 on the CPU (in a subprocess) and on a CUDA device when there is one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmcache_ascend.kernels import PagedGroup, PagedPlane, chunk_rows, resolve_chunk_batch, transfer_chunk_batches
from lmcache_ascend.kernels.spec import strided_chunk_regions
from lmcache_ascend.kernels.upload import stream_table

BLOCK_SIZE = 8
LAYERS = 3
# (each plane's row bytes, gap bytes after each plane, the element width whole rows move with; 0: the
# per-plane kernel moves the layout)
LAYOUTS = (
    ((16, 8, 2), (0, 0, 0), 2),  # DeepSeek-V4's bundle in small: fp8 latent, bf16 rope, fp16 scale
    ((12, 4, 1), (1, 0, 2), 1),
    ((8, 16), (0, 8), 8),
    ((4, 8, 4), (4, 0, 0), 4),
    ((512, 128, 2), (0, 0, 0), 2),  # 321-element rows: two a step, four steps a block
    ((1040, 64, 2), (0, 0, 0), 2),  # 553-element rows: one a step, eight steps a block
    ((32, 16), (0, 0), 0),  # every offset a multiple of 16: the per-plane kernel moves 16 bytes at a time
)


def _layout(widths, gaps, device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    # the first plane's caches hold one block more than the others': block 5 is only theirs
    caches = [[torch.randint(0, 256, (6 if plane == 0 else 5, BLOCK_SIZE, width), dtype=torch.uint8,
                             generator=generator).to(device) for _ in range(LAYERS)]
              for plane, width in enumerate(widths)]
    group = PagedGroup(tuple(PagedPlane(tuple(per_layer), BLOCK_SIZE, width, name=f"p{plane}")
                             for plane, (per_layer, width) in enumerate(zip(caches, widths))))
    starts = [sum(widths[:plane]) + sum(gaps[:plane]) for plane in range(len(widths))]
    pitch = sum(widths) + sum(gaps)
    return group, [cache for per_plane in caches for cache in per_plane], starts, pitch


def _move(widths, gaps, device: str, backend: str, store: bool, seed: int = 0):
    """(chunks and caches before the call, after it, the batch) of one call of every chunk."""
    group, caches, starts, pitch = _layout(widths, gaps, device, seed)
    tokens = 2 * BLOCK_SIZE
    regions = strided_chunk_regions(widths, (tokens,) * len(widths), starts, (pitch,) * len(widths), tokens * pitch,
                                    LAYERS)
    generator = torch.Generator().manual_seed(seed + 1)
    chunks = [torch.randint(0, 256, (LAYERS * tokens * pitch,), dtype=torch.uint8, generator=generator).to(device)
              for _ in range(3)]
    if not store:  # block 2 is loaded from chunks 0 and 2: the same bytes in both, so either write is right
        chunks[2].view(LAYERS, tokens, pitch)[:, :BLOCK_SIZE] = chunks[0].view(LAYERS, tokens, pitch)[:, :BLOCK_SIZE]
    ids = torch.tensor([2, 5, 0, -1, 2], dtype=torch.int64, device=device)
    planes = len(widths)
    rows = chunk_rows(group, regions, np.array([[0], [tokens], [2 * tokens]]).repeat(planes, axis=1),
                      np.array([[tokens], [tokens], [BLOCK_SIZE]]).repeat(planes, axis=1))
    before = [t.cpu().clone() for t in (*chunks, *caches)]
    batch = resolve_chunk_batch(ids, chunks, rows, store=store, rows_per_id=BLOCK_SIZE)
    assert transfer_chunk_batches([batch], backend=backend) == 1
    if device == "cuda":
        torch.cuda.synchronize()
    return before, [t.cpu().clone() for t in (*chunks, *caches)], batch


def _whole_rows_of(batch):
    """The whole-row shape of the launch the Triton backend kept for `batch` (None: the per-plane kernel's)."""
    from lmcache_ascend.kernels import triton_transfer

    alignment = math.gcd(batch.buffers.address_gcd, stream_table(batch.group.device, len(batch.buffers)).data_ptr())
    shape = triton_transfer.chunk_launch_shape(batch.rows.max_region_bytes, batch.group.device)
    return triton_transfer._chunks_launch([batch], alignment, shape).whole_rows


def _assert_whole_rows_move_as_the_reference(device: str) -> None:
    for widths, gaps, element in LAYOUTS:
        for store in (True, False):
            before, ours, batch = _move(widths, gaps, device, "triton", store)
            whole = _whole_rows_of(batch)
            assert (whole.element if whole is not None else 0) == element, (widths, gaps, whole)
            _, reference, _ = _move(widths, gaps, "cpu", "torch", store)
            for index, (a, b) in enumerate(zip(ours, reference)):
                assert torch.equal(a, b), (widths, gaps, store, index, int((a != b).sum()))
            written = slice(0, 3) if store else slice(3, None)
            assert not all(torch.equal(a, b) for a, b in zip(ours[written], before[written])), "nothing moved"
    _assert_slots_after_block_ids_take_their_own_launch(device)


def _assert_slots_after_block_ids_take_their_own_launch(device: str) -> None:
    """The same rows moved by block ids (whole rows), then by the slots those ids stand for: the
    second launch must read slots, not reuse the first one's kernel."""
    widths, gaps, _ = LAYOUTS[0]
    group, caches, starts, pitch = _layout(widths, gaps, device, 0)
    tokens = 2 * BLOCK_SIZE
    regions = strided_chunk_regions(widths, (tokens,) * len(widths), starts, (pitch,) * len(widths), tokens * pitch,
                                    LAYERS)
    rows = chunk_rows(group, regions, np.array([[0], [tokens]]).repeat(len(widths), axis=1),
                      np.array([[tokens], [tokens]]).repeat(len(widths), axis=1))
    ids = torch.tensor([3, 0, 4, 1], dtype=torch.int64)
    slots = (ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1)
    moved = []
    for values, per_id in ((ids, BLOCK_SIZE), (slots, 1)):
        chunks = [torch.full((LAYERS * tokens * pitch,), 0xA5, dtype=torch.uint8, device=device) for _ in range(2)]
        batch = resolve_chunk_batch(values.to(device), chunks, rows, store=True, rows_per_id=per_id)
        assert transfer_chunk_batches([batch], backend="triton") == 1
        assert (_whole_rows_of(batch) is not None) == (per_id > 1), per_id
        moved.append([chunk.cpu() for chunk in chunks])
    for by_ids, by_slots in zip(*moved):
        assert torch.equal(by_ids, by_slots)
    assert not all(bool((chunk == 0xA5).all()) for chunk in moved[0]), "nothing moved"


def _decision():
    """`whole_rows_layout` for chunks aligned to 16 bytes, given the planes' gcds as the Triton backend gives them."""
    triton_transfer = pytest.importorskip("lmcache_ascend.kernels.triton_transfer")

    def decide(batches):
        return triton_transfer.whole_rows_layout(batches, 16,
                                                 triton_transfer._group_geometry(batches[0].group).plane_gcds)

    return decide


def test_whole_rows_are_chosen_only_where_rows_lack_a_wide_divisor():
    whole_rows_layout = _decision()
    for widths, gaps, element in LAYOUTS:
        _, _, batch = _move(widths, gaps, "cpu", "torch", True)
        whole = whole_rows_layout([batch])
        assert (whole.element if whole is not None else 0) == element, (widths, gaps, whole)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_whole_rows_move_as_the_reference_on_cuda():
    _assert_whole_rows_move_as_the_reference("cuda")


def test_whole_rows_move_as_the_reference_interpreted(interpreted):
    interpreted("from tests.kernels.test_whole_rows import _assert_whole_rows_move_as_the_reference as check\n"
                "check('cpu')")


def test_whole_rows_refuse_what_they_do_not_move_whole():
    """Slots rather than block ids, parts of blocks, planes moving different rows and launches of several
    layer groups take the per-plane kernel."""
    whole_rows_layout = _decision()
    widths, gaps = LAYOUTS[0][:2]
    group, _, starts, pitch = _layout(widths, gaps, "cpu", 0)
    tokens = 2 * BLOCK_SIZE
    regions = strided_chunk_regions(widths, (tokens,) * len(widths), starts, (pitch,) * len(widths), tokens * pitch,
                                    LAYERS)
    chunks = [torch.zeros(LAYERS * tokens * pitch, dtype=torch.uint8) for _ in range(2)]
    ids = torch.tensor([2, 0, 1, 3], dtype=torch.int64)
    planes = len(widths)

    def batch(first_rows, counts, rows_per_id=BLOCK_SIZE, slots=ids):
        rows = chunk_rows(group, regions, np.array(first_rows), np.array(counts))
        return resolve_chunk_batch(slots, chunks, rows, store=True, rows_per_id=rows_per_id)

    whole = batch([[0] * planes, [tokens] * planes], [[tokens] * planes, [tokens] * planes])
    assert whole_rows_layout([whole]) is not None
    slots = torch.arange(4 * BLOCK_SIZE, dtype=torch.int64)
    refused = {
        "slots": batch([[0] * planes, [tokens] * planes], [[tokens] * planes] * 2, rows_per_id=1, slots=slots),
        "part of a block": batch([[0] * planes, [tokens] * planes], [[tokens] * planes, [3] * planes]),
        "planes moving different rows": batch([[0] * planes, [tokens] * planes],
                                              [[tokens] * planes, [BLOCK_SIZE] + [tokens] * (planes - 1)]),
    }
    for name, refused_batch in refused.items():
        assert whole_rows_layout([refused_batch]) is None, name
    assert whole_rows_layout([whole, whole]) is None, "two layer groups"
