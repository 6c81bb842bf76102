"""MultiGroupGPUConnector against LMCache's interface: its errors, and a real TensorMemoryObj round trip."""

from __future__ import annotations

import pytest
import torch

from tests.kv_worker._geometry import geometry as group_geometry
from lmcache_ascend.kernels import TransferError
from lmcache_ascend.kv_worker import KVCacheShapeError, plan_kv_caches
from tests.fixtures.kv_caches import LATENT_DIMS
from tests.patching import apply_now

GEOMETRY = {0: group_geometry(0), 1: group_geometry(1, compress_ratio=4, sliding_window=8)}
CHUNK = 16


def _caches(fill: int | None = None):
    generator = torch.Generator().manual_seed(5)
    caches = {
        "full": torch.randint(0, 256, (6, 4, 24), dtype=torch.uint8, generator=generator),
        "compressed": (
            torch.randint(0, 256, (4, 2, 8), dtype=torch.uint8, generator=generator).view(torch.int8),
            torch.randint(0, 256, (4, 2, 4), dtype=torch.uint8, generator=generator).view(torch.float16),
        ),
    }
    if fill is not None:
        caches["full"].fill_(fill)
        for plane in caches["compressed"]:
            plane.view(torch.uint8).fill_(fill)
    return caches


def _connector(caches):
    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector

    connector = MultiGroupGPUConnector(CHUNK, backend="torch")
    layers, planner = plan_kv_caches(
        caches, {"full": (0,), "compressed": (1,)}, GEOMETRY, CHUNK, backend_dims={"full": LATENT_DIMS}
    )
    connector.register(layers, planner)
    return connector


