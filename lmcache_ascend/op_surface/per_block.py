"""LMCache's block op (multi-process mode): whole blocks <-> LMCache memory objects.

`multi_layer_block_kv_transfer`: object i holds blocks [i*B, (i+1)*B) of the block ids; objects
that share a layout and placement move in one launch, and a repeated call makes that launch again.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import torch

from lmcache_ascend.kernels.dispatch import prepare_chunks_relaunch, transfer_chunk_batches
from lmcache_ascend.kernels.paged import PagedGroup
from lmcache_ascend.kernels.resolve import (
    ChunkRows,
    PlaneSlots,
    chunk_buffers,
    chunk_rows,
    resolve_chunk_batch,
)
from lmcache_ascend.kernels.same_layout import SameLayout
from lmcache_ascend.kernels.spec import MAX_PLANES, TransferError
from lmcache_ascend.kernels.upload import to_device
from lmcache_ascend.layouts import BLOCK_OP, FormatFacts, layout_of, paged_layer_shape
from lmcache_ascend.op_surface.arguments import (
    PageBufferShapeDesc,
    at_pointer,
    checked_tensor,
    int_arg,
    is_store,
    pointer_list,
    same_dtype,
    slot_tensor,
)
from lmcache_ascend.op_surface.moves import move, never, slot_row_bytes, strided_regions
from lmcache_ascend.op_surface.runner import OpCall, Plane, run


def _refusal(prefix: str):
    """A layout's way to refuse an argument: a TransferError whose message starts with `prefix`."""
    def refuse(message: str) -> None:
        raise TransferError(prefix + message)

    return refuse


def _tight_strides(shape: tuple[int, ...], block_stride: int) -> tuple[int, ...]:
    """Strides of `shape` with its rows packed and its blocks `block_stride` elements apart."""
    inner = []
    step = 1
    for size in reversed(shape[1:]):
        inner.append(step)
        step *= size
    return (block_stride, *reversed(inner))


def _over_pointers(table: torch.Tensor, facts: FormatFacts, shape_desc: PageBufferShapeDesc, dtype: torch.dtype,
                   device: torch.device, op: str) -> object:
    """The paged cache a pointer table describes: tensors over its addresses, shaped as `facts` says."""
    nb, nl, bs, nh, hs = (int(shape_desc.nb), int(shape_desc.nl), int(shape_desc.bs), int(shape_desc.nh),
                          int(shape_desc.hs))
    what = "paged_buffer_ptrs_tensor"
    if facts.kv_tuple:
        raise TransferError(f"{op}: {what} is a pointer table for {facts.name}; allowed: a list of tuples")
    entries = 1 if facts.cross_layer else 2 * nl if facts.kv_list else nl
    pointers = pointer_list(table, entries, what, op)
    if facts.cross_layer:
        shape = (nb, nl, 2, nh, bs, hs) if facts.hnd else (nb, nl, 2, bs, nh, hs)
        return at_pointer(pointers[0], shape, dtype, device)
    if facts.kv_list:
        shape = (nb * bs, nh, hs) if facts.pbs_fused else (nb, bs, nh, hs)
        tensors = [at_pointer(p, shape, dtype, device) for p in pointers]
        return [tensors[:nl], tensors[nl:]]
    shape = paged_layer_shape(facts, nb, bs, nh, hs)
    stride = int(getattr(shape_desc, "block_stride_elems", 0) or 0)
    strides = None
    if stride and stride != math.prod(shape[1:]):
        if facts.two_major or facts.pbs_fused:
            raise TransferError(
                f"{op}: shape_desc.block_stride_elems={stride} with {facts.name}; allowed: 0 or the tight "
                f"{math.prod(shape[1:])} (its first dim is not the block dim)"
            )
        strides = _tight_strides(shape, stride)
    return [at_pointer(p, shape, dtype, device, strides) for p in pointers]


