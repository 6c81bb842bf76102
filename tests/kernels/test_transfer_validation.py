"""Host-side validation: every bad input is refused before anything moves, with a clear error."""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.kernels import (
    MAX_PLANES,
    PagedGroup,
    PagedPlane,
    PlaneSlots,
    TransferError,
    chunk_regions,
    select_backend,
    transfer_group,
    widest_element_width,
)
from tests.kernels._cases import move_layers


def plane(dtype=torch.bfloat16, blocks=3, block_size=4, width=8, layers=2, name="p"):
    caches = [torch.zeros(blocks, block_size, width, dtype=dtype) for _ in range(layers)]
    return PagedPlane(caches, block_size, width * caches[0].element_size(), name=name)


def slots(n=4):
    return PlaneSlots(torch.arange(n, dtype=torch.int64))


def big_chunk():
    return torch.full((4096,), 0x5A, dtype=torch.uint8)


@pytest.mark.parametrize("planes", [0, MAX_PLANES + 1])
def test_plane_count_outside_1_to_max_is_refused(planes):
    with pytest.raises(TransferError, match=rf"plane count={planes} is not allowed; allowed: 1\.\.{MAX_PLANES}"):
        PagedGroup(tuple(plane(name=str(i)) for i in range(planes)))


@pytest.mark.parametrize("block_size", [0, -4, 2.0, True])
def test_block_size_must_be_a_positive_int(block_size):
    with pytest.raises(TransferError, match=r"block_size=.* is not allowed; allowed: an int > 0"):
        PagedPlane([torch.zeros(3, 4, 8)], block_size, 32)


def test_row_bytes_must_be_a_multiple_of_the_element_size():
    with pytest.raises(TransferError, match=r"row_bytes=6 is not a multiple of its torch.float32 element size \(4\)"):
        PagedGroup((PagedPlane([torch.zeros(3, 4, 8)], 16, 6),))


def test_row_bytes_must_match_the_tensor_shape():
    with pytest.raises(TransferError, match=r"128 bytes per block, but block_size=4 x row_bytes=16 = 64"):
        PagedGroup((PagedPlane([torch.zeros(3, 4, 8)], 4, 16),))


def test_a_view_whose_rows_are_not_contiguous_is_refused():
    base = torch.zeros(3, 8, 4)  # a transposed view: a block's bytes are not one contiguous span
    with pytest.raises(TransferError, match=r"each block's bytes must be contiguous"):
        PagedGroup((PagedPlane([base.transpose(1, 2)], 4, 32),))


def test_a_one_dim_cache_is_refused():
    with pytest.raises(TransferError, match=r"allowed: >= 2 dims, blocks first"):
        PagedGroup((PagedPlane([torch.zeros(16)], 4, 4),))


def test_layer_counts_must_agree_across_planes():
    with pytest.raises(TransferError, match=r"different layer counts \[2, 3\]"):
        PagedGroup((plane(layers=2), plane(layers=3)))


def test_slot_dtype_must_be_int64():
    group = PagedGroup((plane(),))
    with pytest.raises(TransferError, match=r"slots\[0\] has dtype torch.int32; allowed: torch.int64"):
        transfer_group(group, [PlaneSlots(torch.arange(4, dtype=torch.int32))], big_chunk(), store=True)


def test_slots_must_be_one_dim_contiguous():
    group = PagedGroup((plane(),))
    with pytest.raises(TransferError, match=r"allowed: a contiguous 1-D tensor"):
        transfer_group(group, [PlaneSlots(torch.arange(8)[::2])], big_chunk(), store=True)


def test_start_plus_count_must_stay_inside_the_slot_array():
    group = PagedGroup((plane(),))
    with pytest.raises(TransferError, match=r"start=2 \+ count=3 exceeds its 4 entries"):
        transfer_group(group, [PlaneSlots(torch.arange(4), start=2, count=3)], big_chunk(), store=True)


def test_one_slot_array_per_plane():
    group = PagedGroup((plane(name="a"), plane(name="b")))
    with pytest.raises(TransferError, match=r"got 1 PlaneSlots for a group of 2 planes"):
        transfer_group(group, [slots()], big_chunk(), store=True)


def test_region_rows_below_count_is_refused():
    group = PagedGroup((plane(),))
    with pytest.raises(TransferError, match=r"region_rows=2 < count=4"):
        transfer_group(group, [PlaneSlots(torch.arange(4), region_rows=2)], big_chunk(), store=True)


def test_a_chunk_too_small_is_refused_before_any_byte_moves():
    group = PagedGroup((plane(),))
    chunk = torch.full((100,), 0x5A, dtype=torch.uint8)
    with pytest.raises(TransferError, match=r"chunk holds 100 bytes but chunk_offset=0 \+ the group's 128 bytes"):
        transfer_group(group, [slots()], chunk, store=True)
    assert bool((chunk == 0x5A).all())


