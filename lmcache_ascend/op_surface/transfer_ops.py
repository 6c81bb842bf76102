"""LMCache's KV-movement ops (0.4.x `c_ops`, 0.5.x `DeviceOps`) on the project's transfer kernel.

Each op takes LMCache's own arguments, checks them on the host (a TransferError
naming the argument, its value and what is allowed), and describes the move as
one `PagedGroup` (the paged planes of every layer) plus one strided chunk layout
(where each (layer, plane) row lies in LMCache's buffer), which `transfer_group`
runs in one launch (Triton on CUDA/NPU, the torch reference elsewhere, or as
LMCACHE_ASCEND_TRANSFER_BACKEND says). Semantics are those of LMCache 0.5.6's
torch baseline (`lmcache/v1/platform/torch_ops/mem_kernels.py`,
`mp_mem_kernels.py`), byte for byte, with these deliberate differences:

* slots < 0 are skipped by every op; the baseline's `load_and_reshape_flash`
  and `reshape_and_cache_back_flash` wrap them (Python indexing: slot -1 reads
  or overwrites the cache's last row);
* a slot or block id past the cache raises (checked on the host when the slot
  tensor is on the CPU, as the baseline's indexing raises); on a device the
  kernel skips it instead of syncing to check;
* MLA plane tuples move whatever the object row's length and plane order; the
  baseline fails on a one-token slice when the row length or a plane's offset in
  it is no multiple of that plane's element size;
* a `block_size` (`shape_desc.bs`) that the paged tensors' blocks do not have
  raises wherever the slot arithmetic uses it, and `key_value` must hold every
  layer of the paged list; the baseline raises on most of these (an index out of
  bounds) but moves rows at shifted offsets, or only the first layers, on others;
* bytes are moved, never values: the chunk and the caches must have one dtype
  (the baseline's `copy_` would convert); non-tight block strides
  (`block_stride_elems`) are honoured where the baseline refuses them.

Nothing here imports LMCache: LMCache imports `lmcache_ascend.ops`.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Sequence

import numpy as np
import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.flags import flag_value
from lmcache_ascend.kernels.ops import (
    prepare_chunks_relaunch,
    prepare_relaunch,
    transfer_chunk_batches,
    transfer_group,
)
from lmcache_ascend.kernels.paged import (
    PagedGroup,
    PagedPlane,
)
from lmcache_ascend.kernels.resolve import (
    ChunkRows,
    PlaneSlots,
    chunk_buffers,
    chunk_rows,
    resolve_chunk_batch,
)
from lmcache_ascend.kernels.spec import (
    MAX_PLANES,
    TransferError,
    strided_chunk_regions,
)
from lmcache_ascend.kernels.upload import to_device
from lmcache_ascend.op_surface.formats import FormatFacts, format_facts, paged_layer_shape

__all__ = [
    "PageBufferShapeDesc",
    "load_and_reshape_flash",
    "multi_layer_block_kv_transfer",
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "reshape_and_cache_back_flash",
    "single_layer_kv_transfer",
]


class PageBufferShapeDesc:
    """One engine page-buffer layout (LMCache's native `PageBufferShapeDesc`, field for field).

    `block_stride_elems` is the per-block step in elements (0: tight); `dtype`
    is LMCache's Python-side hint that tells float16 from bfloat16.
    """

    __slots__ = ("kv_size", "nl", "nb", "bs", "nh", "hs", "element_size", "block_stride_elems", "dtype")

    def __init__(self) -> None:
        self.kv_size = 0
        self.nl = 0
        self.nb = 0
        self.bs = 0
        self.nh = 0
        self.hs = 0
        self.element_size = 0
        self.block_stride_elems = 0
        self.dtype = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"PageBufferShapeDesc({fields})"


# Formats each op supports (LMCache's enum values). The per-token ops follow the
# baseline's three paged shapes: MLA rows, blocks-first K/V, K/V-major.
_MULTI_LAYER_FORMATS = (1, 2, 3, 5)
_UNILATERAL_FORMATS = (3, 4, 5, 9)
_SINGLE_LAYER_FORMATS = (1, 2, 3, 5)
# Block transfer: every format the baseline moves except the RBLN layout (15).
_BLOCK_FORMATS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18)

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


# ---------------------------------------------------------------- argument checks


def _is_store(direction: object, op: str) -> bool:
    """D2H (1, paged -> LMCache) is a store; H2D (0) a load. IntEnum, Enum (0.4.x) or int."""
    raw = getattr(direction, "value", direction)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw not in (0, 1):
        raise TransferError(
            f"{op}: direction={direction!r} is not allowed; allowed: TransferDirection.H2D (0, LMCache -> paged) "
            "or TransferDirection.D2H (1, paged -> LMCache)"
        )
    return raw == 1


def _tensor(value: object, what: str, op: str, dims: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TransferError(f"{op}: {what} is a {type(value).__name__}; allowed: a torch.Tensor")
    if value.layout is not torch.strided or value.is_quantized:
        raise TransferError(f"{op}: {what} has layout {value.layout}; allowed: a plain strided tensor")
    if dims is not None and value.dim() != dims:
        raise TransferError(f"{op}: {what} has shape {tuple(value.shape)}; allowed: {dims} dims")
    return value


def _int_arg(value: object, what: str, op: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransferError(f"{op}: {what}={value!r} is not allowed; allowed: an int >= {minimum}")
    return value


def _slot_tensor(slot_mapping: object, op: str, what: str = "slot_mapping") -> torch.Tensor:
    tensor = _tensor(slot_mapping, what, op, dims=1)
    if tensor.dtype not in _INTEGER_DTYPES:
        raise TransferError(
            f"{op}: {what} has dtype {tensor.dtype}; allowed: an integer dtype (torch.int64, torch.int32, ...)"
        )
    return tensor


def _device_slots(slots: torch.Tensor, device: torch.device, rows: int, op: str, what: str) -> torch.Tensor:
    """`slots` as a contiguous int64 tensor on `device`; slots past `rows` raise if checkable on the host."""
    if slots.is_cpu and slots.numel():
        largest = int(slots.max())
        if largest >= rows:
            raise TransferError(
                f"{op}: {what} holds {largest}, past the paged cache's {rows} slots; "
                f"allowed: 0..{rows - 1}, or < 0 (skipped)"
            )
    if slots.dtype != torch.int64 or slots.device != device or not slots.is_contiguous():
        slots = slots.to(device=device, dtype=torch.int64).contiguous()
    return slots


def _same_dtype(tensor: torch.Tensor, dtype: torch.dtype, what: str, reference: str, op: str) -> None:
    if tensor.dtype != dtype:
        raise TransferError(
            f"{op}: {what} has dtype {tensor.dtype} but {reference} has {dtype}; allowed: the same dtype "
            "(bytes are moved, never converted)"
        )


# ---------------------------------------------------------------- tensors over raw pointers


def _at_pointer(address: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                strides: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor of `shape` (optionally `strides`, elements) over memory at `address` on `device`."""
    if strides is None:
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        strides = tuple(reversed(strides))
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides)) if all(shape) else 0
    if device.index is None and device.type != "cpu":  # storages carry an index ("cuda:0"), tensors must match
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    storage = torch._C._construct_storage_from_data_pointer(address, device, extent * dtype.itemsize)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, strides)


