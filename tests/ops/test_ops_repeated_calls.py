"""Repeated calls of LMCache's ops: the kept launch moves exactly what the whole path moves.

LMCache calls `multi_layer_kv_transfer` once per chunk and `multi_layer_block_kv_transfer`
once per request, with the same caches and shapes every time; from the second call of a
shape the op makes the first call's launch again over the new buffers (see "repeated
calls" in op_surface/moves.py). Each call here has new buffers, slots or block ids;
every output byte is compared with an independent expectation (indexing the caches), on
poisoned outputs, and a call the repeat must refuse (other alignment, other object shape,
block ids outside the caches) still moves the right bytes or raises as the whole path does.
The direct launch exists on CUDA only; on the CPU the repeat is "none" and every call takes
the whole path (checked too).
"""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.kernels import TransferError, launch_counter
from lmcache_ascend.op_surface import per_block, moves
import lmcache_ascend.ops as ops

H2D, D2H = 0, 1
MLA = 3  # NL_X_NB_BS_HS
LAYERS, BLOCKS, BS, HIDDEN = 4, 24, 16, 72
POISON = -4096.0  # exact in bf16

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch a repeat makes needs a CUDA device")


def _caches(device: str, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(BLOCKS, BS, HIDDEN, generator=generator).to(device=device, dtype=torch.bfloat16)
            for _ in range(LAYERS)]


def _rows(caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([cache.reshape(-1, HIDDEN)[slots.cpu()].cpu() for cache in caches])


def _token_calls(device: str) -> int:
    """Stores then loads of 32-token chunks through a pointer table, each with new buffers and slots;
    returns the calls a kept repeat ran."""
    generator = torch.Generator().manual_seed(0)
    caches = _caches(device, generator)
    table = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64, device=device)
    repeated = 0
    for call in range(6):
        slots = torch.randperm(BLOCKS * BS, generator=generator)[:32].to(device)
        chunk = torch.full((1, LAYERS, 32, HIDDEN), POISON, dtype=torch.bfloat16, device=device)
        before = launch_counter.triton
        key = moves.repeat_key("multi_layer_kv_transfer", moves.transfer_backend(), (chunk, slots),
                              (device, BLOCKS * BS, D2H, MLA, BS, HIDDEN, 0, 0))
        kept = moves.repeats.lookup(table, key)[1]
        ops.multi_layer_kv_transfer(chunk, table, slots, device, BLOCKS * BS, D2H, MLA, BS, HIDDEN)
        repeated += kept is not None and kept is not moves.never and launch_counter.triton == before + 1
        assert torch.equal(chunk[0].cpu(), _rows(caches, slots)), f"store {call}"
        # load new values into the same slots, then read them back through the caches
        fresh = torch.randn(1, LAYERS, 32, HIDDEN, generator=generator).to(device=device, dtype=torch.bfloat16)
        others = torch.ones(BLOCKS * BS, dtype=torch.bool)
        others[slots.cpu()] = False
        untouched = [cache.reshape(-1, HIDDEN)[others].cpu().clone() for cache in caches]
        ops.multi_layer_kv_transfer(fresh, table, slots, device, BLOCKS * BS, H2D, MLA, BS, HIDDEN)
        assert torch.equal(_rows(caches, slots), fresh[0].cpu()), f"load {call}"
        assert all(torch.equal(cache.reshape(-1, HIDDEN)[others].cpu(), before_rows)
                   for cache, before_rows in zip(caches, untouched)), f"load {call} wrote other slots"
    # A chunk aligned otherwise (2 bytes past a 16-byte boundary): refused by the repeat, moved whole.
    slots = torch.randperm(BLOCKS * BS, generator=generator)[:32].to(device)
    backing = torch.full((1 + LAYERS * 32 * HIDDEN,), POISON, dtype=torch.bfloat16, device=device)
    shifted = backing[1:].view(1, LAYERS, 32, HIDDEN)
    assert shifted.data_ptr() % 16 == 2
    ops.multi_layer_kv_transfer(shifted, table, slots, device, BLOCKS * BS, D2H, MLA, BS, HIDDEN)
    assert torch.equal(shifted[0].cpu(), _rows(caches, slots))
    assert backing[0].item() == POISON, "the byte before the chunk was written"
    return repeated


def _desc() -> ops.PageBufferShapeDesc:
    desc = ops.PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 1, LAYERS, BLOCKS, BS, 1, HIDDEN
    desc.element_size, desc.dtype = 2, torch.bfloat16
    return desc