def _memory_obj(shape, raw_bytes: int | None = None):
    """A real TensorMemoryObj of `shape` (uint8) over a raw allocation of `raw_bytes` (its own size by default)."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    raw = torch.full((raw_bytes or int(torch.Size(shape).numel()),), 0xA5, dtype=torch.uint8)
    metadata = MemoryObjMetadata(
        shape=torch.Size(shape), dtype=torch.uint8, address=0, phy_size=raw.numel(), ref_count=1, fmt=MemoryFormat.KV_2LTD
    )
    return TensorMemoryObj(raw, metadata, None)


def test_batched_store_and_load_through_real_memory_objects():
    source, target = _caches(), _caches(fill=0)
    slots = [torch.arange(24, dtype=torch.int64).flip(0), torch.tensor([7, 6, 5, 4, 3, 2], dtype=torch.int64)]
    store = _connector(source)
    objects = [_memory_obj(store.get_shape(CHUNK)), _memory_obj(store.get_shape(8))]
    assert store.get_shape(8)[2] == 8  # LMCache reads the token count from dim 2
    store.batched_from_gpu(objects, [0, 16], [16, 24], slot_mappings_by_group=slots)
    load = _connector(target)
    load.batched_to_gpu(objects, [0, 16], [16, 24], slot_mappings_by_group={0: slots[0], 1: slots[1]})
    assert torch.equal(target["full"].view(-1, 24)[slots[0]], source["full"].view(-1, 24)[slots[0]])
    # Compressed group, window 8 tokens = 2 rows per chunk: chunk 0 keeps rows 2-3, chunk 1 (8 tokens) rows 4-5.
    for target_plane, source_plane in zip(target["compressed"], source["compressed"]):
        got, want = target_plane.view(torch.uint8).view(8, -1), source_plane.view(torch.uint8).view(8, -1)
        moved = [int(slots[1][row]) for row in (2, 3, 4, 5)]
        untouched = [slot for slot in range(8) if slot not in moved]
        assert torch.equal(got[moved], want[moved])
        assert int(got[untouched].count_nonzero()) == 0
    assert (store.launches, load.launches) == (4, 4)  # 2 layer groups x 2 chunks each way


def test_connector_errors_name_the_problem():
    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector

    fresh = MultiGroupGPUConnector(CHUNK)
    with pytest.raises(KVCacheShapeError, match="before KV caches were registered"):
        fresh.get_shape(CHUNK)
    with pytest.raises(KVCacheShapeError, match="chunk_size=0 must be a positive int"):
        MultiGroupGPUConnector(0)
    layers, planner = plan_kv_caches(_caches(), {"full": (0,), "compressed": (1,)}, GEOMETRY, 8, backend_dims={"full": LATENT_DIMS})
    with pytest.raises(KVCacheShapeError, match="planned for chunk_size=8 but the connector moves chunks of 16"):
        fresh.register(layers, planner)

    connector = _connector(_caches())
    memory = _memory_obj(connector.get_shape(CHUNK))
    with pytest.raises(KVCacheShapeError, match="use scheduler groups \\(0, 1\\); pass 'slot_mappings_by_group'"):
        connector.from_gpu(memory, 0, CHUNK, slot_mapping=torch.arange(CHUNK))
    with pytest.raises(KVCacheShapeError, match="neither 'slot_mappings_by_group' nor 'slot_mapping'"):
        connector.from_gpu(memory, 0, CHUNK)
    with pytest.raises(KVCacheShapeError, match="no slot mapping for scheduler group 1"):
        connector.from_gpu(memory, 0, CHUNK, slot_mappings_by_group={0: torch.arange(CHUNK)})
    with pytest.raises(KVCacheShapeError, match="slot mapping of scheduler group 1 has 2 entries"):
        connector.from_gpu(memory, 0, CHUNK, slot_mappings_by_group=[torch.arange(CHUNK), torch.arange(2)])
    small = _memory_obj((1, 1, CHUNK, 1))
    with pytest.raises(KVCacheShapeError, match="memory object of 16 bytes cannot hold tokens \\[0, 16\\)"):
        connector.from_gpu(small, 0, CHUNK, slot_mappings_by_group=[torch.arange(CHUNK), torch.arange(4)])
    # In a batch the objects are read in one pass; the one too small is still named by its tokens.
    with pytest.raises(KVCacheShapeError, match="memory object of 16 bytes cannot hold tokens \\[16, 32\\)"):
        connector.batched_from_gpu([memory, small], [0, CHUNK], [CHUNK, 2 * CHUNK],
                                   slot_mappings_by_group=[torch.arange(2 * CHUNK), torch.arange(8)])


def test_a_batch_of_alike_allocations_is_bounded_by_each_objects_own_size():
    """Full chunks whose raw allocations are all alike are read in one pass; an object whose own
    (logical) size is smaller than its allocation is still refused by its tokens, nothing moved."""
    caches = _caches()
    connector = _connector(caches)
    shape = connector.get_shape(CHUNK)
    full = int(torch.Size(shape).numel())
    objects = [_memory_obj(shape) for _ in range(3)]
    slots = [torch.arange(3 * CHUNK, dtype=torch.int64) % 24, torch.arange(12, dtype=torch.int64) % 8]
    connector.batched_from_gpu(objects, [0, CHUNK, 2 * CHUNK], [CHUNK, 2 * CHUNK, 3 * CHUNK],
                               slot_mappings_by_group=slots)
    assert all(int((obj.raw_tensor != 0xA5).sum()) > 0 for obj in objects)
    narrowed = [_memory_obj(shape), _memory_obj((1, 1, CHUNK, 1), raw_bytes=full), _memory_obj(shape)]
    assert len({obj.raw_tensor.numel() for obj in narrowed}) == 1  # the allocations look alike
    with pytest.raises(KVCacheShapeError, match="memory object of 16 bytes cannot hold tokens \\[16, 32\\)"):
        connector.batched_from_gpu(narrowed, [0, CHUNK, 2 * CHUNK], [CHUNK, 2 * CHUNK, 3 * CHUNK],
                                   slot_mappings_by_group=slots)
    assert all(bool((obj.raw_tensor == 0xA5).all()) for obj in narrowed), "a refused batch moved bytes"
    # One raw tensor unlike the first's (int16 over the same bytes) is refused by the mover's one
    # check of them all, naming it, before any byte moves.
    odd = _memory_obj(shape)
    odd.raw_data = odd.raw_tensor.view(torch.int16)
    mixed = [_memory_obj(shape), odd, _memory_obj(shape)]
    with pytest.raises(TransferError, match=r"chunks\[1\] = torch.int16"):
        connector.batched_from_gpu(mixed, [0, CHUNK, 2 * CHUNK], [CHUNK, 2 * CHUNK, 3 * CHUNK],
                                   slot_mappings_by_group=slots)
    assert bool((mixed[0].raw_tensor == 0xA5).all()) and bool((mixed[2].raw_tensor == 0xA5).all())


@pytest.fixture
def factory_patches():
    from lmcache_ascend.patches import State, registry

    names = ("lmcache-metadata-chunk-bytes", "lmcache-gpu-connector-npu")
    patches = registry.process_registry()
    for name in names:
        assert apply_now(patches, name) is State.APPLIED, patches.record(name).reason
    yield
    for name in reversed(names):
        patches.revert(name)


def test_patches_leave_upstream_answers_where_they_do_not_apply(factory_patches):
    from lmcache.utils import EngineType
    from lmcache.v1 import gpu_connector as factory
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    metadata = LMCacheMetadata(
        model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.float16, kv_shape=(4, 2, CHUNK, 2, 8), chunk_size=CHUNK,
    )
    # No chunk layout attached: LMCache's own [kv, layers, tokens, hidden] shape and dtype.
    assert metadata.get_shapes(8) == [torch.Size([2, 4, 8, 16])]
    assert metadata.get_dtypes() == [torch.float16]
    # Engines other than vLLM keep upstream's connector.
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
    assert isinstance(factory.CreateGPUConnector(config, metadata, EngineType.MOCK), MockGPUConnector)
    # With a layout attached, one uint8 chunk buffer.
    connector = _connector(_caches())
    metadata.ascend_chunk_planner = connector.planner
    assert metadata.get_shapes(8) == [connector.get_shape(8)]
    assert metadata.get_dtypes() == [torch.uint8]
