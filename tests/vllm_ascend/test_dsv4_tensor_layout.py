"""The pure DeepSeek-V4 tensor plan behind `vllm-ascend-dsv4-aggregated-page-size` (no vllm-ascend needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.prefix_cache.dsv4_tensor_layout import LayerPage, PlannedTensor, plan_dsv4_kv_tensors


def _group(prefix, *page_sizes):
    return [LayerPage(f"{prefix}.{index}", size) for index, size in enumerate(page_sizes)]


def test_page_sizes_of_every_group_get_tensors():
    plan = plan_dsv4_kv_tensors([_group("c4", 8, 2, 8), _group("c128", 4, 4), _group("swa", 8, 8)])
    assert plan.tensors == (
        PlannedTensor(2, ("c4.1",)),
        PlannedTensor(4, ("c128.0",)),
        PlannedTensor(8, ("c4.0", "swa.0")),
        PlannedTensor(4, ("c128.1",)),
        PlannedTensor(8, ("c4.2", "swa.1")),
    )
    assert plan.bytes_per_block == 2 + 4 + 8 + 4 + 8
    assert plan.num_blocks_for(26 * 3 + 25) == 3


def test_mtp_layers_get_one_tensor_each_after_the_slots():
    plan = plan_dsv4_kv_tensors([[LayerPage("layers.0.attn", 8), LayerPage("mtp.0.attn", 6)], _group("swa", 8)])
    assert plan.tensors == (PlannedTensor(8, ("layers.0.attn", "swa.0")), PlannedTensor(6, ("mtp.0.attn",)))
    assert plan.bytes_per_block == 14


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"layer 'b.0' of group 1 has page_size_bytes=0; allowed: > 0"):
        plan_dsv4_kv_tensors([_group("a", 8), _group("b", 0)])
    with pytest.raises(ValueError, match=r"layer 'a.0' appears in more than one group \(again in group 1\)"):
        plan_dsv4_kv_tensors([_group("a", 8), _group("a", 8)])
    with pytest.raises(ValueError, match="layer_pages_by_group is empty"):
        plan_dsv4_kv_tensors([])
    with pytest.raises(ValueError, match="no layers in any KV-cache group"):
        plan_dsv4_kv_tensors([[], []])
    with pytest.raises(ValueError, match=r"available_memory=-1 must be >= 0"):
        plan_dsv4_kv_tensors([_group("a", 8)]).num_blocks_for(-1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([2, 4, 8, 16]), max_size=6), min_size=1, max_size=5).filter(any))
def test_every_layer_in_exactly_one_tensor_of_its_page_size(page_sizes_by_group):
    groups = [_group(f"g{index}", *sizes) for index, sizes in enumerate(page_sizes_by_group)]
    page_size_of = {page.layer_name: page.page_size_bytes for group in groups for page in group}
    plan = plan_dsv4_kv_tensors(groups)
    covered = [name for tensor in plan.tensors for name in tensor.shared_by]
    assert sorted(covered) == sorted(page_size_of)
    for tensor in plan.tensors:
        assert tensor.shared_by, "an empty tensor wastes memory"
        assert {page_size_of[name] for name in tensor.shared_by} == {tensor.page_size_bytes}
        # At most one layer of each group per tensor: groups index rows by their own block ids.
        assert len({name.split(".")[0] for name in tensor.shared_by}) == len(tensor.shared_by)
    assert plan.bytes_per_block == sum(tensor.page_size_bytes for tensor in plan.tensors)
