"""A KV-cache group whose layers compress at several ratios, stored and loaded through the chunk plan.

vLLM 0.32 puts DeepSeek-V4's ratio-4 and ratio-128 compressed caches (and the
ratio-4 indexer's K) in one group: every layer pages the group's blocks, a block
holding ``block_size // ratio`` rows of each layer. Here a 16-token block holds 4
rows of the ratio-4 layers and 1 of the ratio-16 one. The expectation is vLLM's
own compressed slot rule (``CompressedSlotMappingKernel``): token row ``r`` of a
layer of ratio c sits at ``block_ids[r // rows_per_block] * rows_per_block + r %
rows_per_block`` with ``rows_per_block = block_size // c``, computed here by plain
indexing.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.kv_worker import ChunkMover, KVCacheShapeError
from lmcache_ascend.kv_worker.device_slots import DeviceSlots
from lmcache_ascend.kv_worker.registration import plan_kv_caches
from lmcache_ascend.multigroup.specs import KVGroupSpec, KVGroups
from lmcache_ascend.multigroup.slots import step_block_ids
from lmcache_ascend.multigroup.tracker import GroupBlockTracker

BLOCK = 16
CHUNK = 16
NUM_BLOCKS = 6
RATIOS = {"c4": 4, "indexer": 4, "c16": 16}
WIDTHS = {"c4": 12, "indexer": 5, "c16": 12}
GROUP = KVGroupSpec(0, "MLAAttentionSpec", BLOCK, 4, layer_ratios=tuple(RATIOS.items()))
POISON = 0x5A


def _caches(fill) -> dict[str, tuple[torch.Tensor]]:
    caches = {}
    for index, (name, ratio) in enumerate(RATIOS.items()):
        shape = (NUM_BLOCKS, BLOCK // ratio, WIDTHS[name])
        tensor = fill(shape, index)
        caches[name] = (tensor,)
    return caches


def _random(shape, index):
    generator = torch.Generator().manual_seed(index)
    return torch.randint(0, 255, shape, generator=generator, dtype=torch.uint8)


def _poison(shape, _):
    return torch.full(shape, POISON, dtype=torch.uint8)


def _plan(caches, bundle: bool):
    return plan_kv_caches(caches, {name: (0,) for name in caches}, {0: GROUP}, CHUNK,
                          bundle_multi_spec=bundle, num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("bundle", [True, False], ids=["bundled", "exploded"])
@pytest.mark.parametrize("cached_tokens", [0, 16])
def test_each_layer_moves_its_own_rows_of_the_shared_blocks(bundle, cached_tokens):
    block_ids = [3, 1, 5]
    num_tokens = len(block_ids) * BLOCK
    kv_groups = KVGroups((GROUP,), BLOCK)
    step = step_block_ids(kv_groups, GroupBlockTracker.for_new_request((block_ids,), 1), num_tokens, CHUNK)
    source, target = _caches(_random), _caches(_poison)
    _, source_plan = _plan(source, bundle)
    _, target_plan = _plan(target, bundle)
    # Per full chunk: 4 rows of each ratio-4 layer, 1 of the ratio-16 one.
    rows = sorted((key, rows) for group in source_plan.layer_groups
                  for identity, rows in zip(group.planes, source_plan.full_plan.regions[group.index].plane_rows)
                  for key in (source_plan.row_key(identity),))
    assert sorted(set(rows)) == [((0, 4), 4), ((0, 16), 1)]
    store, load = ChunkMover(source_plan, "torch"), ChunkMover(target_plan, "torch")
    cpu = torch.device("cpu")
    store_slots = DeviceSlots.from_block_ids(step, source_plan, cpu, 0, store.block_counts)
    load_slots = DeviceSlots.from_block_ids(step, target_plan, cpu, cached_tokens, load.block_counts)
    for start in range(0, num_tokens, CHUNK):
        chunk = torch.zeros(source_plan.full_plan.total_bytes, dtype=torch.uint8)
        store.move(chunk, start, start + CHUNK, store_slots, store=True)
        load.move(chunk, start, start + CHUNK, load_slots, store=False)
    for name, ratio in RATIOS.items():
        per_block = BLOCK // ratio
        want = torch.full_like(target[name][0], POISON).view(-1, WIDTHS[name])
        got, sent = target[name][0].view(-1, WIDTHS[name]), source[name][0].view(-1, WIDTHS[name])
        for row in range(cached_tokens // ratio, num_tokens // ratio):
            slot = block_ids[row // per_block] * per_block + row % per_block
            want[slot] = sent[slot]
        assert torch.equal(got, want), name


def test_a_tensor_that_pages_another_ratio_is_refused_naming_its_layer():
    caches = _caches(_random)
    caches["c16"] = (torch.zeros(NUM_BLOCKS, BLOCK // 4, WIDTHS["c16"], dtype=torch.uint8),)  # 4 rows: ratio 4's
    with pytest.raises(KVCacheShapeError, match="layer 'c16' .* compress_ratio 16, so 1 rows per block"):
        _plan(caches, True)


def test_a_layer_the_group_does_not_name_is_refused():
    caches = {**_caches(_random), "other": (torch.zeros(NUM_BLOCKS, 4, 3, dtype=torch.uint8),)}
    with pytest.raises(KVCacheShapeError, match="layer 'other' is not one of its layers"):
        _plan(caches, True)


def test_a_slot_mapping_given_by_group_alone_is_refused_for_several_ratios():
    _, planner = _plan(_caches(_random), True)
    mover = ChunkMover(planner, "torch")
    with pytest.raises(KVCacheShapeError, match="compress at ratios \\(4, 16\\)"):
        mover.upload({0: torch.arange(4)})
    slots = mover.upload({(0, 4): torch.arange(4), (0, 16): torch.arange(1)})
    assert dict(slots.lengths) == {(0, 4): 4, (0, 16): 1}
