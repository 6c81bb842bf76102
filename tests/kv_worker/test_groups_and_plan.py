"""Layer grouping (bundled / exploded, scheduler-group identity, skipped groups) and chunk plans."""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.kernels import DEFAULT_REGION_ALIGNMENT as REGION_ALIGNMENT
from lmcache_ascend.kv_worker import ChunkPlanner, KVCacheShapeError, build_layer_groups, detect_layer_planes
from lmcache_ascend.multigroup.specs import KVGroupSpec, RowWindow
from lmcache_ascend.multigroup.specs import chunk_row_window as row_window
from lmcache_ascend.kv_worker.chunk_seal import SEAL_BYTES
from lmcache_ascend.kv_worker.registration import needs_multigroup_connector, plane_groups_from_layer_names
from tests.fixtures.kv_caches import LATENT_DIMS, TOKEN_MAJOR_KV_DIMS
from tests.kv_worker._geometry import geometry as group_geometry

GEOMETRY = {
    0: group_geometry(0),
    1: group_geometry(1, compress_ratio=4),
    2: group_geometry(2, compress_ratio=4),  # same shape as 1, other block-ID namespace
    3: group_geometry(3, sliding_window=16),
    4: group_geometry(4, transferred=False),  # a skipped state group
}


def _layers(specs):
    # Single tensors here are one latent row per token (MLA's documented layout).
    return [
        detect_layer_planes(name, cache, groups, backend_dims=LATENT_DIMS if isinstance(cache, torch.Tensor) else None)
        for name, cache, groups in specs
    ]


def test_identical_shapes_in_two_scheduler_groups_never_merge():
    layers = _layers(
        [
            ("a", torch.zeros(4, 8, 16), [1]),
            ("b", torch.zeros(4, 8, 16), [2]),
            ("c", torch.zeros(4, 8, 16), [1]),
        ]
    )
    groups = build_layer_groups(layers, GEOMETRY)
    assert [g.member_names for g in groups] == [("a", "c"), ("b",)]
    assert [g.scheduler_groups for g in groups] == [(1,), (2,)]


def test_layout_identity_splits_row_bytes_block_size_and_dtype():
    layers = _layers(
        [
            ("a", torch.zeros(4, 8, 16), [0]),
            ("b", torch.zeros(4, 8, 8), [0]),  # other row bytes
            ("c", torch.zeros(4, 4, 16), [0]),  # other block size
            ("d", torch.zeros(4, 8, 16, dtype=torch.bfloat16), [0]),  # other dtype (and row bytes)
            ("e", torch.zeros(9, 8, 16), [0]),  # other block count only: same group
        ]
    )
    groups = build_layer_groups(layers, GEOMETRY)
    assert [g.member_names for g in groups] == [("a", "e"), ("b",), ("c",), ("d",)]


def test_bundled_keeps_a_layer_in_one_group_exploded_splits_its_planes():
    def multi_plane():
        return (torch.zeros(4, 8, 16), torch.zeros(4, 2, 4), torch.zeros(6, 8, 2, dtype=torch.int8))

    specs = [("l0", multi_plane(), [0, 1, 3]), ("l1", multi_plane(), [0, 1, 3])]
    bundled = build_layer_groups(_layers(specs), GEOMETRY, bundle_multi_spec=True)
    assert len(bundled) == 1 and bundled[0].num_planes == 3 and bundled[0].member_names == ("l0", "l1")
    exploded = build_layer_groups(_layers(specs), GEOMETRY, bundle_multi_spec=False)
    assert [g.member_names for g in exploded] == [("l0#p0", "l1#p0"), ("l0#p1", "l1#p1"), ("l0#p2", "l1#p2")]
    assert all(g.num_planes == 1 for g in exploded)


def test_planes_of_skipped_groups_are_dropped_and_empty_layers_vanish():
    specs = [("l0", (torch.zeros(4, 8, 16), torch.zeros(4, 8, 4)), [0, 4]), ("state", torch.zeros(4, 8, 4), [4])]
    groups = build_layer_groups(_layers(specs), GEOMETRY)
    assert len(groups) == 1 and groups[0].scheduler_groups == (0,) and groups[0].member_names == ("l0",)


def test_unknown_scheduler_group_is_an_error():
    with pytest.raises(KVCacheShapeError, match="maps to scheduler group 7, which is not among the registered groups"):
        build_layer_groups(_layers([("l", torch.zeros(4, 8, 16), [7])]), GEOMETRY)


def test_kv_sharing_moves_shared_bytes_once():
    shared = torch.zeros(4, 8, 16)
    groups = build_layer_groups(_layers([("a", shared, [0]), ("b", shared, [0])]), GEOMETRY)
    assert [g.member_names for g in groups] == [("a",)]