class _TableCache:
    """Values derived from LMCache's description of the paged caches, kept between calls.

    LMCache hands an engine's caches to every call the same way: a pointer table
    (a tensor of layer addresses) or a list of the layer tensors (or of per-layer
    tuples), registered once. What is derived from them (addresses read to the
    host, the checked paged group) is worked out once per description and `key`
    (the arguments that shape it). A table entry holds while the table is alive
    and unwritten (`weakref` and ``_version``); a list entry serves any list of
    the very same tensor objects (or per-layer tuples of them), in order. The bound keeps re-allocated caches from piling
    up (least recently used go first; a list entry keeps its tensors alive).
    """

    def __init__(self, bound: int = 64) -> None:
        self._entries: BoundedCache[tuple[object, object]] = BoundedCache(bound)

    @staticmethod
    def _identity(paged: object, key: tuple) -> tuple[tuple, object]:
        """The entry's key and what it holds: a table's weak reference, or what a list is made of,
        held so that its ids (the key) stay its own. A list of tensors, or of tuples of tensors
        (immutable), is its elements; a list holding lists (whose contents may change under
        the same list) is its leaf tensors, flattened."""
        if isinstance(paged, torch.Tensor):
            return (id(paged), paged._version, key), paged
        elements = tuple(paged)
        tensor = torch.Tensor
        if all(type(entry) is tensor or (type(entry) is tuple and all(type(t) is tensor for t in entry))
               for entry in elements):
            return (tuple(map(id, elements)), key), elements
        leaves = []
        for entry in elements:
            if isinstance(entry, (list, tuple)):
                leaves.extend(entry)
            else:
                leaves.append(entry)
        leaves = tuple(leaves)
        return (tuple(map(id, leaves)), key), leaves

    def lookup(self, paged: object, key: tuple) -> tuple[tuple | None, object | None]:
        """(a handle for `keep`, the value kept for `paged` and `key` or None); the handle is None for
        anything but a table or a list, and for a key holding an argument that cannot be hashed
        (nothing is kept for them: such calls take their whole path)."""
        if not isinstance(paged, (torch.Tensor, list, tuple)):
            return None, None
        if not isinstance(paged, torch.Tensor):
            # As LMCache passes them (the same tensors or per-layer tuples every call), the
            # elements' ids find the entry directly. A hit is exact: the entry holds the objects
            # it was kept for, so no other live object has their ids, and tuples do not change.
            fast = (tuple(map(id, paged)), key)
            try:
                entry = self._entries.get(fast)
            except TypeError:
                return None, None
            if entry is not None:
                return (fast, entry[0]), entry[1]
        full, held = self._identity(paged, key)
        try:
            entry = self._entries.get(full)
        except TypeError:
            return None, None
        if entry is not None and (not isinstance(held, torch.Tensor) or entry[0]() is held):
            return (full, held), entry[1]
        return (full, held), None

    def keep(self, handle: tuple | None, value: object) -> object:
        """Keep `value` under `lookup`'s handle (None: nothing kept); returns it."""
        if handle is not None and value is not None:
            full, held = handle
            self._entries.put(full, (weakref.ref(held) if isinstance(held, torch.Tensor) else held, value))
        return value

    def get_or_build(self, paged: object, key: tuple, build) -> object:
        """The value kept for `paged` and `key`, else `build()`'s, kept (anything but a table or
        a list is built every time)."""
        handle, value = self.lookup(paged, key)
        return self.keep(handle, build()) if value is None else value


_tables = _TableCache()


def _pointer_list(table: object, entries: int, what: str, op: str) -> list[int]:
    if not isinstance(table, torch.Tensor) or table.dim() != 1 or table.dtype not in (torch.int64, torch.uint64):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        dtype = table.dtype if isinstance(table, torch.Tensor) else ""
        raise TransferError(
            f"{op}: {what} is {shape} {dtype}; allowed: a 1-D int64/uint64 tensor of data pointers, or a list of tensors"
        )
    if table.numel() != entries:
        raise TransferError(f"{op}: {what} has {table.numel()} pointers; allowed: exactly {entries}")
    def read() -> list[int]:
        # A read from a device tensor is a synchronizing copy: once per table and content version.
        pointers = [int(p) & (2**64 - 1) for p in table.cpu().tolist()]
        for index, pointer in enumerate(pointers):
            if pointer == 0:
                raise TransferError(f"{op}: {what}[{index}] is a null pointer; allowed: a device address")
        return pointers

    return _tables.get_or_build(table, ("pointers",), read)


# ---------------------------------------------------------------- running one move


def _byte_strides(tensor: torch.Tensor, what: str, op: str) -> tuple[int, ...]:
    """`tensor`'s strides in bytes; its last dim must be contiguous (rows are moved as byte ranges)."""
    if tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise TransferError(f"{op}: {what} has strides {tensor.stride()}; allowed: a contiguous last dim")
    element = tensor.element_size()
    return tuple(stride * element for stride in tensor.stride())


def _byte_span(tensor: torch.Tensor, what: str, op: str) -> torch.Tensor:
    """A flat uint8 view from `tensor`'s first byte to its last (its last dim contiguous)."""
    _byte_strides(tensor, what, op)
    element = tensor.element_size()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    span = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    span.set_(tensor.untyped_storage(), tensor.storage_offset() * element, (extent * element,), (1,))
    return span


