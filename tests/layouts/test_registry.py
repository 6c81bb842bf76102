"""The layout registry: every layout one module, both vocabularies read from it."""

from __future__ import annotations

import collections
import pathlib

import pytest

import lmcache_ascend.layouts as layouts
from lmcache_ascend.kv_worker.backend_dims import PACKED_KV_BY_BACKEND
from lmcache_ascend.kv_worker.layer_planes import KVFormat
from lmcache_ascend.op_surface.formats import FORMATS, format_facts
from lmcache_ascend.kernels.spec import TransferError

FOLDER = pathlib.Path(layouts.__file__).parent


def test_every_module_of_the_folder_is_a_layout():
    modules = sorted(path.stem for path in FOLDER.glob("*.py") if path.stem != "__init__")
    assert sorted(layout.name for layout in layouts.LAYOUTS) == modules


def test_layouts_are_asked_in_rank_order_and_ranks_differ():
    ranks = [layout.rank for layout in layouts.LAYOUTS]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_each_format_code_is_declared_once_and_knows_its_layout():
    declared = collections.Counter(facts.value for layout in layouts.LAYOUTS for facts in layout.formats)
    assert all(count == 1 for count in declared.values()), declared
    for layout in layouts.LAYOUTS:
        for facts in layout.formats:
            assert facts.layout == layout.name and layouts.layout_of(facts) is layout


def test_lmcache_codes_are_those_of_its_enum():
    # LMCache 0.5.6's EngineKVFormat numbers 0..18; the op surface knows every one.
    assert sorted(FORMATS) == list(range(19))
    assert len({facts.name for facts in FORMATS.values()}) == 19


@pytest.mark.parametrize("op, codes", [
    (layouts.MULTI_LAYER_OP, (1, 2, 3, 5)),
    (layouts.UNILATERAL_OP, (3, 4, 5, 9)),
    (layouts.SINGLE_LAYER_OP, (1, 2, 3, 5)),
    # every format LMCache's baseline moves by blocks except RBLN's (15)
    (layouts.BLOCK_OP, tuple(code for code in range(19) if code != 15)),
])
def test_which_ops_take_which_formats(op, codes):
    assert tuple(code for code, facts in FORMATS.items() if op in facts.ops) == codes


def test_a_format_an_op_does_not_take_is_refused_with_what_it_takes():
    with pytest.raises(TransferError, match=r"allowed: NL_X_NB_BS_HS \(3\), TWO_X_NL_X_NBBS_NH_HS \(4\)"):
        format_facts(0, layouts.UNILATERAL_OP)
    assert format_facts(3, layouts.UNILATERAL_OP).layout == "mla"


def test_worker_formats_are_the_layouts():
    named = [name for layout in layouts.LAYOUTS for name in layout.worker_formats]
    assert len(named) == len(set(named))
    assert set(named) <= set(KVFormat.__members__)
    for layout in layouts.LAYOUTS:
        for name, value in layout.worker_formats.items():
            assert KVFormat[name].value == value


def test_each_packing_backend_is_named_by_one_layout():
    named = [backend for layout in layouts.LAYOUTS for backend in layout.packed_backends]
    assert len(named) == len(set(named))
    assert PACKED_KV_BY_BACKEND == layouts.packed_kv_by_backend()


def test_every_layout_lmcache_moves_by_blocks_says_how_to_cut_it():
    for layout in layouts.LAYOUTS:
        if any(layouts.BLOCK_OP in facts.ops for facts in layout.formats):
            assert layout.cut_block_planes is not None, layout.name


def _first_recognising(traits: layouts.TupleTraits) -> str | None:
    return next((name for layout in layouts.LAYOUTS if layout.recognise_tuple
                 for name in [layout.recognise_tuple(traits)] if name), None)


def test_a_registered_pair_is_separate_k_v_or_an_mla_latent_by_its_shapes():
    pair = dict(count=2, uniform=True, dtypes=1)
    assert _first_recognising(layouts.TupleTraits(**pair, same_shapes=True)) == "SEPARATE"
    assert _first_recognising(layouts.TupleTraits(**pair, same_shapes=False)) == "MLA"
