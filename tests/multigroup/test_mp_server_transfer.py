"""The per-group server's moves on the host: LMCache 0.4.5's real layer-group manager (patched) and
`lmcache_ascend.ops` (the torch reference here), DeepSeek-V4-like groups, every byte compared (stack A).

The server's CUDA context (streams, IPC handles, cupy) cannot exist here; the
test stands in for it with the manager's own shape descriptors, LMCache's
pointer tables and chunk buffers of the shapes the context allocates.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests import stack

stack.only_with_lmcache_04("the per-group MP server patch")

from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.gpu_connector.utils import get_group_data_ptrs, normalize_kv_and_discover_format  # noqa: E402
from lmcache.v1.kv_layer_groups import KVLayerGroupsManager  # noqa: E402

from lmcache_ascend.multigroup.attachments import GROUP_PLAN  # noqa: E402
from lmcache_ascend.patches.lmcache.mp_server_per_group import batch_block_ids, move_chunks  # noqa: E402
from lmcache_ascend.multigroup.mp_server import chunk_block_ids, client_hints, retrieve_batches  # noqa: E402
from lmcache_ascend.patches import State, registry  # noqa: E402
from tests.patching import apply_now  # noqa: E402

REGISTRY = registry.process_registry()
TOKENS_PER_BLOCK = (256, 64, 64, 4, 8)
ROWS_PER_BLOCK = (64, 64, 16, 4, 8)  # compress ratios 4, 1, 4, 1, 1
LAYER_GROUPS = (0, 1, 2, 3, 4, 0, 1, 2, 3, 4)
CHUNK, TOKENS, NUM_BLOCKS, HEADS, HEAD_SIZE, BATCH = 256, 4096, 1100, 2, 16, 4
POISON = 0x5A


class _HostContext:
    """What the server's GPUCacheContext gives a transfer, built from the same LMCache pieces."""

    def __init__(self, manager, kv_caches, kv_format):
        self.manager, self.device, self.gpu_kv_format_ = manager, torch.device("cpu"), kv_format
        self.pointers = [torch.tensor(get_group_data_ptrs(kv_caches, kv_format, g.layer_indices), dtype=torch.long)
                         for g in manager.kv_layer_groups]

    def get_group_kv_pointers(self, layer_group):
        return self.pointers[layer_group]

    def get_shape_desc(self, layer_group):
        return self.manager.get_shape_desc(layer_group)

    def get_physical_chunk_size(self, layer_group):
        return self.manager.get_physical_chunk_size(layer_group)

    def chunk_buffer(self, layer_group):
        group = self.manager.kv_layer_groups[layer_group]
        shape = (group.shape_desc.kv_size, group.num_layers, self.get_physical_chunk_size(layer_group),
                 group.hidden_dim_size)
        return torch.zeros(shape, dtype=group.dtype)


@pytest.fixture
def layer_groups_patch():
    assert apply_now(REGISTRY, "lmcache-mp-server-layer-groups") is State.APPLIED
    yield
    assert REGISTRY.revert("lmcache-mp-server-layer-groups") is State.REVERTED


def _setup():
    generator = torch.Generator().manual_seed(5)
    caches = []
    for group in LAYER_GROUPS:
        tensor = torch.empty(2, NUM_BLOCKS, ROWS_PER_BLOCK[group], HEADS, HEAD_SIZE, dtype=torch.float16)
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
        caches.append(tensor)
    hints = {"kv_layout": "NHD", **client_hints(list(LAYER_GROUPS), TOKENS_PER_BLOCK, "test")}
    kv_format, kv = normalize_kv_and_discover_format(caches, EngineType.VLLM, layout_hints=hints)
    manager = KVLayerGroupsManager(kv, gpu_kv_format=kv_format, num_blocks=NUM_BLOCKS, layout_hints=hints,
                                   lmcache_logical_chunk_size=CHUNK)
    return caches, _HostContext(manager, kv, kv_format), GROUP_PLAN.get(manager)