# PagedGroups by the address and geometry of their tensors: built (and validated)
# once, so the Triton backend's per-group tables are reused from call to call. A
# group keeps its tensors alive: the bound keeps a re-allocated KV cache from
# pinning many old ones (an engine allocates its caches once).
_groups: BoundedCache[PagedGroup] = BoundedCache(64)


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _group(planes: Sequence[tuple[Sequence[torch.Tensor], int, int]]) -> PagedGroup:
    """The group of these (caches per layer, block size, row bytes) planes."""
    key = tuple((tuple(_tensor_key(t) for t in caches), block_size, row_bytes) for caches, block_size, row_bytes in planes)
    return _groups.get_or_build(key, lambda: PagedGroup(tuple(
        PagedPlane(tuple(caches), block_size, row_bytes, name=f"plane{index}")
        for index, (caches, block_size, row_bytes) in enumerate(planes))))


def _backend() -> str:
    """The user's transfer backend (LMCACHE_ASCEND_TRANSFER_BACKEND), read on every call: cheap, and
    a bad value raises FlagError naming it every time."""
    return flag_value("LMCACHE_ASCEND_TRANSFER_BACKEND")


def _move(group: PagedGroup, slots: PlaneSlots | Sequence[PlaneSlots], chunk: torch.Tensor,
          plane_offsets: Sequence[int], row_pitch: Sequence[int], layer_stride: int, store: bool, op: str,
          what: str, backend: str, repeatable: bool = False):
    """Move the group's rows at `slots` <-> `chunk` (offsets, pitches, stride in bytes from chunk's first byte).

    `repeatable`: also return the move's repeat (`_never` where it has none)."""
    if isinstance(slots, PlaneSlots):
        slots = (slots,) * group.plane_count
    span = _byte_span(chunk, what, op)
    regions = _strided_regions(tuple(plane.row_bytes for plane in group.planes), tuple(s.count for s in slots),
                             tuple(plane_offsets), tuple(row_pitch), layer_stride, group.layer_count)
    if regions.total_bytes > span.numel():
        raise TransferError(
            f"{op}: {what} spans {span.numel()} bytes but the move needs {regions.total_bytes}; "
            f"shape {tuple(chunk.shape)} is too small"
        )
    if group.on_group_device(span):
        transfer_group(group, slots, span, store=store, regions=regions, backend=backend)
        if repeatable:
            return prepare_relaunch(group, slots, span, store=store, regions=regions, backend=backend) or _never
        return None
    # LMCache's buffer lives elsewhere (pinned host memory): stage it on the caches'
    # device. A store stages the old bytes too, so rows it skips keep them.
    staged = span.to(group.device, non_blocking=not store)
    transfer_group(group, slots, staged, store=store, regions=regions, backend=backend)
    if store:
        span.copy_(staged)
    return _never if repeatable else None


# ---------------------------------------------------------------- repeated calls
#
# LMCache calls an op over and over with the same caches and shapes, a chunk at a time: only
# the chunk buffer and the slot (or block id) tensor are new. The first call of a shape runs
# every check and the whole path; where that ended in one direct kernel launch, the launch is
# kept (`kernels.prepare_relaunch`) under a key of everything those checks read: the caches'
# description (as `_tables` identifies it), every other argument's value and type, each
# tensor's shape, strides, dtype and device, and the backend. A later call with that key
# makes the launch again over its own buffers (nothing the checks read differs), unless their
# addresses are aligned otherwise; then, and for any other call, the whole path runs.

_repeats = _TableCache()


def _never(*arguments: object) -> bool:
    """The repeat of a call that has none (the reference backend, a staged buffer, an object moved on
    its own, no direct launch): every call takes the whole path."""
    return False


def _repeat_key(op: str, backend: str, tensors: tuple, scalars: tuple) -> tuple | None:
    """The key of a call's repeat, or None where a call cannot have one (an argument that is not
    a plain tensor where one is expected)."""
    try:
        described = tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors if type(t) is torch.Tensor)
    except RuntimeError:  # a tensor without strides (sparse, ...)
        return None
    if len(described) != len(tensors):
        return None
    return op, backend, scalars, tuple(map(type, scalars)), described


# A call's chunk layout is one of a few (chunk sizes x formats): checked once, then looked up.
_strided_regions = functools.lru_cache(maxsize=256)(strided_chunk_regions)


def _row_bytes(tensor: torch.Tensor, block_size: int) -> int:
    """Bytes per slot of a blocks-first tensor of `block_size` rows per block."""
    return math.prod(tensor.shape[1:]) * tensor.element_size() // block_size


# ---------------------------------------------------------------- per-token ops


def _token_layers(key_value_ptrs: object, layers: int, facts: FormatFacts, dtype: torch.dtype, hidden: int,
                  page_buffer_size: int, block_size: int, block_stride_elems: int, device: torch.device,
                  op: str, per_layer: int = 1) -> list[torch.Tensor]:
    """The paged tensors (one per layer, or per K/V and layer) as given, or built over the pointer table."""
    entries = layers * per_layer
    if isinstance(key_value_ptrs, (list, tuple)):
        if len(key_value_ptrs) != entries:
            raise TransferError(f"{op}: key_value_ptrs has {len(key_value_ptrs)} tensors; allowed: exactly {entries}")
        for index, tensor in enumerate(key_value_ptrs):
            _tensor(tensor, f"key_value_ptrs[{index}]", op)
            _same_dtype(tensor, dtype, f"key_value_ptrs[{index}]", "key_value", op)
        return list(key_value_ptrs)
    pointers = _pointer_list(key_value_ptrs, entries, "key_value_ptrs", op)
    if per_layer == 2 or facts.mla:
        if block_stride_elems and block_size and block_stride_elems != block_size * hidden:
            nb = page_buffer_size // block_size
            return [_at_pointer(p, (nb, block_size, hidden), dtype, device, (block_stride_elems, hidden, 1))
                    for p in pointers]
        return [_at_pointer(p, (page_buffer_size, hidden), dtype, device) for p in pointers]
    if facts.two_major:
        if block_stride_elems and block_stride_elems != block_size * hidden:
            raise TransferError(
                f"{op}: block_stride_elems={block_stride_elems} with {facts.name}; allowed: 0 (K/V-major layers "
                "have no block-strided first dim)"
            )
        return [_at_pointer(p, (2, page_buffer_size, hidden), dtype, device) for p in pointers]
    nb = page_buffer_size // block_size
    stride = block_stride_elems or 2 * block_size * hidden
    return [_at_pointer(p, (nb, 2, block_size, hidden), dtype, device, (stride, block_size * hidden, hidden, 1))
            for p in pointers]


