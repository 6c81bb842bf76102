"""Fuzzed round trip through the chunk plan and the kernels' torch reference.

Generated models mix every format (merged, separate, MLA, DSA, DSA-C8,
multi-plane across scheduler groups, dtype views of one blob), dtypes (int8,
uint8, fp8, fp16, bf16, fp32), block sizes, compress ratios and sliding
windows; slot mappings hold -1 rows.  Source caches are random, the chunk
buffer and the target caches are poisoned; every chunk is stored then loaded,
and every byte of every target tensor must equal an expectation computed
here by plain tensor indexing: moved rows from the source, all else poison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kv_worker._geometry import geometry as group_geometry
from lmcache_ascend.kv_worker import (
    ChunkPlanner,
    ChunkMover,
    build_layer_groups,
    detect_layer_planes,
)
from lmcache_ascend.kv_worker.registration import plan_kv_caches
from tests.fixtures.kv_caches import TOKEN_MAJOR_KV_DIMS

POISON = 0xA5
DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32)
FORMATS = ("merged", "separate", "mla", "dsa", "dsa_c8", "multi_plane", "blob_views")


@dataclass(frozen=True)
class LayerSpec:
    format: str
    groups: tuple[int, ...]  # scheduler group per registered tensor (or one for all)
    widths: tuple[int, ...]  # elements per row, per plane
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class ModelSpec:
    geometry: dict
    block_size: dict  # rows per block, per scheduler group
    layers: tuple[LayerSpec, ...]
    chunk_size: int
    num_tokens: int
    seed: int
    # Tokens vLLM already holds on load: rows wholly before them are not written.
    vllm_cached_tokens: int = 0


@st.composite
def models(draw) -> ModelSpec:
    num_groups = draw(st.integers(1, 3))
    geometry, block_size = {}, {}
    for group in range(num_groups):
        ratio = draw(st.sampled_from((1, 2, 4)))
        window = draw(st.sampled_from((None, ratio, 2 * ratio, 4 * ratio)))
        geometry[group] = group_geometry(group, ratio, window, transferred=draw(st.booleans()) or group == 0)
        block_size[group] = draw(st.sampled_from((1, 2, 4, 8)))
    layers = []
    for index in range(draw(st.integers(1, 4))):
        fmt = draw(st.sampled_from(FORMATS))
        # Layer 0 sits in group 0, which always moves: a plan needs one moved plane.
        group = 0 if index == 0 else draw(st.integers(0, num_groups - 1))
        dtype = draw(st.sampled_from(DTYPES))
        if fmt in ("merged", "separate"):
            width = draw(st.integers(1, 9))
            layers.append(LayerSpec(fmt, (group,), (width, width), (dtype, dtype)))
        elif fmt == "mla":
            widths = draw(st.lists(st.integers(1, 9), min_size=2, max_size=2, unique=True))
            layers.append(LayerSpec(fmt, (group,), tuple(widths), (dtype, dtype)))
        elif fmt == "dsa":
            layers.append(LayerSpec(fmt, (group,), tuple(draw(st.lists(st.integers(1, 9), min_size=3, max_size=3))), (dtype,) * 3))
        elif fmt == "dsa_c8":
            widths = tuple(draw(st.lists(st.integers(1, 9), min_size=4, max_size=4)))
            layers.append(LayerSpec(fmt, (group,), widths, (torch.int8, torch.int8, torch.float16, torch.float16)))
        elif fmt == "multi_plane":
            count = draw(st.integers(2, 3))
            groups = (group,) + tuple(draw(st.integers(0, num_groups - 1)) for _ in range(count - 1))
            widths = tuple(draw(st.integers(1, 9)) for _ in range(count))
            dtypes = tuple(draw(st.sampled_from(DTYPES)) for _ in range(count))
            layers.append(LayerSpec(fmt, groups, widths, dtypes))
        else:  # an int8 blob: K of `width` bytes then a 4-byte fp32 scale, as two views
            width = 4 * draw(st.integers(1, 8))
            layers.append(LayerSpec(fmt, (group,), (width, 1), (torch.int8, torch.float32)))
    chunk_size = draw(st.sampled_from((4, 8, 16)))
    num_tokens = draw(st.integers(1, 3 * chunk_size))
    seed = draw(st.integers(0, 2**16))
    cached = draw(st.sampled_from((0, 0, draw(st.integers(0, num_tokens)))))
    return ModelSpec(geometry, block_size, tuple(layers), chunk_size, num_tokens, seed, cached)


def _num_rows(model: ModelSpec, group: int) -> int:
    return math.ceil(model.num_tokens / model.geometry[group].compress_ratio)


def _num_blocks(model: ModelSpec, group: int) -> int:
    return math.ceil(_num_rows(model, group) / model.block_size[group]) + 2  # spare blocks stay untouched


def _new(shape, dtype, fill, generator) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    raw = tensor.view(torch.uint8)
    if fill == "poison":
        raw.fill_(POISON)
    else:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return tensor


def _build(model: ModelSpec, fill: str, generator: torch.Generator):
    """Registered caches, and per layer the row owners: (tensor, group) with row s = tensor[s // bs, s % bs]."""
    caches, owners = {}, {}
    for index, layer in enumerate(model.layers):
        name = f"layers.{index}"
        groups = layer.groups * (len(layer.widths) if len(layer.groups) == 1 else 1)
        shapes = [(_num_blocks(model, g), model.block_size[g], w) for g, w in zip(groups, layer.widths)]
        if layer.format == "merged":
            blocks, rows, width = shapes[0]
            tensor = _new((2, blocks, rows, 1, width), layer.dtypes[0], fill, generator)
            caches[name], owners[name] = tensor, [(tensor[0], groups[0]), (tensor[1], groups[0])]
        elif layer.format == "blob_views":
            blocks, rows, width = shapes[0]
            blob = _new((blocks, rows, width + 4), torch.int8, fill, generator)
            caches[name] = (blob[:, :, :width], blob[:, :, width:].view(torch.float32))
            owners[name] = [(blob, groups[0])]
        else:
            planes = tuple(_new(shape, dtype, fill, generator) for shape, dtype in zip(shapes, layer.dtypes))
            caches[name], owners[name] = planes, list(zip(planes, groups))
    plane_groups = {f"layers.{i}": layer.groups for i, layer in enumerate(model.layers)}
    return caches, plane_groups, owners


def _backend_dims(caches) -> dict:
    # The only single tensors _build registers are merged [2, blocks, block_size, 1, width].
    return {name: TOKEN_MAJOR_KV_DIMS for name, cache in caches.items() if isinstance(cache, torch.Tensor)}


def _slot_mappings(model: ModelSpec, generator: torch.Generator) -> dict[int, torch.Tensor]:
    mappings = {}
    for group in model.geometry:
        rows = _num_rows(model, group)
        pool = _num_blocks(model, group) * model.block_size[group]
        slots = torch.randperm(pool, generator=generator)[:rows].to(torch.int64)
        holes = torch.rand(rows, generator=generator) < 0.2
        slots[holes] = -1
        mappings[group] = slots
    return mappings


def _moved_rows(model: ModelSpec, group: int, slots: torch.Tensor) -> list[int]:
    geometry = model.geometry[group]
    moved = []
    for start in range(0, model.num_tokens, model.chunk_size):
        end = min(start + model.chunk_size, model.num_tokens)
        first, last = start // geometry.compress_ratio, math.ceil(end / geometry.compress_ratio)
        if geometry.sliding_window is not None:
            first = max(first, last - geometry.sliding_window // geometry.compress_ratio)
        first = max(first, model.vllm_cached_tokens // geometry.compress_ratio)
        moved.extend(int(slots[row]) for row in range(first, last) if slots[row] >= 0)
    return moved


@settings(max_examples=250, deadline=None)
@given(models())
def test_store_then_load_is_byte_exact_and_touches_nothing_else(model):
    generator = torch.Generator().manual_seed(model.seed)
    source, plane_groups, source_owners = _build(model, "random", generator)
    target, _, target_owners = _build(model, "poison", generator)
    slots = _slot_mappings(model, generator)
    dims_by_layer = _backend_dims(source)
    _, source_planner = plan_kv_caches(source, plane_groups, model.geometry, model.chunk_size, backend_dims=dims_by_layer)
    _, target_planner = plan_kv_caches(target, plane_groups, model.geometry, model.chunk_size, backend_dims=dims_by_layer)
    store, load = ChunkMover(source_planner, backend="torch"), ChunkMover(target_planner, backend="torch")

    for start in range(0, model.num_tokens, model.chunk_size):
        end = min(start + model.chunk_size, model.num_tokens)
        chunk = torch.full((source_planner.plan(end - start).total_bytes,), POISON, dtype=torch.uint8)
        store.move(chunk, start, end, slots, store=True)
        load.move(chunk, start, end, load.upload(slots, model.vllm_cached_tokens), store=False)

    for name, owners in target_owners.items():
        for (got, group), (src, _) in zip(owners, source_owners[name]):
            expected = torch.full_like(got.view(torch.uint8), POISON)
            if model.geometry[group].transferred:
                bs = model.block_size[group]
                for slot in _moved_rows(model, group, slots[group]):
                    expected[slot // bs, slot % bs] = src.view(torch.uint8)[slot // bs, slot % bs]
            assert torch.equal(got.view(torch.uint8), expected), f"{name} (group {group})"


def test_bundled_and_exploded_move_the_same_bytes_with_fewer_launches():
    geometry = {0: group_geometry(0), 1: group_geometry(1, compress_ratio=4)}
    generator = torch.Generator().manual_seed(7)

    def caches():
        return {
            f"l{i}": (
                _new((6, 4, 8), torch.bfloat16, "random", generator),
                _new((3, 4, 4), torch.int8, "random", generator),
                _new((3, 4, 1), torch.float16, "random", generator),
            )
            for i in range(3)
        }

    source = caches()
    plane_groups = {name: (0, 1, 1) for name in source}
    slots = {0: torch.arange(16, dtype=torch.int64), 1: torch.arange(4, dtype=torch.int64)}
    launches, chunks = {}, {}
    for bundle in (True, False):
        layers = [detect_layer_planes(name, cache, plane_groups[name]) for name, cache in source.items()]
        planner = ChunkPlanner(build_layer_groups(layers, geometry, bundle_multi_spec=bundle), geometry, 16)
        chunk = torch.zeros(planner.full_plan.total_bytes, dtype=torch.uint8)
        launches[bundle] = ChunkMover(planner, backend="torch").move(chunk, 0, 16, slots, store=True)
        chunks[bundle] = (planner, chunk)
    assert launches == {True: 1, False: 3}
    # Same bytes, laid out per group: compare each plane region of layer 0.
    for bundle, (planner, chunk) in chunks.items():
        plan = planner.full_plan
        first_plane = plan.regions[0].plane_byte_offset(0, 0)
        assert torch.equal(chunk[first_plane : first_plane + 16 * 16], source["l0"][0].view(torch.uint8).reshape(-1)[: 16 * 16])