def _ids(seed):
    rng = random.Random(seed)
    return [rng.sample(range(1, NUM_BLOCKS), TOKENS // size) for size in TOKENS_PER_BLOCK]


def test_layer_groups_split_by_kv_group_with_per_group_compression(layer_groups_patch):
    _, context, (plan, owners) = _setup()
    groups = context.manager.kv_layer_groups
    assert owners == (0, 1, 2, 3, 4)
    assert [g.layer_indices for g in groups] == [[0, 5], [1, 6], [2, 7], [3, 8], [4, 9]]
    assert [g.compress_ratio for g in groups] == [4, 1, 4, 1, 1]
    assert [g.physical_chunk_size for g in groups] == [64, 256, 64, 256, 256]
    assert plan.blocks_per_chunk(CHUNK) == (1, 4, 4, 64, 32)


def test_flat_registration_is_upstream_grouping(layer_groups_patch):
    caches, _, _ = _setup()
    kv_format, kv = normalize_kv_and_discover_format(caches, EngineType.VLLM, layout_hints={"kv_layout": "NHD"})
    ours = KVLayerGroupsManager(kv, gpu_kv_format=kv_format, num_blocks=NUM_BLOCKS, layout_hints={"kv_layout": "NHD"})
    REGISTRY.revert("lmcache-mp-server-layer-groups")
    try:
        theirs = KVLayerGroupsManager(kv, gpu_kv_format=kv_format, num_blocks=NUM_BLOCKS,
                                      layout_hints={"kv_layout": "NHD"})
    finally:
        apply_now(REGISTRY, "lmcache-mp-server-layer-groups")
    assert repr(ours.kv_layer_groups) == repr(theirs.kv_layer_groups)
    assert [g.layer_indices for g in ours.kv_layer_groups][0] == [0, 1, 5, 6]  # groups 0 and 1 merge upstream
    assert GROUP_PLAN.get(ours) is None


@pytest.mark.parametrize("skip_first_n_tokens", [0, 300])
def test_store_then_retrieve_elsewhere_every_byte(layer_groups_patch, skip_first_n_tokens):
    caches, context, (plan, owners) = _setup()
    per_chunk = plan.blocks_per_chunk(CHUNK)
    num_chunks = TOKENS // CHUNK
    stored, loaded = _ids(1), _ids(2)
    saved = [tensor.clone() for tensor in caches]
    objects = []  # per chunk, per layer group: the chunk bytes the server would keep
    for chunk in chunk_block_ids(stored, per_chunk, num_chunks):
        buffers = [context.chunk_buffer(lg) for lg in range(len(owners))]
        move_chunks(context, owners, batch_block_ids([chunk]), lambda lg: [buffers[lg]], 1, 0, plan.block_sizes)
        objects.append(buffers)

    for tensor in caches:
        tensor.view(torch.uint8).fill_(POISON)
    chunks = chunk_block_ids(loaded, per_chunk, num_chunks)
    for first, count, skip in retrieve_batches(num_chunks, BATCH, CHUNK, skip_first_n_tokens):
        move_chunks(context, owners, batch_block_ids(chunks[first:first + count]),
                    lambda lg: [objects[c][lg] for c in range(first, first + count)], 0, skip, plan.block_sizes)

    for layer, group in enumerate(LAYER_GROUPS):
        skipped = skip_first_n_tokens // TOKENS_PER_BLOCK[group]  # whole blocks the engine already holds
        got, want = caches[layer].view(torch.uint8), saved[layer].view(torch.uint8)
        into, source = torch.tensor(loaded[group][skipped:]), torch.tensor(stored[group][skipped:])
        assert torch.equal(got[:, into], want[:, source]), f"layer {layer} (group {group})"
        untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
        untouched[into] = False
        assert bool((got[:, untouched] == POISON).all()), f"layer {layer}: a block outside the load was written"
        assert skipped == 0 or bool((got[:, loaded[group][:skipped]] == POISON).all())


def test_retrieve_batches():
    assert retrieve_batches(16, 4, 256, 0) == [(0, 4, 0), (4, 4, 0), (8, 4, 0), (12, 4, 0)]
    assert retrieve_batches(6, 4, 256, 1100) == [(4, 2, 76)]  # the first batch lies in the prefix cache
    assert retrieve_batches(6, 4, 256, 300) == [(0, 4, 300), (4, 2, 0)]
    with pytest.raises(ValueError, match="batch=0"):
        retrieve_batches(6, 0, 256, 0)