def _kv_planes(layers: list[torch.Tensor], facts: FormatFacts, block_size: int, op: str) -> list[list[torch.Tensor]]:
    """Per plane (MLA: one; else K and V) the per-layer blocks-first tensors; a `block_size` the
    [NB, 2, BS, ...] layers do not have is refused."""
    if facts.mla:
        return [layers]
    if facts.two_major:
        for index, layer in enumerate(layers):
            if layer.dim() < 2 or layer.shape[0] != 2:
                raise TransferError(f"{op}: key_value_ptrs[{index}] has shape {tuple(layer.shape)}; allowed: [2, ...]")
        return [[layer[kv] for layer in layers] for kv in range(2)]
    for index, layer in enumerate(layers):
        if layer.dim() < 3 or layer.shape[1] != 2:
            raise TransferError(
                f"{op}: key_value_ptrs[{index}] has shape {tuple(layer.shape)}; allowed: [NB, 2, BS, ...]"
            )
        if block_size and layer.shape[2] != block_size:
            # Slots are split into (block, offset) by block_size (0: the op takes the tensor's own):
            # another size would move rows at shifted offsets.
            raise TransferError(
                f"{op}: block_size={block_size} but key_value_ptrs[{index}] has shape {tuple(layer.shape)} "
                f"(blocks of {layer.shape[2]} rows); allowed: block_size={layer.shape[2]}"
            )
    return [[layer[:, kv] for layer in layers] for kv in range(2)]


def _block_size_of(tensor: torch.Tensor, row_bytes: int, what: str, op: str) -> int:
    block_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    if tensor.dim() < 2 or block_bytes % row_bytes:
        raise TransferError(
            f"{op}: {what} has shape {tuple(tensor.shape)} ({tensor.dtype}); allowed: blocks first, "
            f"each a whole number of {row_bytes}-byte rows"
        )
    return block_bytes // row_bytes


def _token_group(op: str, key_value_ptrs: object, key: tuple, planes) -> tuple[PagedGroup, int]:
    """The group of a token op's paged planes (`planes()` builds them) and its slot count: built once
    per description of the caches and `key`, the arguments that shape the tensors (`_TableCache`)."""
    def build() -> tuple[PagedGroup, int]:
        row = key[-1]
        group = _group([(caches, _block_size_of(caches[0], row, "key_value_ptrs[0]", op), row) for caches in planes()])
        return group, min(geometry.num_blocks * plane.block_size
                          for per_layer in group.geometry for geometry, plane in zip(per_layer, group.planes))

    return _tables.get_or_build(key_value_ptrs, key, build)


def _token_move(op: str, key_value: torch.Tensor, group: PagedGroup, rows: int, slot_mapping: torch.Tensor,
                store: bool, start: int, backend: str, repeatable: bool = False):
    """key_value [planes, L, T, H] <-> the group's rows at slot_mapping[start:] (tokens from `start`);
    `repeatable`: returns the move's repeat (see `_move`)."""
    tokens = key_value.shape[2]
    if slot_mapping.numel() != tokens:
        raise TransferError(
            f"{op}: slot_mapping has {slot_mapping.numel()} slots but key_value {tuple(key_value.shape)} holds "
            f"{tokens} tokens; allowed: one slot per token"
        )
    slots = _device_slots(slot_mapping, group.device, rows, op, "slot_mapping")
    # A repeat reads the caller's slot tensor in place: not where it had to be converted.
    repeatable = repeatable and slots is slot_mapping
    count = max(tokens - start, 0)
    if count == 0:
        return _nothing if repeatable else None
    strides = _byte_strides(key_value, "key_value", op)
    planes = group.plane_count
    return _move(group, PlaneSlots(slots, start, count), key_value,
                 [kv * strides[0] + start * strides[2] for kv in range(planes)], [strides[2]] * planes,
                 strides[1], store, op, "key_value", backend, repeatable)


def _nothing(*addresses: int) -> bool:
    """The repeat of a call that moves nothing (every token skipped)."""
    return True


def _repeated(op: str, paged: object, tensors: tuple, scalars: tuple) -> tuple[bool, tuple | None, str]:
    """(whether the repeat kept for this call ran it, the handle to keep one under after the whole
    path (None: keep none), the backend). `tensors` start with the chunk buffer and the slot (or
    block id) tensor, whose addresses a repeat takes."""
    backend = _backend()
    key = _repeat_key(op, backend, tensors, scalars)
    if key is None:
        return False, None, backend
    handle, repeat = _repeats.lookup(paged, key)
    if repeat is None:
        return False, handle, backend
    # A kept repeat that refuses these addresses leaves the whole path to the call, and stays.
    return repeat(tensors[0].data_ptr(), tensors[1].data_ptr()), None, backend