def _block_planes(paged: object, facts: FormatFacts, shape_desc: PageBufferShapeDesc, dtype: torch.dtype,
                  device: torch.device, op: str) -> list[list[torch.Tensor]]:
    """Per plane the per-layer blocks-first tensors, in chunk order, cut as the format's layout says."""
    what = "paged_buffer_ptrs_tensor"
    if isinstance(paged, torch.Tensor) and paged.dtype in (torch.int64, torch.uint64) and paged.dim() == 1:
        paged = _over_pointers(paged, facts, shape_desc, dtype, device, op)
    if facts.cross_layer:
        paged = checked_tensor(paged, what, op, dims=6)
    elif not facts.kv_list and (not isinstance(paged, (list, tuple)) or not paged):
        raise TransferError(f"{op}: {what} is a {type(paged).__name__}; allowed: a list of per-layer tensors")
    return layout_of(facts).cut_block_planes(paged, facts, _refusal(f"{op}: "))


def _checked_block_arguments(objects: object, direction: object, chunk_size: object, skip: object,
                             shape_desc: PageBufferShapeDesc, op: str) -> tuple[bool, int]:
    """(whether the call stores, the block size): the block op's scalar arguments, checked in the
    order LMCache's baseline reads them."""
    store = is_store(direction, op)
    int_arg(chunk_size, "lmcache_chunk_size", op, 1)
    int_arg(skip, "skip_prefix_n_blocks", op)
    bs = getattr(shape_desc, "bs", None)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0 or chunk_size % bs:
        raise TransferError(
            f"{op}: shape_desc.bs={bs!r} with lmcache_chunk_size={chunk_size}; allowed: a block size > 0 "
            "dividing the chunk size"
        )
    if not isinstance(objects, list):
        raise TransferError(
            f"{op}: lmcache_objects_ptrs is a {type(objects).__name__}; allowed: a list of tensors "
            "or of host addresses"
        )
    return store, bs


@dataclass(eq=False)
class _BlockCall(OpCall):
    """A `multi_layer_block_kv_transfer` call: its arguments, what its checks work out, and the moves it
    is made of: objects moved whole from their first row in one launch when they share a layout and
    a placement the kernel reaches (`batch`: object, bytes, first block, end block), any other
    object on its own (`alone`). LMCache makes it once per request: its launch is made again, and a
    call its repeat refuses (other objects or block ids) leaves its own launch in the repeat's place."""

    op = BLOCK_OP
    reuses_launch = True
    replaces_refused_repeat = True

    paged_buffer_ptrs_tensor: object
    lmcache_objects_ptrs: list
    block_ids: object
    device: object
    direction: object
    shape_desc: PageBufferShapeDesc
    lmcache_chunk_size: int
    engine_kv_format: object
    skip_prefix_n_blocks: int

    @classmethod
    def repeat_key(cls, backend: str, arguments: tuple) -> tuple | None:
        _, objects, block_ids, device, direction, shape_desc, chunk_size, engine_kv_format, skip = arguments
        return _block_repeat_key(backend, objects, block_ids, (device, direction, chunk_size, engine_kv_format, skip),
                                 shape_desc)

    @staticmethod
    def repeat(kept, arguments: tuple) -> bool:
        return kept(arguments[1], arguments[2])  # the objects and the block ids

    def check(self, facts: FormatFacts) -> None:
        self.facts = facts
        self.store, self.bs = _checked_block_arguments(self.lmcache_objects_ptrs, self.direction,
                                                       self.lmcache_chunk_size, self.skip_prefix_n_blocks,
                                                       self.shape_desc, self.op)
        self.dtype = _kv_dtype(self.paged_buffer_ptrs_tensor, self.lmcache_objects_ptrs, self.shape_desc, self.op)
        self.paged_device = torch.device(self.device)

    def planes_key(self) -> tuple:
        desc = self.shape_desc
        return (self.op, self.facts.name, self.dtype, self.paged_device, int(desc.nb), int(desc.nl), desc.bs,
                int(desc.nh), int(desc.hs), int(getattr(desc, "block_stride_elems", 0) or 0))

    def planes(self) -> list[Plane]:
        return _checked_planes(self.paged_buffer_ptrs_tensor, self.facts, self.shape_desc, self.dtype,
                               self.paged_device, self.op)

    def move(self, group: PagedGroup, rows: int, backend: str, repeatable: bool):
        """Move every object; returns the call's repeat (`never` where it has none)."""
        bs, op = self.bs, self.op
        self.group, self.rows, self.backend = group, rows, backend
        self.row_bytes = tuple(plane.row_bytes for plane in group.planes)
        self.objects = _objects(self.lmcache_objects_ptrs, self.facts, self.shape_desc, self.lmcache_chunk_size,
                                self.dtype, group.layer_count, op)
        ids = _block_id_tensor(self.block_ids, bs, rows, op)
        # A repeat reads the ids where the caller put them: only ids given as they are moved (or as a list).
        self.ids_as_given = isinstance(self.block_ids, list) or ids is self.block_ids
        self.ids = ids if ids.device == group.device else ids.to(device=group.device, non_blocking=True)
        self.per_object = self.lmcache_chunk_size // bs
        self.batch, self.batch_shape, self.batch_regions, self.alone = [], None, None, 0
        _move_or_batch(self, self.skip_prefix_n_blocks)
        return _launch_batch(self, repeatable)