def test_row_window_compressed_and_sliding_window():
    assert row_window(group_geometry(0), 256, 512) == RowWindow(256, 256)
    assert row_window(group_geometry(0, compress_ratio=4), 256, 510) == RowWindow(64, 64)  # ceil(254/4)
    assert row_window(group_geometry(0, sliding_window=128), 256, 512) == RowWindow(384, 128)
    assert row_window(group_geometry(0, compress_ratio=128, sliding_window=128), 256, 512) == RowWindow(3, 1)
    assert row_window(group_geometry(0, sliding_window=128), 512, 600) == RowWindow(512, 88)  # short chunk
    with pytest.raises(ValueError, match="chunk start 2 is not a multiple of compress_ratio=4"):
        row_window(group_geometry(0, compress_ratio=4), 2, 10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compress_ratio": 0}, "compress_ratio=0 is not allowed; it must be a positive integer"),
        ({"compress_ratio": 4, "sliding_window": 2}, "sliding_window=2 is not allowed; it must be a positive multiple"),
        ({"compress_ratio": 4, "sliding_window": 6}, "sliding_window=6 is not allowed; it must be a positive multiple"),
        ({"block_size": 6, "compress_ratio": 4}, "block_size=6 is not a multiple of compress_ratio=4"),
    ],
)
def test_group_geometry_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVGroupSpec(0, "G", **{"block_size": 4, **kwargs})


def test_chunk_plan_regions_are_aligned_packed_and_sized_per_group():
    specs = [
        ("full", torch.zeros(4, 8, 3, dtype=torch.int8), [0]),  # 3-byte rows: regions need padding
        ("c4", (torch.zeros(4, 8, 16), torch.zeros(4, 8, 1, dtype=torch.float16)), [1]),
        ("swa", torch.zeros(4, 8, 5, dtype=torch.int8), [3]),
    ]
    planner = ChunkPlanner(build_layer_groups(_layers(specs), GEOMETRY), GEOMETRY, chunk_size=64)
    plan = planner.full_plan
    assert [r.plane_rows for r in plan.regions] == [(64,), (16, 16), (16,)]
    cursor = 0
    for region in plan.regions:
        assert region.byte_offset == cursor and region.byte_offset % REGION_ALIGNMENT == 0
        for plane, rows in enumerate(region.plane_rows):
            assert region.plane_byte_offset(0, plane) % REGION_ALIGNMENT == 0
            assert region.regions.plane_region_bytes[plane] >= rows * region.regions.row_bytes[plane]
            assert region.regions.plane_region_bytes[plane] - rows * region.regions.row_bytes[plane] < REGION_ALIGNMENT
        cursor += region.byte_size
    assert plan.total_bytes == cursor == 192 + (16 * 64 + 32) + 96
    # A short last chunk gets its own plan (computed once, then cached).
    short = planner.plan(10)
    assert [r.plane_rows for r in short.regions] == [(10,), (3, 3), (10,)]
    assert planner.plan(10) is short and planner.plan(64) is plan
    shape = planner.memory_shape(10)
    assert shape[:3] == (1, 1, 10) and 0 <= shape[3] * 10 - short.total_bytes - SEAL_BYTES < 10


def test_chunk_plan_errors():
    groups = build_layer_groups(_layers([("c4", torch.zeros(4, 8, 16), [1])]), GEOMETRY)
    with pytest.raises(KVCacheShapeError, match="chunk_size=6 is not a multiple of compress_ratio=4"):
        ChunkPlanner(groups, GEOMETRY, chunk_size=6)
    with pytest.raises(KVCacheShapeError, match="no layer group to plan"):
        ChunkPlanner((), GEOMETRY, chunk_size=8)
    planner = ChunkPlanner(groups, GEOMETRY, chunk_size=8)
    with pytest.raises(KVCacheShapeError, match="chunk length 9 must be in 1..chunk_size=8"):
        planner.plan(9)


def test_plane_groups_from_layer_names():
    caches = {"a": torch.zeros(2, 2, 2), "b": (torch.zeros(2, 2, 2), torch.zeros(2, 2, 2))}
    assert plane_groups_from_layer_names([["a", "b"], ["b"]], caches) == {"a": (0,), "b": (0, 1)}
    with pytest.raises(KVCacheShapeError, match="no scheduler KV-cache group lists it"):
        plane_groups_from_layer_names([["a"]], caches)
    shared = {"a": caches["a"], "a_shared": caches["a"]}  # vLLM KV sharing: unlisted, same tensor
    assert plane_groups_from_layer_names([["a"]], shared) == {"a": (0,), "a_shared": (0,)}
    with pytest.raises(KVCacheShapeError, match="listed by scheduler groups \\[0, 1\\] but registers 1 planes"):
        plane_groups_from_layer_names([["a"], ["a", "b"]], caches)


def test_which_caches_need_the_multigroup_connector():
    merged = {"l0": torch.zeros(2, 4, 8, 1, 8), "l1": torch.zeros(2, 4, 8, 1, 8)}
    one_group = {"l0": (0,), "l1": (0,)}
    dims_by_layer = {name: TOKEN_MAJOR_KV_DIMS for name in merged}
    assert needs_multigroup_connector(merged, one_group, dims_by_layer)  # CPU: LMCache has no connector here
    assert needs_multigroup_connector(merged, {"l0": (0,), "l1": (1,)}, dims_by_layer)
    dsa = {"l0": (torch.zeros(4, 8, 16), torch.zeros(4, 8, 4), torch.zeros(4, 8, 2))}
    assert needs_multigroup_connector(dsa, {"l0": (0,)})