def multi_layer_kv_transfer(
    key_value: torch.Tensor,
    key_value_ptrs: torch.Tensor | list[torch.Tensor],
    slot_mapping: torch.Tensor,
    paged_memory_device: torch.device,
    page_buffer_size: int,
    direction: object,
    engine_kv_format: object,
    block_size: int = 0,
    head_size: int = 0,
    skip_prefix_n_tokens: int = 0,
    block_stride_elems: int = 0,
) -> None:
    """key_value [2 (MLA: 1), L, T, H] <-> every layer's paged rows at slot_mapping (-1: skipped).

    Tokens before `skip_prefix_n_tokens` are not moved. The paged layers are a
    list of tensors or a pointer table over `page_buffer_size` slots.
    """
    op = "multi_layer_kv_transfer"
    ran, handle, backend = _repeated(op, key_value_ptrs, (key_value, slot_mapping), (
        paged_memory_device, page_buffer_size, direction, engine_kv_format, block_size, head_size,
        skip_prefix_n_tokens, block_stride_elems))
    if ran:
        return
    facts = format_facts(engine_kv_format, op, _MULTI_LAYER_FORMATS)
    store = _is_store(direction, op)
    key_value = _tensor(key_value, "key_value", op, dims=4)
    slot_mapping = _slot_tensor(slot_mapping, op)
    _int_arg(page_buffer_size, "page_buffer_size", op, 1)
    _int_arg(block_size, "block_size", op)
    _int_arg(skip_prefix_n_tokens, "skip_prefix_n_tokens", op)
    _int_arg(block_stride_elems, "block_stride_elems", op)
    kv_size = 1 if facts.mla else 2
    if key_value.shape[0] != kv_size:
        raise TransferError(
            f"{op}: key_value has shape {tuple(key_value.shape)} for {facts.name}; allowed: [{kv_size}, L, T, H]"
        )
    if not (facts.mla or facts.two_major) and (block_size == 0 or page_buffer_size % block_size):
        raise TransferError(
            f"{op}: block_size={block_size} for {facts.name} with page_buffer_size={page_buffer_size}; "
            "allowed: a block size > 0 dividing page_buffer_size"
        )
    layers, hidden, device = key_value.shape[1], key_value.shape[3], torch.device(paged_memory_device)

    def planes() -> list[list[torch.Tensor]]:
        tensors = _token_layers(key_value_ptrs, layers, facts, key_value.dtype, hidden, page_buffer_size, block_size,
                                block_stride_elems, device, op)
        return _kv_planes(tensors, facts, block_size, op)

    key = (op, facts.name, key_value.dtype, layers, hidden, page_buffer_size, block_size, block_stride_elems, device,
           hidden * key_value.element_size())
    group, rows = _token_group(op, key_value_ptrs, key, planes)
    repeat = _token_move(op, key_value, group, rows, slot_mapping, store, min(skip_prefix_n_tokens, key_value.shape[2]),
                         backend, repeatable=handle is not None)
    _repeats.keep(handle, repeat)


def multi_layer_kv_transfer_unilateral(
    key_value: torch.Tensor,
    key_value_ptrs: torch.Tensor | list[torch.Tensor],
    slot_mapping: torch.Tensor,
    paged_memory_device: torch.device,
    page_buffer_size: int,
    direction: object,
    engine_kv_format: object,
) -> None:
    """SGLang: key_value [2, L, T, H] <-> separate K and V buffers per layer ([K_0.., V_0..], each [slots, H]).

    MLA formats move one latent plane exactly as `multi_layer_kv_transfer`.
    """
    op = "multi_layer_kv_transfer_unilateral"
    ran, handle, backend = _repeated(op, key_value_ptrs, (key_value, slot_mapping),
                                     (paged_memory_device, page_buffer_size, direction, engine_kv_format))
    if ran:
        return
    facts = format_facts(engine_kv_format, op, _UNILATERAL_FORMATS)
    if facts.mla:
        multi_layer_kv_transfer(key_value, key_value_ptrs, slot_mapping, paged_memory_device, page_buffer_size,
                                direction, engine_kv_format)
        return
    store = _is_store(direction, op)
    key_value = _tensor(key_value, "key_value", op, dims=4)
    slot_mapping = _slot_tensor(slot_mapping, op)
    _int_arg(page_buffer_size, "page_buffer_size", op, 1)
    if key_value.shape[0] != 2:
        raise TransferError(f"{op}: key_value has shape {tuple(key_value.shape)}; allowed: [2, L, T, H]")
    layers, hidden, device = key_value.shape[1], key_value.shape[3], torch.device(paged_memory_device)

    def planes() -> list[list[torch.Tensor]]:
        buffers = _token_layers(key_value_ptrs, layers, facts, key_value.dtype, hidden, page_buffer_size, 0, 0,
                                device, op, per_layer=2)
        return [buffers[:layers], buffers[layers:]]

    key = (op, facts.name, key_value.dtype, layers, hidden, page_buffer_size, device, hidden * key_value.element_size())
    group, rows = _token_group(op, key_value_ptrs, key, planes)
    _repeats.keep(handle, _token_move(op, key_value, group, rows, slot_mapping, store, 0, backend,
                                      repeatable=handle is not None))


def single_layer_kv_transfer(
    lmc_key_value_cache: torch.Tensor,
    vllm_key_value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    direction: object,
    engine_kv_format: object,
    token_major: bool = False,
) -> None:
    """One layer: LMCache's [T, H] (MLA), [2, T, H] or token-major [T, 2, H] <-> vLLM's paged layer."""
    op = "single_layer_kv_transfer"
    facts = format_facts(engine_kv_format, op, _SINGLE_LAYER_FORMATS)
    store = _is_store(direction, op)
    lmc = _tensor(lmc_key_value_cache, "lmc_key_value_cache", op)
    paged = _tensor(vllm_key_value_cache, "vllm_key_value_cache", op)
    slot_mapping = _slot_tensor(slot_mapping, op)
    _same_dtype(paged, lmc.dtype, "vllm_key_value_cache", "lmc_key_value_cache", op)
    tokens = slot_mapping.numel()
    if facts.mla:
        expected = (tokens, None)
        planes = [[paged]]
        if lmc.dim() != 2 or lmc.shape[0] != tokens:
            raise TransferError(f"{op}: lmc_key_value_cache has shape {tuple(lmc.shape)}; allowed: [{tokens}, H]")
        hidden_bytes = lmc.shape[1] * lmc.element_size()
        strides = _byte_strides(lmc, "lmc_key_value_cache", op)
        offsets, pitch = [0], strides[0]
    else:
        planes = _kv_planes([paged], facts, 0, op)
        expected = (tokens, 2, "H") if token_major else (2, tokens, "H")
        if lmc.dim() != 3 or tuple(lmc.shape[:2]) != expected[:2]:
            raise TransferError(
                f"{op}: lmc_key_value_cache has shape {tuple(lmc.shape)}; allowed: "
                f"[{', '.join(str(d) for d in expected)}] (token_major={token_major})"
            )
        hidden_bytes = lmc.shape[2] * lmc.element_size()
        strides = _byte_strides(lmc, "lmc_key_value_cache", op)
        if token_major:
            offsets, pitch = [0, strides[1]], strides[0]
        else:
            offsets, pitch = [0, strides[0]], strides[1]
    group = _group([(caches, _block_size_of(caches[0], hidden_bytes, "vllm_key_value_cache", op), hidden_bytes)
                    for caches in planes])
    rows = group.geometry[0][0].num_blocks * group.planes[0].block_size
    slots = _device_slots(slot_mapping, group.device, rows, op, "slot_mapping")
    if tokens:
        _move(group, PlaneSlots(slots, 0, tokens), lmc, offsets, [pitch] * len(offsets), 0, store, op,
              "lmc_key_value_cache", _backend())


