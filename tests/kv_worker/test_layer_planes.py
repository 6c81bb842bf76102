"""Format detection of registered KV caches: every format, dtype views, and the errors."""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.kv_worker import KVFormat, KVCacheShapeError, detect_layer_planes
from tests.fixtures.kv_caches import LATENT_DIMS, TOKEN_MAJOR_KV_DIMS


def _bytes_of_row(tensor: torch.Tensor, slot: int, block_size: int) -> torch.Tensor:
    row = tensor[slot // block_size, slot % block_size]
    return row.contiguous().view(torch.uint8).reshape(-1)


def _assert_rows_match(layer, plane: int, tensor: torch.Tensor, block_size: int) -> None:
    rows = layer.paged_rows[plane].flatten(0, 1)  # [slots, row_bytes]
    assert rows.dtype == torch.uint8
    for slot in range(rows.shape[0]):
        assert torch.equal(rows[slot], _bytes_of_row(tensor, slot, block_size)), slot


def _random(shape, dtype=torch.float16):
    tensor = torch.empty(shape, dtype=dtype)
    tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
    return tensor


def test_merged_single_tensor_splits_into_k_and_v():
    cache = _random((2, 5, 4, 2, 8))
    layer = detect_layer_planes("l0", cache, [3], backend_dims=TOKEN_MAJOR_KV_DIMS)
    assert layer.format is KVFormat.MERGED
    assert [p.plane_index for p in layer.planes] == [0, 1]
    assert all(p.row_bytes == 2 * 8 * 2 and p.block_size == 4 and p.num_blocks == 5 for p in layer.planes)
    assert layer.scheduler_groups == (3, 3)
    _assert_rows_match(layer, 0, cache[0], 4)
    _assert_rows_match(layer, 1, cache[1], 4)


def test_separate_pair_of_equal_shapes():
    k, v = _random((3, 4, 16)), _random((3, 4, 16))
    layer = detect_layer_planes("l", (k, v), [0])
    assert layer.format is KVFormat.SEPARATE
    _assert_rows_match(layer, 0, k, 4)
    _assert_rows_match(layer, 1, v, 4)


@pytest.mark.parametrize("cache_kind", ["pair", "single"])
def test_mla_pair_of_different_shapes_and_single_latent(cache_kind):
    if cache_kind == "pair":
        latent, rope = _random((3, 4, 1, 32), torch.bfloat16), _random((3, 4, 1, 8), torch.bfloat16)
        layer = detect_layer_planes("l", (latent, rope), [0])
        assert [p.row_bytes for p in layer.planes] == [64, 16]
        _assert_rows_match(layer, 1, rope, 4)
    else:
        latent = _random((3, 4, 40), torch.bfloat16)
        layer = detect_layer_planes("l", latent, [0], backend_dims=LATENT_DIMS)
        assert [p.row_bytes for p in layer.planes] == [80]
        _assert_rows_match(layer, 0, latent, 4)
    assert layer.format is KVFormat.MLA


def test_dsa_three_planes_and_dsa_c8_four_mixed_dtypes():
    planes = (_random((3, 4, 32)), _random((3, 4, 8)), _random((3, 4, 16)))
    assert detect_layer_planes("dsa", planes, [0]).format is KVFormat.DSA
    c8 = (
        _random((3, 4, 32), torch.int8),
        _random((3, 4, 16), torch.int8),
        _random((3, 4, 2), torch.float16),
        _random((3, 4, 1), torch.float16),
    )
    layer = detect_layer_planes("c8", c8, [0])
    assert layer.format is KVFormat.DSA_C8
    assert [p.row_bytes for p in layer.planes] == [32, 16, 4, 2]
    for index, tensor in enumerate(c8):
        _assert_rows_match(layer, index, tensor, 4)


def test_multi_plane_when_planes_differ_in_block_size_or_scheduler_group():
    swa, compressed = _random((8, 16, 32)), _random((4, 2, 32))
    layer = detect_layer_planes("mp", (swa, compressed), [2, 1])
    assert layer.format is KVFormat.MULTI_PLANE
    assert layer.scheduler_groups == (2, 1)
    assert [(p.num_blocks, p.block_size) for p in layer.planes] == [(8, 16), (4, 2)]
    # Same shapes, two scheduler groups: still multi-plane (different block-ID namespaces).
    assert detect_layer_planes("mp2", (_random((3, 4, 8)), _random((3, 4, 8))), [0, 1]).format is KVFormat.MULTI_PLANE


def test_dtype_views_of_one_blob_fold_into_one_plane_moved_once():
    blob = _random((5, 4, 132), torch.int8)
    k_view, scale_view = blob[:, :, :128], blob[:, :, 128:].view(torch.float32)
    layer = detect_layer_planes("idx", (k_view, scale_view), [3])
    assert len(layer.planes) == 1
    plane = layer.planes[0]
    assert (plane.plane_index, plane.folded_plane_indices) == (0, (1,))
    assert (plane.row_bytes, plane.row_stride_bytes, plane.dtype) == (132, 132, torch.int8)
    _assert_rows_match(layer, 0, blob, 4)
    # Scale first in the tuple: the widest view (K) still carries the geometry.
    swapped = detect_layer_planes("idx", (scale_view, k_view), [3])
    assert (swapped.planes[0].plane_index, swapped.planes[0].folded_plane_indices) == (1, (0,))
    assert swapped.planes[0].row_bytes == 132


def test_views_in_disjoint_regions_of_one_blob_stay_separate_planes():
    blob = _random((2, 3, 4, 16))
    layer = detect_layer_planes("kv", (blob[0], blob[1]), [0])
    assert layer.format is KVFormat.SEPARATE and len(layer.planes) == 2
    _assert_rows_match(layer, 1, blob[1], 4)


def test_a_lone_narrow_view_keeps_its_row_stride():
    blob = _random((3, 4, 132), torch.int8)
    layer = detect_layer_planes("k", (blob[:, :, :128],), [0])  # vllm-ascend's plane-tuple form
    assert (layer.planes[0].row_bytes, layer.planes[0].row_stride_bytes) == (128, 132)
    _assert_rows_match(layer, 0, blob[:, :, :128], 4)


@pytest.mark.parametrize(
    ("cache", "groups", "message"),
    [
        ((), [0], "empty tuple"),
        ((torch.zeros(2, 2, 4), "x"), [0], "plane 1 is a str"),
        ({"k": 1}, [0], "expected a torch.Tensor or a tuple"),
        (torch.zeros(3, 4, 5, 6, 7, 8), [0], "came without its attention backend's layout description"),
        ((torch.zeros(3, 4, 2, 8).transpose(2, 3),), [0], "not contiguous"),
        ((torch.zeros(3, 4, 8), torch.zeros(3, 4, 8)), [0, 1, 2], "3 scheduler groups given for 2 planes"),
        ((torch.zeros(3, 4, 8),), [-1], "must be an int >= 0"),
        ((torch.zeros(3), torch.zeros(3)), [0], "expected dims [num_blocks, block_size"),
        ((torch.zeros(0, 4, 8), torch.zeros(0, 4, 8)), [0], "must be > 0"),
    ],
    ids=["empty", "not-a-tensor", "not-a-cache", "no-description", "strided-row", "group-count", "negative-group", "1d", "no-blocks"],
)
def test_layout_errors_name_the_layer_and_the_problem(cache, groups, message):
    with pytest.raises(KVCacheShapeError) as error:
        detect_layer_planes("layers.7.attn", cache, groups)
    assert "layers.7.attn" in str(error.value) and message in str(error.value)


def test_views_of_one_blob_in_two_scheduler_groups_are_rejected():
    blob = torch.zeros(3, 4, 132, dtype=torch.int8)
    with pytest.raises(KVCacheShapeError, match="views of one storage blob but map to scheduler groups 3 and 4"):
        detect_layer_planes("idx", (blob[:, :, :128], blob[:, :, 128:].view(torch.float32)), [3, 4])


def test_overlapping_views_that_do_not_share_rows_are_rejected():
    flat = torch.zeros(3 * 4 * 16, dtype=torch.float16)
    first = flat.view(3, 4, 16)
    shifted = flat[8:].view(-1)[: 2 * 4 * 16].view(2, 4, 16)  # overlaps, other block count
    with pytest.raises(KVCacheShapeError, match="overlaps plane"):
        detect_layer_planes("bad", (first, shifted), [0])