def multi_layer_block_kv_transfer(
    paged_buffer_ptrs_tensor: torch.Tensor | list,
    lmcache_objects_ptrs: list[int] | list[torch.Tensor],
    block_ids: torch.Tensor | list[int],
    device: torch.device | str,
    direction: object,
    shape_desc: PageBufferShapeDesc,
    lmcache_chunk_size: int,
    engine_kv_format: object,
    skip_prefix_n_blocks: int,
) -> None:
    """Whole blocks <-> LMCache objects: object i holds blocks [i*B, (i+1)*B) of `block_ids`, B = chunk / bs.

    Objects are [2, NL, T, NH*HS] (split K/V), [NL, T, H] (MLA, fused, single
    K/V) or [NL, T, row] of the planes' bytes side by side (MLA plane tuples);
    the first `skip_prefix_n_blocks` blocks are not moved.
    """
    run(_BlockCall, (paged_buffer_ptrs_tensor, lmcache_objects_ptrs, block_ids, device, direction, shape_desc,
                     lmcache_chunk_size, engine_kv_format, skip_prefix_n_blocks))


def _move_or_batch(call: _BlockCall, skip: int) -> None:
    """Move every object the batch cannot take on its own, and gather the others into the batch."""
    group, bs, per_object = call.group, call.bs, call.per_object
    for index, obj in enumerate(call.objects):
        first = max(index * per_object, skip)
        end = min((index + 1) * per_object, call.ids.numel())
        if first >= end:
            continue
        token_offset = (first - index * per_object) * bs
        shape = (obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_cpu and obj.is_pinned())
        if token_offset == 0 and shape == call.batch_shape:
            # The batch's shape, strides and placement: its layout, checked once.
            call.batch.append((index, obj.view(-1).view(torch.uint8), first, end))
            continue
        what = f"lmcache_objects_ptrs[{index}]"
        offsets, pitch, layer_stride = _object_regions(obj, call.facts, call.row_bytes, group.plane_count,
                                                       group.layer_count, token_offset, what, call.op)
        if token_offset == 0 and call.batch_shape is None and _kernel_reaches(group, obj):
            call.batch_shape, call.batch_regions = shape, (tuple(offsets), tuple(pitch), layer_stride)
            call.batch.append((index, obj.view(-1).view(torch.uint8), first, end))
            continue
        call.alone += 1
        move(group, PlaneSlots(call.ids, first * bs, (end - first) * bs, rows_per_id=bs), obj, offsets, pitch,
             layer_stride, call.store, call.op, what, call.backend)