def _flash(op: str, key_value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           slot_mapping: torch.Tensor, layer_idx: int, store: bool) -> None:
    key_value = _tensor(key_value, "key_value", op, dims=4)
    key_cache = _tensor(key_cache, "key_cache", op)
    value_cache = _tensor(value_cache, "value_cache", op)
    slot_mapping = _slot_tensor(slot_mapping, op)
    _int_arg(layer_idx, "layer_idx", op)
    if key_value.shape[0] != 2 or layer_idx >= key_value.shape[1]:
        raise TransferError(
            f"{op}: key_value has shape {tuple(key_value.shape)} with layer_idx={layer_idx}; "
            "allowed: [2, L, T, H] with layer_idx < L"
        )
    for what, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _same_dtype(cache, key_value.dtype, what, "key_value", op)
    tokens, hidden = key_value.shape[2], key_value.shape[3]
    if slot_mapping.numel() != tokens:
        raise TransferError(
            f"{op}: slot_mapping has {slot_mapping.numel()} slots but key_value holds {tokens} tokens; "
            "allowed: one slot per token"
        )
    row = hidden * key_value.element_size()
    group = _group([([cache], _block_size_of(cache, row, what, op), row)
                    for what, cache in (("key_cache", key_cache), ("value_cache", value_cache))])
    rows = min(group.geometry[0][p].num_blocks * group.planes[p].block_size for p in range(2))
    slots = _device_slots(slot_mapping, group.device, rows, op, "slot_mapping")
    if tokens == 0:
        return
    strides = _byte_strides(key_value, "key_value", op)
    base = layer_idx * strides[1]
    _move(group, PlaneSlots(slots, 0, tokens), key_value, [base, base + strides[0]], [strides[2]] * 2, 0, store,
          op, "key_value", _backend())


def load_and_reshape_flash(
    key_value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_idx: int,
) -> None:
    """Gather: key_value[:, layer_idx] [2, T, H] <- key/value caches [NB, BS, NH, HS] at slot_mapping."""
    _flash("load_and_reshape_flash", key_value, key_cache, value_cache, slot_mapping, layer_idx, store=True)


def reshape_and_cache_back_flash(
    key_value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_idx: int,
) -> None:
    """Scatter: key/value caches [NB, BS, NH, HS] at slot_mapping <- key_value[:, layer_idx] [2, T, H]."""
    _flash("reshape_and_cache_back_flash", key_value, key_cache, value_cache, slot_mapping, layer_idx, store=False)


# ---------------------------------------------------------------- block transfer (multi-process mode)


