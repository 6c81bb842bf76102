"""Registration refuses a moved KV tensor whose pages are not its group's blocks.

With vLLM's `num_blocks` at hand, every plane of a moved group must hold
block_size // compress_ratio rows per block and at least num_blocks blocks; anything
else (a state-space layer's state page taken for token rows, a short pool) would make
slots address other bytes. The refusal names layer, plane, tensor geometry and group.
A group that is not moved is not checked, and without `num_blocks` nothing is. (The
DeepSeek-V4 caches pass the same check through the real adapter in
`tests/e2e/test_adapter_worker_path.py`.)
"""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.kv_worker import KVCacheShapeError, plan_kv_caches
from tests.kv_worker._geometry import geometry

GEOMETRY = {0: geometry(0, block_rows=4), 1: geometry(1, compress_ratio=4, block_rows=2)}
PLANE_GROUPS = {"full": (0,), "c4": (1,)}


def _caches(full_rows_per_block: int = 4, c4_blocks: int = 6) -> dict[str, object]:
    return {
        "full": (torch.zeros(6, full_rows_per_block, 16, dtype=torch.bfloat16),),
        "c4": (torch.zeros(c4_blocks, 2, 8, dtype=torch.int8),),
    }


def test_pages_that_are_the_groups_blocks_register():
    layers, _ = plan_kv_caches(_caches(), PLANE_GROUPS, GEOMETRY, 16, num_blocks=6)
    assert [plane.block_size for layer in layers for plane in layer.planes] == [4, 2]


def test_rows_per_block_that_differ_from_the_group_are_refused():
    with pytest.raises(KVCacheShapeError) as raised:
        plan_kv_caches(_caches(full_rows_per_block=1), PLANE_GROUPS, GEOMETRY, 16, num_blocks=6)
    message = str(raised.value)
    assert "layer 'full' plane 0" in message and "blocks of 1 rows of 32 bytes" in message
    assert "group 0 (test-group-0: 6 blocks of 4 tokens, compress_ratio 1, so 4 rows per block)" in message
    # The same tensors without vLLM's block count: nothing to compare with.
    plan_kv_caches(_caches(full_rows_per_block=1), PLANE_GROUPS, GEOMETRY, 16)


def test_fewer_blocks_than_vllm_allocated_are_refused():
    with pytest.raises(KVCacheShapeError, match=r"layer 'c4' plane 0 .*5 blocks of 2 rows.*group 1 .*6 blocks of 8 tokens"):
        plan_kv_caches(_caches(c4_blocks=5), PLANE_GROUPS, GEOMETRY, 16, num_blocks=6)


def test_a_group_that_is_not_moved_is_not_checked():
    skipped = {**GEOMETRY, 1: geometry(1, compress_ratio=4, block_rows=2, transferred=False)}
    layers, _ = plan_kv_caches(_caches(c4_blocks=1), PLANE_GROUPS, skipped, 16, num_blocks=6)
    assert [layer.layer_name for layer in layers] == ["full"]