def _launch_batch(call: _BlockCall, keeping: bool):
    """Move the batch in one launch; returns the call's repeat (`never` where it has none). A repeat
    makes that launch again over other objects and block ids of the same shapes (see "repeated
    calls" in `moves`): only where it moved every object the call reached, on the caches' device."""
    group, bs, batch = call.group, call.bs, call.batch
    if not batch:
        return never
    repeatable = keeping and not call.alone and call.batch_shape[3] == group.device and call.ids_as_given
    offsets, pitch, layer_stride = call.batch_regions
    first_index = batch[0][0]
    if len(batch) == 1:
        index, obj_bytes, first, end = batch[0]
        launch = move(group, PlaneSlots(call.ids, first * bs, (end - first) * bs, rows_per_id=bs), obj_bytes, offsets,
                      pitch, layer_stride, call.store, call.op, f"lmcache_objects_ptrs[{index}]", call.backend,
                      repeatable)
        single = True
    else:
        regions = strided_regions(call.row_bytes, (call.per_object * bs,) * group.plane_count, offsets, pitch,
                                  layer_stride, group.layer_count)
        spans = tuple((first * bs, (end - first) * bs) for _, _, first, end in batch)
        chunks = chunk_buffers([obj_bytes for _, obj_bytes, _, _ in batch])
        resolved = resolve_chunk_batch(call.ids, chunks, _object_rows(group, regions, spans), store=call.store,
                                       rows_per_id=bs)
        transfer_chunk_batches([resolved], backend=call.backend)
        launch = prepare_chunks_relaunch(resolved, backend=call.backend) if repeatable else None
        single = False
    if launch is None or launch is never:
        return never
    alike = SameLayout(call.objects[first_index], len(call.objects))
    return _BlockRepeat(launch, single, alike, first_index, batch[-1][0] + 1, bs, call.rows, group.device)


_SHAPE_DESC_FIELDS = ("nb", "nl", "bs", "nh", "hs", "dtype", "element_size", "block_stride_elems", "kv_size")
_shape_desc_fields = operator.attrgetter(*_SHAPE_DESC_FIELDS)


def _shape_desc_values(shape_desc: object) -> tuple:
    """The fields of `shape_desc` a repeat's key holds, None for one it lacks: one C call where it
    has them all (every call of the op builds its key)."""
    try:
        return _shape_desc_fields(shape_desc)
    except AttributeError:
        return tuple(getattr(shape_desc, field, None) for field in _SHAPE_DESC_FIELDS)


def _block_repeat_key(backend: str, objects: object, block_ids: object, arguments: tuple,
                      shape_desc: object) -> tuple | None:
    """A block call's repeat key (see "repeated calls" in `moves`): its other `arguments` (device, direction,
    chunk size, format, skipped blocks) and `shape_desc`'s fields, and the description of the block ids and
    of the first object (a repeat checks that every object has it)."""
    if not isinstance(objects, list) or not objects or type(objects[0]) is not torch.Tensor:
        return None
    scalars = (*arguments, *_shape_desc_values(shape_desc))
    first = objects[0]
    if isinstance(block_ids, list):
        ids = ("list", len(block_ids))
    elif type(block_ids) is torch.Tensor:
        ids = (block_ids.shape, block_ids.stride(), block_ids.dtype, block_ids.device)
    else:
        return None
    return ("multi_layer_block_kv_transfer", backend, scalars, tuple(map(type, scalars)), ids, len(objects),
            (first.shape, first.stride(), first.dtype, first.device))


def _block_id_tensor(block_ids: object, bs: int, rows: int, op: str) -> torch.Tensor:
    """`block_ids` as an int64 tensor; ids on the host are checked against the cache's blocks."""
    ids = torch.tensor(block_ids, dtype=torch.int64) if isinstance(block_ids, list) else block_ids
    ids = slot_tensor(ids, op, "block_ids")
    if ids.is_cpu and ids.numel():
        smallest, largest = int(ids.min()), int(ids.max())
        if smallest < 0 or (largest + 1) * bs > rows:  # the block's last row must be in the cache too
            raise TransferError(
                f"{op}: block_ids holds {smallest if smallest < 0 else largest}; allowed: 0..{rows // bs - 1}"
            )
    return ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()


