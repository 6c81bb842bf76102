"""DeepSeek-V4's bundle as one layout: its worker names, its LMCache format, its planes and objects."""

from __future__ import annotations

import pytest
import torch

import lmcache_ascend.layouts as layouts
from lmcache_ascend.kernels.spec import TransferError
from lmcache_ascend.kv_worker.layer_planes import KVFormat, detect_layer_planes
from lmcache_ascend.op_surface.formats import format_facts

BUNDLE = next(layout for layout in layouts.LAYOUTS if layout.name == "dsv4_bundle")


def _refuse(message: str) -> None:
    raise TransferError(message)


def test_it_is_asked_last_of_the_layouts_a_tuple_can_be():
    tuple_layouts = [layout for layout in layouts.LAYOUTS if layout.recognise_tuple]
    assert tuple_layouts[-1] is BUNDLE  # it names every tuple the others leave


@pytest.mark.parametrize("traits, name", [
    (dict(count=3, uniform=True, dtypes=1, same_shapes=False), "DSA"),
    (dict(count=4, uniform=True, dtypes=2, same_shapes=False), "DSA_C8"),
    (dict(count=4, uniform=True, dtypes=1, same_shapes=False), "MULTI_PLANE"),
    (dict(count=2, uniform=False, dtypes=1, same_shapes=True), "MULTI_PLANE"),
])
def test_its_worker_names(traits, name):
    assert BUNDLE.recognise_tuple(layouts.TupleTraits(**traits)) == name
    assert KVFormat[name].value == BUNDLE.worker_formats[name]


def test_registered_int8_caches_beside_their_scales_are_the_c8_bundle():
    planes = (torch.zeros(6, 4, 64, dtype=torch.int8), torch.zeros(6, 4, 128, dtype=torch.int8),
              torch.zeros(6, 4, 2, dtype=torch.float16), torch.zeros(6, 4, 1, dtype=torch.float32))
    assert detect_layer_planes("c8", planes, [0]).format is KVFormat.DSA_C8
    assert detect_layer_planes("split", planes, [0, 0, 1, 1]).format is KVFormat.MULTI_PLANE


def test_lmcache_moves_it_by_blocks_only():
    facts = format_facts(17, layouts.BLOCK_OP)
    assert (facts.layout, facts.mla, facts.kv_tuple) == ("dsv4_bundle", True, True)
    with pytest.raises(TransferError, match="not supported"):
        format_facts(17, layouts.MULTI_LAYER_OP)


def test_its_planes_are_the_tuples_positions():
    layers = [(torch.zeros(2, 4, 8), torch.zeros(2, 4, 1)) for _ in range(3)]
    planes = BUNDLE.cut_block_planes(layers, format_facts(17, layouts.BLOCK_OP), _refuse)
    assert [len(plane) for plane in planes] == [3, 3]
    assert planes[1][2] is layers[2][1]


def test_tuples_of_different_lengths_are_refused():
    layers = [(torch.zeros(2, 4, 8),), (torch.zeros(2, 4, 8), torch.zeros(2, 4, 1))]
    with pytest.raises(TransferError, match=r"plane tuples of one length; got lengths \[1, 2\]"):
        BUNDLE.cut_block_planes(layers, format_facts(17, layouts.BLOCK_OP), _refuse)


def test_an_objects_token_row_holds_the_planes_side_by_side():
    obj = torch.zeros(2, 16, 40, dtype=torch.uint8)  # [NL, T, row]
    offsets, pitches, layer_stride = BUNDLE.block_object_regions(obj, (32, 6), 2, 4, _refuse)
    assert offsets == [4 * 40, 4 * 40 + 32] and pitches == [40, 40] and layer_stride == 16 * 40


def test_an_object_whose_rows_cannot_hold_the_planes_is_refused():
    with pytest.raises(TransferError, match="rows hold 36 bytes; the planes need 38"):
        BUNDLE.block_object_regions(torch.zeros(2, 16, 36, dtype=torch.uint8), (32, 6), 2, 0, _refuse)
