"""Generated KV layouts for the transfer-kernel tests (hypothesis strategies + checks).

A `TransferCase` is plain data (formats, dtypes, block sizes, compress ratios, slot
lists with -1 and holes); `build` turns it into poisoned tensors. The expected
bytes are computed here by straight address arithmetic over each tensor's whole
storage, independently of the kernels' own byte views.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from lmcache_ascend.kernels import PagedGroup, PagedPlane, PlaneSlots, chunk_regions

DTYPES = (
    torch.int8,
    torch.uint8,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int32,
)
FORMATS = ("merged", "merged_blocks_first", "separate", "mla", "dsa", "dsa_c8", "multi_plane", "blob_views")
BLOCK_SIZES = (1, 2, 3, 4, 8, 16)
COMPRESS_RATIOS = (1, 1, 2, 4, 128)


@dataclass(frozen=True)
class PlaneCase:
    dtype: torch.dtype
    row_elements: int
    block_size: int
    num_blocks: int
    slots: tuple[int, ...]  # the whole dense slot array
    start: int
    count: int
    region_rows: int


@dataclass(frozen=True)
class TransferCase:
    format: str
    layer_count: int
    planes: tuple[PlaneCase, ...]
    chunk_offset: int
    alignment: int
    seed: int


@dataclass
class BuiltCase:
    group: PagedGroup
    slots: tuple[PlaneSlots, ...]
    storages: list[torch.Tensor]  # every distinct backing byte tensor (whole storages)
    regions: object
    chunk_bytes: int


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@st.composite
def plane_slot_lists(draw, num_rows: int, count: int, unique: bool = True):
    """`count` slots: valid distinct rows, -1 holes, and out-of-range values."""
    slots = []
    free = list(range(num_rows))
    rng = random.Random(draw(st.integers(0, 2**16)))
    rng.shuffle(free)
    for _ in range(count):
        kind = draw(st.sampled_from(("valid", "valid", "valid", "hole", "out")))
        if kind == "valid" and free:
            slots.append(free.pop())
        elif kind == "out":
            slots.append(draw(st.sampled_from((num_rows, num_rows + 7, -2, -(2**40), 2**40))))
        else:
            slots.append(-1)
    return slots


@st.composite
def transfer_cases(draw, max_tokens: int = 24, max_layers: int = 3) -> TransferCase:
    fmt = draw(st.sampled_from(FORMATS))
    layer_count = draw(st.integers(1, max_layers))
    tokens = draw(st.integers(1, max_tokens))
    if fmt in ("merged", "merged_blocks_first", "separate"):
        dtype = draw(st.sampled_from(DTYPES))
        width = draw(st.integers(1, 12))
        specs = [(dtype, width), (dtype, width)]
        same_block = True
    elif fmt == "mla":
        dtype = draw(st.sampled_from(DTYPES))
        specs = [(dtype, draw(st.integers(1, 12))), (dtype, draw(st.integers(1, 6)))]
        same_block = True
    elif fmt == "dsa":
        specs = [(draw(st.sampled_from(DTYPES)), draw(st.integers(1, 10))) for _ in range(3)]
        same_block = True
    elif fmt == "dsa_c8":
        # int8 latent, fp scale, int8 indexer, fp16 indexer scale of width 1.
        specs = [
            (torch.int8, draw(st.integers(1, 40))),
            (draw(st.sampled_from((torch.float16, torch.bfloat16, torch.float32))), draw(st.integers(1, 4))),
            (torch.int8, draw(st.sampled_from((8, 16, 128, 132)))),
            (torch.float16, 1),
        ]
        same_block = True
    else:  # multi_plane, blob_views: each plane its own geometry
        plane_count = draw(st.integers(1, 4))
        specs = [(draw(st.sampled_from(DTYPES)), draw(st.integers(1, 10))) for _ in range(plane_count)]
        same_block = False
    shared_block_size = draw(st.sampled_from(BLOCK_SIZES))
    # Formats whose planes live in one tensor or one blob share the block count.
    shared_num_blocks = draw(st.integers(1, 5)) if fmt != "multi_plane" else None
    planes = []
    for dtype, width in specs:
        block_size = shared_block_size if same_block else draw(st.sampled_from(BLOCK_SIZES))
        ratio = 1 if same_block else draw(st.sampled_from(COMPRESS_RATIOS))
        count = -(-tokens // ratio)
        num_blocks = shared_num_blocks or draw(st.integers(1, 5))
        num_rows = num_blocks * block_size
        lead = draw(st.integers(0, 3))
        tail = draw(st.integers(0, 2))
        slots = draw(plane_slot_lists(num_rows, lead + count + tail))
        region_rows = count + draw(st.sampled_from((0, 0, 0, 1, 3)))
        planes.append(PlaneCase(dtype, width, block_size, num_blocks, tuple(slots), lead, count, region_rows))
    return TransferCase(
        format=fmt,
        layer_count=layer_count,
        planes=tuple(planes),
        chunk_offset=draw(st.sampled_from((0, 0, 32, 4, 1, 96))),
        alignment=draw(st.sampled_from((32, 32, 32, 1, 16))),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _random_bytes(tensor: torch.Tensor, generator: torch.Generator) -> None:
    tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator))


def _whole_storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


def build(case: TransferCase, device: str = "cpu", seed_offset: int = 0) -> BuiltCase:
    """Tensors for `case`, every byte random (poison): caches, blobs and all."""
    generator = torch.Generator().manual_seed(case.seed + seed_offset)
    per_layer: list[list[torch.Tensor]] = []
    backing: list[torch.Tensor] = []
    for _ in range(case.layer_count):
        tensors = []
        p0 = case.planes[0]
        if case.format in ("merged", "merged_blocks_first"):
            if case.format == "merged":
                both = torch.empty((2, p0.num_blocks, p0.block_size, p0.row_elements), dtype=p0.dtype, device=device)
                tensors = [both[0], both[1]]
            else:  # vLLM flash layout: K/V inside each block, so the block dim is strided
                both = torch.empty((p0.num_blocks, 2, p0.block_size, p0.row_elements), dtype=p0.dtype, device=device)
                tensors = [both[:, 0], both[:, 1]]
            backing.append(both)
        elif case.format in ("blob_views", "dsa_c8"):
            # One int8 blob per layer; each plane a dtype view of a byte range of every block.
            sizes = [p.block_size * p.row_elements * _element_size(p.dtype) for p in case.planes]
            offsets, cursor = [], 0
            for plane, size in zip(case.planes, sizes):
                element = _element_size(plane.dtype)
                cursor = -(-cursor // element) * element
                offsets.append(cursor)
                cursor += size
            block_bytes = -(-cursor // 8) * 8
            blob = torch.empty((p0.num_blocks, block_bytes), dtype=torch.int8, device=device)
            backing.append(blob)
            for plane, offset, size in zip(case.planes, offsets, sizes):
                view = blob[:, offset : offset + size].view(plane.dtype)
                tensors.append(view.view(p0.num_blocks, plane.block_size, plane.row_elements))
        else:
            for plane in case.planes:
                shape = (plane.num_blocks, plane.block_size, plane.row_elements)
                if plane.row_elements % 2 == 0 and case.seed % 2:
                    shape = (plane.num_blocks, plane.block_size, 2, plane.row_elements // 2)  # heads x dim
                tensor = torch.empty(shape, dtype=plane.dtype, device=device)
                backing.append(tensor)
                tensors.append(tensor)
        per_layer.append(tensors)
    storages = []
    seen = set()
    for tensor in backing:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            storages.append(_whole_storage_bytes(tensor))
    for storage in storages:
        _random_bytes(storage, generator)
    planes = tuple(
        PagedPlane(
            tuple(per_layer[layer][index] for layer in range(case.layer_count)),
            plane.block_size,
            plane.row_elements * _element_size(plane.dtype),
            name=f"{case.format}[{index}]",
        )
        for index, plane in enumerate(case.planes)
    )
    group = PagedGroup(planes)
    slots = tuple(
        PlaneSlots(torch.tensor(p.slots, dtype=torch.int64, device=device), p.start, p.count, p.region_rows)
        for p in case.planes
    )
    regions = chunk_regions([p.row_bytes for p in planes], [p.region_rows for p in case.planes], case.layer_count, case.alignment)
    return BuiltCase(group, slots, storages, regions, case.chunk_offset + regions.total_bytes + 8)


def poisoned_chunk(size: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).to(device)


def _row_address(built: BuiltCase, layer: int, plane: int, slot: int) -> tuple[torch.Tensor, int]:
    """(whole-storage bytes, byte offset) of paged row `slot`, by address arithmetic."""
    tensor = built.group.planes[plane].caches[layer]
    element = tensor.element_size()
    block_size = built.group.planes[plane].block_size
    row_bytes = built.group.planes[plane].row_bytes
    storage = _whole_storage_bytes(tensor)
    block, row = divmod(slot, block_size)
    return storage, tensor.storage_offset() * element + block * tensor.stride(0) * element + row * row_bytes


def valid_rows(built: BuiltCase, case: TransferCase, plane: int) -> list[tuple[int, int]]:
    """(chunk row t, slot) for every slot that must move."""
    pc = case.planes[plane]
    rows = []
    limit = pc.num_blocks * pc.block_size
    for t in range(pc.count):
        slot = pc.slots[pc.start + t]
        if 0 <= slot < limit:
            rows.append((t, slot))
    return rows


def _moved_rows(built: BuiltCase, case: TransferCase):
    """Every row the contract moves: (its first chunk byte, row bytes, its storage, its byte offset there)."""
    for layer in range(case.layer_count):
        for plane in range(len(case.planes)):
            row_bytes = built.group.planes[plane].row_bytes
            region = case.chunk_offset + built.regions.region_offset(layer, plane)
            for t, slot in valid_rows(built, case, plane):
                storage, offset = _row_address(built, layer, plane, slot)
                yield region + t * row_bytes, row_bytes, storage, offset


def expected_chunk_after_store(built: BuiltCase, case: TransferCase, chunk_before: torch.Tensor) -> torch.Tensor:
    expected = chunk_before.clone()
    for at, row_bytes, storage, offset in _moved_rows(built, case):
        expected[at : at + row_bytes] = storage[offset : offset + row_bytes]
    return expected


def expected_storages_after_load(
    built: BuiltCase, case: TransferCase, chunk: torch.Tensor
) -> list[torch.Tensor]:
    """The target's whole storages after a load of `chunk`: poison except the valid rows."""
    expected = {s.data_ptr(): s.clone() for s in built.storages}
    for at, row_bytes, storage, offset in _moved_rows(built, case):
        expected[storage.data_ptr()][offset : offset + row_bytes] = chunk[at : at + row_bytes]
    return [expected[s.data_ptr()] for s in built.storages]


def describe(case: TransferCase) -> str:
    planes = ", ".join(
        f"{str(p.dtype).removeprefix('torch.')}x{p.row_elements} bs={p.block_size} nb={p.num_blocks} "
        f"count={p.count}" for p in case.planes
    )
    return f"{case.format} L={case.layer_count} [{planes}] off={case.chunk_offset} align={case.alignment}"


__all__ = [
    "BuiltCase",
    "TransferCase",
    "build",
    "describe",
    "expected_chunk_after_store",
    "expected_storages_after_load",
    "transfer_cases",
    "poisoned_chunk",
]


def move_layers(caches, slots: torch.Tensor, chunk: torch.Tensor, *, store: bool, block_size: int, row_bytes: int,
                alignment: int | None = None) -> None:
    """One plane over `caches` (one per layer) moved by the reference backend; `alignment=1` is
    LMCache's dense [layers, tokens, row] chunk."""
    from lmcache_ascend.kernels import transfer_group

    group = PagedGroup((PagedPlane(tuple(caches), block_size, row_bytes, name="layers"),))
    options = {} if alignment is None else {"alignment": alignment}
    transfer_group(group, (PlaneSlots(slots),), chunk, store=store, backend="torch", **options)