def _block_planes(paged: object, facts: FormatFacts, shape_desc: PageBufferShapeDesc, dtype: torch.dtype,
                  device: torch.device, op: str) -> list[list[torch.Tensor]]:
    """Per plane the per-layer blocks-first tensors, in chunk order (K planes, then V planes)."""
    nb, nl, bs, nh, hs = (int(shape_desc.nb), int(shape_desc.nl), int(shape_desc.bs), int(shape_desc.nh),
                          int(shape_desc.hs))
    what = "paged_buffer_ptrs_tensor"
    if isinstance(paged, torch.Tensor) and paged.dtype in (torch.int64, torch.uint64) and paged.dim() == 1:
        if facts.kv_tuple:
            raise TransferError(f"{op}: {what} is a pointer table for {facts.name}; allowed: a list of tuples")
        entries = 1 if facts.cross_layer else 2 * nl if facts.kv_list else nl
        pointers = _pointer_list(paged, entries, what, op)
        if facts.cross_layer:
            shape = (nb, nl, 2, nh, bs, hs) if facts.hnd else (nb, nl, 2, bs, nh, hs)
            paged = _at_pointer(pointers[0], shape, dtype, device)
        elif facts.kv_list:
            shape = (nb * bs, nh, hs) if facts.pbs_fused else (nb, bs, nh, hs)
            tensors = [_at_pointer(p, shape, dtype, device) for p in pointers]
            paged = [tensors[:nl], tensors[nl:]]
        else:
            shape = paged_layer_shape(facts, nb, bs, nh, hs)
            stride = int(getattr(shape_desc, "block_stride_elems", 0) or 0)
            strides = None
            if stride and stride != math.prod(shape[1:]):
                if facts.two_major or facts.pbs_fused:
                    raise TransferError(
                        f"{op}: shape_desc.block_stride_elems={stride} with {facts.name}; allowed: 0 or the tight "
                        f"{math.prod(shape[1:])} (its first dim is not the block dim)"
                    )
                strides = [stride]
                step = 1
                inner = []
                for size in reversed(shape[1:]):
                    inner.append(step)
                    step *= size
                strides = tuple(strides + list(reversed(inner)))
            paged = [_at_pointer(p, shape, dtype, device, strides) for p in pointers]
    if facts.cross_layer:
        tensor = _tensor(paged, what, op, dims=6)
        if facts.hnd:
            return [[tensor[:, layer, kv, head] for layer in range(tensor.shape[1])]
                    for kv in range(2) for head in range(tensor.shape[3])]
        return [[tensor[:, layer, kv] for layer in range(tensor.shape[1])] for kv in range(2)]
    if facts.kv_list:
        if not isinstance(paged, (list, tuple)):
            raise TransferError(f"{op}: {what} is a {type(paged).__name__}; allowed: [[K layers], [V layers]]")
        if len(paged) != 2 or not all(isinstance(side, (list, tuple)) for side in paged):
            if len(paged) % 2 or not all(isinstance(t, torch.Tensor) for t in paged):
                raise TransferError(f"{op}: {what} has {len(paged)} entries; allowed: [[K layers], [V layers]] "
                                    "or a flat list of 2 x NL tensors")
            paged = [list(paged[: len(paged) // 2]), list(paged[len(paged) // 2:])]
        return [list(paged[0]), list(paged[1])]
    if not isinstance(paged, (list, tuple)) or not paged:
        raise TransferError(f"{op}: {what} is a {type(paged).__name__}; allowed: a list of per-layer tensors")
    if facts.kv_tuple:
        counts = {len(entry) if isinstance(entry, (list, tuple)) else -1 for entry in paged}
        if len(counts) != 1 or -1 in counts or (not facts.mla and counts != {2}):
            raise TransferError(
                f"{op}: {what} for {facts.name} must be a list of per-layer "
                f"{'plane tuples of one length' if facts.mla else '(K, V) tuples'}; got lengths {sorted(counts)}"
            )
        return [[entry[plane] for entry in paged] for plane in range(counts.pop())]
    if facts.mla or facts.single_kv:
        return [list(paged)]
    if facts.fused:
        # [NB, BS, NH, 2, HS] splits flatten back to one packed row per token.
        layers = [layer.reshape(*layer.shape[:3], -1) if layer.dim() == 5 else layer for layer in paged]
        if facts.hnd:
            return [[layer[:, head] for layer in layers] for head in range(layers[0].shape[1])]
        return [layers]
    if facts.two_major:
        halves = [[layer[kv] for layer in paged] for kv in range(2)]
    else:
        halves = [[layer[:, kv] for layer in paged] for kv in range(2)]
    if facts.hnd:  # [NB, NH, BS, HS] per K/V: one plane per head
        return [[layer[:, head] for layer in half] for half in halves for head in range(half[0].shape[1])]
    return halves


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
    op = "multi_layer_block_kv_transfer"
    backend = _backend()
    key = _block_repeat_key(backend, lmcache_objects_ptrs, block_ids, (
        device, direction, lmcache_chunk_size, engine_kv_format, skip_prefix_n_blocks,
        *(getattr(shape_desc, field, None) for field in _SHAPE_DESC_FIELDS)))
    handle, repeat = _repeats.lookup(paged_buffer_ptrs_tensor, key) if key is not None else (None, None)
    if repeat is not None and repeat(lmcache_objects_ptrs, block_ids):
        return
    facts = format_facts(engine_kv_format, op, _BLOCK_FORMATS)
    store = _is_store(direction, op)
    _int_arg(lmcache_chunk_size, "lmcache_chunk_size", op, 1)
    _int_arg(skip_prefix_n_blocks, "skip_prefix_n_blocks", op)
    bs = getattr(shape_desc, "bs", None)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0 or lmcache_chunk_size % bs:
        raise TransferError(
            f"{op}: shape_desc.bs={bs!r} with lmcache_chunk_size={lmcache_chunk_size}; allowed: a block size > 0 "
            "dividing the chunk size"
        )
    if not isinstance(lmcache_objects_ptrs, list):
        raise TransferError(
            f"{op}: lmcache_objects_ptrs is a {type(lmcache_objects_ptrs).__name__}; allowed: a list of tensors "
            "or of host addresses"
        )
    dtype = _kv_dtype(paged_buffer_ptrs_tensor, lmcache_objects_ptrs, shape_desc, op)
    device = torch.device(device)
    group, rows, row_bytes = _block_group(paged_buffer_ptrs_tensor, facts, shape_desc, dtype, device, op)
    layers, plane_count = group.layer_count, group.plane_count

    objects = _objects(lmcache_objects_ptrs, facts, shape_desc, lmcache_chunk_size, dtype, layers, op)
    ids = _block_id_tensor(block_ids, bs, rows, op)
    # A repeat reads the ids where the caller put them: only ids given as they are moved (or as a list).
    ids_as_given = isinstance(block_ids, list) or ids is block_ids
    if ids.device != group.device:
        ids = ids.to(device=group.device, non_blocking=True)
    per_object = lmcache_chunk_size // bs
    # Objects moved whole from their first row go in one launch when they share a layout and a
    # placement the kernel reaches; an object the skipped prefix cuts into, or one that differs,
    # is moved on its own.
    batch: list[tuple[int, torch.Tensor, int, int]] = []  # (object, bytes, first block, end block)
    batch_regions = batch_shape = None
    alone = 0  # objects moved on their own
    for index, obj in enumerate(objects):
        first = max(index * per_object, skip_prefix_n_blocks)
        end = min((index + 1) * per_object, ids.numel())
        if first >= end:
            continue
        token_offset = (first - index * per_object) * bs
        shape = (obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_cpu and obj.is_pinned())
        if token_offset == 0 and shape == batch_shape:
            # The batch's shape, strides and placement: its layout, checked once.
            batch.append((index, obj.view(-1).view(torch.uint8), first, end))
            continue
        what = f"lmcache_objects_ptrs[{index}]"
        offsets, pitch, layer_stride = _object_regions(obj, facts, row_bytes, plane_count, layers, token_offset, what, op)
        if token_offset == 0 and batch_shape is None and _kernel_reaches(group, obj):
            batch_shape, batch_regions = shape, (tuple(offsets), tuple(pitch), layer_stride)
            batch.append((index, obj.view(-1).view(torch.uint8), first, end))
            continue
        alone += 1
        _move(group, PlaneSlots(ids, first * bs, (end - first) * bs, rows_per_id=bs), obj, offsets, pitch,
              layer_stride, store, op, what, backend)
    # A repeat makes the call's one launch again over other objects and block ids of the same shapes
    # (see "repeated calls"): where that launch moved every object it reached, on the caches' device.
    repeatable = (handle is not None and not alone and bool(batch) and batch_shape[3] == group.device
                  and ids_as_given)
    if len(batch) == 1:
        index, obj_bytes, first, end = batch[0]
        offsets, pitch, layer_stride = batch_regions
        launch = _move(group, PlaneSlots(ids, first * bs, (end - first) * bs, rows_per_id=bs), obj_bytes, offsets,
                       pitch, layer_stride, store, op, f"lmcache_objects_ptrs[{index}]", backend, repeatable)
        if launch is not None and launch is not _never:
            _repeats.keep(handle, _BlockRepeat(launch, True, batch_shape[:4], index, index + 1, bs, rows, group.device))
            return
    elif batch:
        offsets, pitch, layer_stride = batch_regions
        regions = _strided_regions(row_bytes, (per_object * bs,) * plane_count, offsets, pitch, layer_stride, layers)
        spans = tuple((first * bs, (end - first) * bs) for _, _, first, end in batch)
        chunks = chunk_buffers([obj_bytes for _, obj_bytes, _, _ in batch])
        resolved = resolve_chunk_batch(ids, chunks, _object_rows(group, regions, spans), store=store, rows_per_id=bs)
        transfer_chunk_batches([resolved], backend=backend)
        launch = prepare_chunks_relaunch(resolved, backend=backend) if repeatable else None
        if launch is not None:
            _repeats.keep(handle, _BlockRepeat(launch, False, batch_shape[:4], batch[0][0], batch[-1][0] + 1, bs, rows,
                                               group.device))
            return
    _repeats.keep(handle, _never)


_SHAPE_DESC_FIELDS = ("nb", "nl", "bs", "nh", "hs", "dtype", "element_size", "block_stride_elems", "kv_size")


def _block_repeat_key(backend: str, objects: object, block_ids: object, scalars: tuple) -> tuple | None:
    """A block call's repeat key (see "repeated calls"): the arguments, and the description of the
    block ids and of the first object (a repeat checks that every object has it)."""
    if not isinstance(objects, list) or not objects or type(objects[0]) is not torch.Tensor:
        return None
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
    ids = _slot_tensor(ids, op, "block_ids")
    if ids.is_cpu and ids.numel():
        smallest, largest = int(ids.min()), int(ids.max())
        if smallest < 0 or (largest + 1) * bs > rows:  # the block's last row must be in the cache too
            raise TransferError(
                f"{op}: block_ids holds {smallest if smallest < 0 else largest}; allowed: 0..{rows // bs - 1}"
            )
    return ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()


class _BlockRepeat:
    """A block call's repeat: the launch that moved its objects [first, end), made again (see
    "repeated calls") when every object has the kept shape, strides, dtype and device, and block
    ids given as a list are inside the caches; else the call takes the whole path. `single`: the
    launch is one object's (object address, block id address), else many objects' (addresses,
    block ids: a device tensor, or an array uploaded with the addresses)."""

    __slots__ = ("_launch", "_single", "_described", "_first", "_end", "_bs", "_rows", "_device")

    def __init__(self, launch, single: bool, described: tuple, first: int, end: int, bs: int, rows: int,
                 device: torch.device):
        self._launch, self._single, self._described, self._first, self._end = launch, single, described, first, end
        self._bs, self._rows, self._device = bs, rows, device

    def __call__(self, objects: list, block_ids: object) -> bool:
        described, tensor = self._described, torch.Tensor
        for obj in objects:
            if type(obj) is not tensor or (obj.shape, obj.stride(), obj.dtype, obj.device) != described:
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
        return self._launch(np.fromiter(map(tensor.data_ptr, reached), dtype=np.int64, count=len(reached)), ids)


def _block_group(paged: object, facts: FormatFacts, shape_desc: PageBufferShapeDesc, dtype: torch.dtype,
                 device: torch.device, op: str) -> tuple[PagedGroup, int, tuple[int, ...]]:
    """The group of the block op's paged planes, its slot count and the planes' row bytes: built
    and checked once per description of the caches and geometry (`_TableCache`)."""
    key = (op, facts.name, dtype, device, int(shape_desc.nb), int(shape_desc.nl), shape_desc.bs, int(shape_desc.nh),
           int(shape_desc.hs), int(getattr(shape_desc, "block_stride_elems", 0) or 0))
    return _tables.get_or_build(paged, key, lambda: _build_block_group(paged, facts, shape_desc, dtype, device, op))


def _build_block_group(paged: object, facts: FormatFacts, shape_desc: PageBufferShapeDesc, dtype: torch.dtype,
                       device: torch.device, op: str) -> tuple[PagedGroup, int, tuple[int, ...]]:
    bs = shape_desc.bs
    planes = _block_planes(paged, facts, shape_desc, dtype, device, op)
    if len(planes) > MAX_PLANES:
        raise TransferError(
            f"{op}: {facts.name} with these shapes needs {len(planes)} planes (heads x K/V); allowed: at most "
            f"{MAX_PLANES}"
        )
    for index, caches in enumerate(planes):
        for layer, cache in enumerate(caches):
            _tensor(cache, f"{op} plane {index} layer {layer}", op)
            if not facts.kv_tuple:
                _same_dtype(cache, dtype, f"paged plane {index} layer {layer}", "the KV dtype", op)
            # Blocks-first planes hold [NB, BS, ...]: block ids become slots by shape_desc.bs, so
            # another block size would move rows at shifted offsets.
            if not facts.pbs_fused and (cache.dim() < 2 or cache.shape[1] != bs):
                raise TransferError(
                    f"{op}: shape_desc.bs={bs} but paged plane {index} layer {layer} has shape "
                    f"{tuple(cache.shape)}; allowed: shape_desc.bs={cache.shape[1] if cache.dim() >= 2 else '?'} "
                    "(its blocks' rows)"
                )
    row_bytes = tuple(_row_bytes(caches[0], bs) if not facts.pbs_fused else
                      math.prod(caches[0].shape[1:]) * caches[0].element_size() for caches in planes)
    group = _group([(caches, 1 if facts.pbs_fused else bs, rb) for caches, rb in zip(planes, row_bytes)])
    rows = min(geometry.num_blocks * plane.block_size
               for per_layer in group.geometry for geometry, plane in zip(per_layer, group.planes))
    return group, rows, row_bytes


def _kernel_reaches(group: PagedGroup, obj: torch.Tensor) -> bool:
    """Whether one launch can address `obj` in place: on the caches' device, or pinned host memory
    a CUDA kernel maps; anything else is staged by `_move`."""
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
            _tensor(obj, f"lmcache_objects_ptrs[{index}]", op)
            if not facts.kv_tuple:
                _same_dtype(obj, dtype, f"lmcache_objects_ptrs[{index}]", "the paged buffers", op)
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
        tensors.append(_at_pointer(address, shape, dtype, torch.device("cpu")))
    return tensors


def _object_regions(obj: torch.Tensor, facts: FormatFacts, row_bytes: list[int], planes: int, layers: int,
                   token_offset: int, what: str, op: str) -> tuple[list[int], list[int], int]:
    """Plane offsets, row pitches and layer stride (bytes) of one LMCache object, from `token_offset` on."""
    total = obj.numel() * obj.element_size()
    if not obj.is_contiguous():
        raise TransferError(f"{op}: {what} has strides {obj.stride()}; allowed: a contiguous tensor")
    if facts.kv_tuple and facts.mla:  # [NL, T, row]: the planes' bytes side by side in each token row
        token_row = obj.shape[-1] * obj.element_size() if obj.dim() == 3 else sum(row_bytes)
        if sum(row_bytes) > token_row:
            raise TransferError(f"{op}: {what} rows hold {token_row} bytes; the planes need {sum(row_bytes)}")
        offsets = [token_offset * token_row + sum(row_bytes[:p]) for p in range(planes)]
        return offsets, [token_row] * planes, total // layers
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