class _BlockRepeat:
    """A block call's repeat: the launch that moved its objects [first, end), made again (see
    "repeated calls" in `moves`) when every object has the kept shape, strides, dtype and device (`alike`), and
    block ids given as a list are inside the caches; else the call takes the whole path. `single`: the
    launch is one object's (object address, block id address), else many objects' (addresses,
    block ids: a device tensor, or an array uploaded with the addresses)."""

    __slots__ = ("_launch", "_single", "_alike", "_first", "_end", "_bs", "_rows", "_device")

    def __init__(self, launch, single: bool, alike: SameLayout, first: int, end: int, bs: int, rows: int,
                 device: torch.device):
        self._launch, self._single, self._alike, self._first, self._end = launch, single, alike, first, end
        self._bs, self._rows, self._device = bs, rows, device

    def __call__(self, objects: list, block_ids: object) -> bool:
        if not self._alike(objects):
            return False
        if isinstance(block_ids, list):
            # ids from the host (LMCache's own callers)
            try:
                ids = np.array(block_ids, dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                return False
            if ids.ndim != 1 or (ids.size and (ids.min() < 0 or (int(ids.max()) + 1) * self._bs > self._rows)):
                return False  # the whole path names the bad id
            if self._single:
                ids = to_device(ids, self._device)
        elif block_ids.device == self._device:
            ids = block_ids
        else:
            return False  # ids on the host are checked by the whole path
        if self._single:
            return self._launch(objects[self._first].data_ptr(), ids.data_ptr())
        reached = objects[self._first:self._end]
        return self._launch(np.fromiter(map(torch.Tensor.data_ptr, reached), dtype=np.int64, count=len(reached)), ids)


def _checked_planes(paged: object, facts: FormatFacts, shape_desc: PageBufferShapeDesc, dtype: torch.dtype,
                    device: torch.device, op: str) -> list[Plane]:
    """The block op's paged planes, each plane's every layer checked against the description."""
    bs = shape_desc.bs
    planes = _block_planes(paged, facts, shape_desc, dtype, device, op)
    if len(planes) > MAX_PLANES:
        raise TransferError(
            f"{op}: {facts.name} with these shapes needs {len(planes)} planes (heads x K/V); allowed: at most "
            f"{MAX_PLANES}"
        )
    for index, caches in enumerate(planes):
        for layer, cache in enumerate(caches):
            checked_tensor(cache, f"{op} plane {index} layer {layer}", op)
            if not facts.kv_tuple:
                same_dtype(cache, dtype, f"paged plane {index} layer {layer}", "the KV dtype", op)
            # Blocks-first planes hold [NB, BS, ...]: block ids become slots by shape_desc.bs, so
            # another block size would move rows at shifted offsets.
            if not facts.pbs_fused and (cache.dim() < 2 or cache.shape[1] != bs):
                raise TransferError(
                    f"{op}: shape_desc.bs={bs} but paged plane {index} layer {layer} has shape "
                    f"{tuple(cache.shape)}; allowed: shape_desc.bs={cache.shape[1] if cache.dim() >= 2 else '?'} "
                    "(its blocks' rows)"
                )
    if facts.pbs_fused:  # one row per block: blocks and their tokens are one axis
        return [(caches, 1, math.prod(caches[0].shape[1:]) * caches[0].element_size()) for caches in planes]
    return [(caches, bs, slot_row_bytes(caches[0], bs)) for caches in planes]


def _kernel_reaches(group: PagedGroup, obj: torch.Tensor) -> bool:
    """Whether one launch can address `obj` in place: on the caches' device, or pinned host memory
    a CUDA kernel maps; anything else is staged by `move`."""
    return group.on_group_device(obj) or (group.device.type == "cuda" and obj.is_cpu and obj.is_pinned())


def _object_rows(group: PagedGroup, regions, spans: tuple[tuple[int, int], ...]) -> ChunkRows:
    """The checked rows of a multi-object launch (every plane of object c moves slots
    [start, start + count) of spans[c]); kept on the group per layout and spans, since the
    kernel's device table is keyed on the rows' identity (calls of one length reuse it)."""
    def build() -> ChunkRows:
        starts = [[start] * group.plane_count for start, _ in spans]
        counts = [[count] * group.plane_count for _, count in spans]
        return chunk_rows(group, regions, starts, counts)

    return group.cache("op_surface.object_rows", 64).get_or_build((regions, spans), build)


def _kv_dtype(paged: object, objects: list, shape_desc: PageBufferShapeDesc, op: str) -> torch.dtype:
    """The KV dtype: shape_desc.dtype, else the first paged tensor's, else the first object's, else by width."""
    dtype = getattr(shape_desc, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    first = paged
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, torch.Tensor) and not (first is paged and first.dtype in (torch.int64, torch.uint64)):
        return first.dtype
    if objects and isinstance(objects[0], torch.Tensor):
        return objects[0].dtype
    width = getattr(shape_desc, "element_size", 0)
    by_width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bytes are moved: any dtype
    if width not in by_width:
        raise TransferError(
            f"{op}: cannot tell the KV dtype: shape_desc.dtype is {dtype!r} and shape_desc.element_size="
            f"{width!r}; allowed: a torch.dtype, or an element size of 1, 2, 4 or 8"
        )
    return by_width[width]


def _objects(objects: list, facts: FormatFacts, shape_desc: PageBufferShapeDesc, chunk_size: int,
             dtype: torch.dtype, layers: int, op: str) -> list[torch.Tensor]:
    if not objects or isinstance(objects[0], torch.Tensor):
        for index, obj in enumerate(objects):
            checked_tensor(obj, f"lmcache_objects_ptrs[{index}]", op)
            if not facts.kv_tuple:
                same_dtype(obj, dtype, f"lmcache_objects_ptrs[{index}]", "the paged buffers", op)
        return objects
    if facts.kv_tuple:
        raise TransferError(f"{op}: lmcache_objects_ptrs holds addresses for {facts.name}; allowed: tensors")
    nh, hs = int(shape_desc.nh), int(shape_desc.hs)
    if facts.mla:
        shape = (layers, chunk_size, hs)
    elif facts.single_plane:
        shape = (layers, chunk_size, nh * hs)
    else:
        shape = (2, layers, chunk_size, nh * hs)
    tensors = []
    for index, address in enumerate(objects):
        if isinstance(address, bool) or not isinstance(address, int) or address <= 0:
            raise TransferError(f"{op}: lmcache_objects_ptrs[{index}]={address!r}; allowed: a host address (int > 0)")
        tensors.append(at_pointer(address, shape, dtype, torch.device("cpu")))
    return tensors


def _object_regions(obj: torch.Tensor, facts: FormatFacts, row_bytes: list[int], planes: int, layers: int,
                   token_offset: int, what: str, op: str) -> tuple[list[int], list[int], int]:
    """Plane offsets, row pitches and layer stride (bytes) of one LMCache object, from `token_offset` on."""
    total = obj.numel() * obj.element_size()
    if not obj.is_contiguous():
        raise TransferError(f"{op}: {what} has strides {obj.stride()}; allowed: a contiguous tensor")
    placed = layout_of(facts).block_object_regions
    if placed is not None:
        return placed(obj, row_bytes, layers, token_offset, _refusal(f"{op}: {what} "))
    if facts.hnd:  # per K/V (or the one packed plane) the heads' bytes side by side in a token row
        halves = 1 if facts.fused else 2
        per_half = planes // halves
        token_row = sum(row_bytes[:per_half])
        offsets_in_row = [sum(row_bytes[(p // per_half) * per_half: p]) for p in range(planes)]
    else:  # one plane per K/V half
        halves = planes
        per_half = 1
        token_row = row_bytes[0]
        offsets_in_row = [0] * planes
    if total % (halves * layers * token_row):
        raise TransferError(
            f"{op}: {what} has shape {tuple(obj.shape)} ({total} bytes); allowed: {halves} x {layers} layers x "
            f"T tokens x {token_row} bytes"
        )
    tokens = total // (halves * layers * token_row)
    half_bytes = layers * tokens * token_row
    offsets = [(p // per_half) * half_bytes + token_offset * token_row + offsets_in_row[p] for p in range(planes)]
    return offsets, [token_row] * planes, tokens * token_row