def _block_calls(device: str, count: int = 3) -> int:
    """Stores of `count` objects of 2 blocks (the last object half full) with new objects and block ids
    each call, ids as a list and as a device tensor; returns the calls a kept repeat ran."""
    generator = torch.Generator().manual_seed(1)
    caches = _caches(device, generator)
    repeated = 0
    for call in range(8):
        ids = torch.randperm(BLOCKS, generator=generator)[:2 * count - 1]
        # a list (odd calls), a device tensor, or a strided view of one (calls 2 and 6)
        block_ids = (ids.tolist() if call % 2 else ids.to(device) if call % 4 == 0
                     else ids.repeat_interleave(2).to(device)[::2])
        objects = [torch.full((LAYERS, 2 * BS, HIDDEN), POISON, dtype=torch.bfloat16, device=device)
                   for _ in range(count)]
        before = launch_counter.triton
        key = per_block._block_repeat_key(moves.transfer_backend(), objects, block_ids, (device, D2H, 2 * BS, MLA, 0),
                                          _desc())
        kept = moves.repeats.lookup(caches, key)[1]
        ops.multi_layer_block_kv_transfer(caches, objects, block_ids, device, D2H, _desc(), 2 * BS, MLA, 0)
        repeated += kept is not None and kept is not moves.never and launch_counter.triton == before + 1
        for index, obj in enumerate(objects):
            mine = ids[2 * index: 2 * index + 2]
            slots = (mine[:, None] * BS + torch.arange(BS)).reshape(-1)
            assert torch.equal(obj[:, : len(slots)].cpu(), _rows(caches, slots)), (call, index)
            assert (obj[:, len(slots):] == POISON).all(), f"call {call}: rows past the request's blocks were written"
    # Refusals: an object of another shape is named by the whole path; an id past the caches too.
    objects = [torch.zeros(LAYERS, 2 * BS, HIDDEN, dtype=torch.bfloat16, device=device) for _ in range(2)]
    objects.append(torch.zeros(LAYERS, 2 * BS, HIDDEN + 1, dtype=torch.bfloat16, device=device))
    with pytest.raises(TransferError, match=r"lmcache_objects_ptrs\[2\]"):
        ops.multi_layer_block_kv_transfer(caches, objects, [0, 1, 2, 3, 4], device, D2H, _desc(), 2 * BS, MLA, 0)
    objects = [torch.zeros(LAYERS, 2 * BS, HIDDEN, dtype=torch.bfloat16, device=device) for _ in range(3)]
    with pytest.raises(TransferError, match=rf"block_ids holds {BLOCKS}"):
        ops.multi_layer_block_kv_transfer(caches, objects, [0, 1, 2, 3, BLOCKS], device, D2H, _desc(), 2 * BS,
                                          MLA, 0)
    return repeated


BUNDLE = 17  # NL_X_NP_X_NB_BS_ONE_HS: per layer a tuple of planes, side by side in an object's token rows
BUNDLE_PLANES = ((24, torch.uint8), (4, torch.bfloat16), (1, torch.float16))  # 34-byte rows: moved whole
BUNDLE_ROW = sum(width * dtype.itemsize for width, dtype in BUNDLE_PLANES)


def _bundle_desc() -> ops.PageBufferShapeDesc:
    desc = ops.PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 1, LAYERS, BLOCKS, BS, 1, BUNDLE_PLANES[0][0]
    desc.element_size, desc.dtype = 1, None
    return desc


def _bundle_rows(caches: list[tuple[torch.Tensor, ...]], slots: torch.Tensor) -> torch.Tensor:
    """[layers, slots, row bytes]: each slot's planes' bytes side by side, read from the caches."""
    return torch.stack([torch.cat([plane.reshape(BLOCKS * BS, -1).view(torch.uint8)[slots.cpu()].cpu()
                                   for plane in layer], dim=1) for layer in caches])