def test_a_non_contiguous_chunk_is_refused():
    group = PagedGroup((plane(),))
    with pytest.raises(TransferError, match=r"allowed: a contiguous tensor"):
        transfer_group(group, [slots()], big_chunk()[::2], store=True)


def test_store_must_be_a_bool():
    group = PagedGroup((plane(),))
    with pytest.raises(TransferError, match=r"store=1 is not allowed; allowed: True \(paged -> chunk\) or False"):
        transfer_group(group, [slots()], big_chunk(), store=1)


def test_all_tensors_must_share_one_device():
    meta = torch.zeros(3, 4, 8, device="meta")
    with pytest.raises(TransferError, match=r"is on meta but plane 0 layer 0 is on cpu"):
        PagedGroup((PagedPlane([torch.zeros(3, 4, 8), meta], 4, 32),))
    group = PagedGroup((plane(),))
    with pytest.raises(TransferError, match=r"slots\[0\] is on meta but the caches are on cpu"):
        transfer_group(group, [PlaneSlots(torch.zeros(4, dtype=torch.int64, device="meta"))], big_chunk(), store=True)
    with pytest.raises(TransferError, match=r"chunk is on meta but the caches are on cpu"):
        transfer_group(group, [slots()], torch.zeros(4096, dtype=torch.uint8, device="meta"), store=True)


def test_complex_and_sparse_tensors_are_refused():
    with pytest.raises(TransferError, match=r"dtype torch.complex64; allowed: a real or integer dtype"):
        PagedGroup((PagedPlane([torch.zeros(3, 4, 2, dtype=torch.complex64)], 4, 16),))
    with pytest.raises(TransferError, match=r"allowed: a plain strided tensor"):
        PagedGroup((PagedPlane([torch.zeros(3, 4, 2).to_sparse()], 4, 8),))


def test_alignment_must_be_a_power_of_two():
    with pytest.raises(TransferError, match=r"alignment=24 is not allowed; allowed: a power of two"):
        chunk_regions([8], [4], 1, alignment=24)


@pytest.mark.parametrize(
    "dtype",
    [torch.int8, torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2],
)
def test_every_dtype_is_accepted_and_moves_exactly(dtype):
    source = torch.randint(0, 256, (2, 4, 16), dtype=torch.uint8).view(dtype)  # rows of 16 bytes
    chunk = torch.full((5 * 16,), 0xA5, dtype=torch.uint8)  # poisoned: every byte must be written
    slot_list = torch.tensor([7, 0, 3, 4, 1])
    move_layers([source], slot_list, chunk, store=True, block_size=4, row_bytes=16, alignment=1)
    assert torch.equal(chunk.view(5, 16), source.view(torch.uint8).reshape(8, 16)[slot_list])
    target = torch.zeros_like(source)
    move_layers([target], slot_list, chunk, store=False, block_size=4, row_bytes=16, alignment=1)
    moved = target.view(torch.uint8).reshape(8, 16)
    assert torch.equal(moved[slot_list], chunk.view(5, 16))
    assert bool((moved[[2, 5, 6]] == 0).all())


def test_views_of_one_blob_use_their_own_addresses():
    blob = torch.randint(-128, 128, (3, 4 * 6), dtype=torch.int8)
    k = blob[:, : 4 * 4].view(3, 4, 4)  # int8 rows of 4 bytes
    scale = blob[:, 4 * 4 :].view(torch.float16).view(3, 4, 1)  # fp16 rows of 2 bytes, offset 16 in each block
    group = PagedGroup((PagedPlane([k], 4, 4), PagedPlane([scale], 4, 2)))
    chunk = torch.zeros(64, dtype=torch.uint8)
    transfer_group(group, [PlaneSlots(torch.tensor([9])), PlaneSlots(torch.tensor([9]))], chunk, store=True,
                   backend="torch")
    assert torch.equal(chunk[:4].view(torch.int8), blob[2, 4:8])
    assert torch.equal(chunk[32:34].view(torch.int8), blob[2, 16 + 2 : 16 + 4])


def test_widest_element_width():
    assert widest_element_width(132) == 4  # an int8 row of 132 bytes uses 4-byte moves
    assert widest_element_width(1152, 4096, 0) == 16
    assert widest_element_width(2) == 2 and widest_element_width(7) == 1 and widest_element_width(24, 8) == 4


def test_backend_choice_on_cpu(monkeypatch):
    """The kernels take the backend from their caller and read no flag: a bad flag changes nothing here."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("LMCACHE_ASCEND_TRANSFER_BACKEND", "cuda")
    cpu = torch.device("cpu")
    for _ in range(2):  # the second round answers from the remembered choices
        assert select_backend(cpu) == select_backend(cpu, "auto") == "torch"
        assert select_backend(cpu, "torch") == "torch"
        with pytest.raises(TransferError, match=r"backend 'triton' cannot run on device cpu"):
            select_backend(cpu, "triton")
        with pytest.raises(TransferError, match=r"backend='fast' is not allowed"):
            select_backend(cpu, "fast")