def _bundle_calls(device: str, count: int = 3) -> int:
    """Stores, then loads, of `count` bundle objects of 2 blocks (the last one half full) with new objects
    and block ids each call (a list, then a device tensor); returns the calls a kept repeat ran."""
    generator = torch.Generator().manual_seed(3)
    caches = [tuple(torch.randint(0, 256, (BLOCKS, BS, 1, width * dtype.itemsize), dtype=torch.uint8,
                                  generator=generator).view(dtype).to(device) for width, dtype in BUNDLE_PLANES)
              for _ in range(LAYERS)]
    repeated = 0
    for direction in (D2H, H2D):
        for call in range(6):
            ids = torch.randperm(BLOCKS, generator=generator)[:2 * count - 1]
            block_ids = ids.tolist() if call % 2 else ids.to(device)
            slots = (ids[:, None] * BS + torch.arange(BS)).reshape(-1)
            if direction == D2H:
                objects = [torch.full((LAYERS, 2 * BS, BUNDLE_ROW), 0xA5, dtype=torch.uint8, device=device)
                           for _ in range(count)]
            else:
                objects = [torch.randint(0, 256, (LAYERS, 2 * BS, BUNDLE_ROW), dtype=torch.uint8,
                                         generator=generator).to(device) for _ in range(count)]
                others = torch.ones(BLOCKS * BS, dtype=torch.bool)
                others[slots] = False
                untouched = _bundle_rows(caches, torch.arange(BLOCKS * BS)[others])
            before = launch_counter.triton
            key = per_block._block_repeat_key(moves.transfer_backend(), objects, block_ids,
                                              (device, direction, 2 * BS, BUNDLE, 0), _bundle_desc())
            kept = moves.repeats.lookup(caches, key)[1]
            ops.multi_layer_block_kv_transfer(caches, objects, block_ids, device, direction, _bundle_desc(), 2 * BS,
                                              BUNDLE, 0)
            repeated += kept is not None and kept is not moves.never and launch_counter.triton == before + 1
            moved = torch.cat([obj.cpu() for obj in objects], dim=1)[:, : len(slots)]
            assert torch.equal(moved, _bundle_rows(caches, slots)), (direction, call)
            if direction == D2H:
                assert (objects[-1][:, BS:] == 0xA5).all(), f"call {call}: rows past the request's blocks were written"
            else:
                assert torch.equal(_bundle_rows(caches, torch.arange(BLOCKS * BS)[others]), untouched), (
                    f"load {call} wrote other slots")
    return repeated


@pytest.fixture(params=[True, False], ids=["raw launcher", "compiled kernel's runner (as on an NPU)"])
def relaunch_through(request):
    """Repeats through CUDA's raw launcher, and through the compiled kernel's runner (what an NPU uses)."""
    from lmcache_ascend.kernels import launcher

    launcher._raw_launch["enabled"] = request.param
    moves.repeats._entries.clear()
    yield request.param
    launcher._raw_launch["enabled"] = True
    moves.repeats._entries.clear()


@cuda
def test_repeated_per_token_calls_move_the_right_bytes_on_cuda(relaunch_through):
    assert _token_calls("cuda") == 5, "every store after the first should have been a repeat"


@cuda
@pytest.mark.parametrize("count", [1, 3], ids=["one object", "three objects"])
def test_repeated_block_calls_move_the_right_bytes_on_cuda(count, relaunch_through):
    # three keys: a list and a device tensor, each repeated from its second call on; a strided
    # tensor, which the whole path makes contiguous for the kernel every time (no repeat), unless
    # it holds one id (one object's ids here), which is contiguous whatever its stride
    assert _block_calls("cuda", count) == (5 if count == 1 else 4)


@cuda
def test_repeated_bundle_calls_move_the_right_bytes_on_cuda(relaunch_through):
    # per direction two keys (ids as a list, as a device tensor), each repeated from its second call on
    assert _bundle_calls("cuda") == 8


def test_an_argument_that_cannot_be_hashed_takes_the_whole_path():
    """A repeat is looked up by the call's arguments; one that cannot be hashed (a shape descriptor
    field holding a list) must leave the call to the whole path, not fail it."""
    caches = _caches("cpu", torch.Generator().manual_seed(2))
    desc = _desc()
    desc.kv_size = [1]  # read by nothing on the whole path
    objects = [torch.full((LAYERS, 2 * BS, HIDDEN), POISON, dtype=torch.bfloat16)]
    ops.multi_layer_block_kv_transfer(caches, objects, [3, 5], "cpu", D2H, desc, 2 * BS, MLA, 0)
    slots = (torch.tensor([3, 5])[:, None] * BS + torch.arange(BS)).reshape(-1)
    assert torch.equal(objects[0].cpu(), _rows(caches, slots))


def test_on_the_cpu_every_call_takes_the_whole_path():
    assert _token_calls("cpu") == 0
    assert _block_calls("cpu") == 0
    assert _block_calls("cpu", 1) == 0
    assert _bundle_calls("cpu") == 0
