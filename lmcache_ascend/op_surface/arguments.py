"""LMCache's op arguments checked and read: the paged caches' description kept between calls.

Every check raises a TransferError naming the op, the argument, its value and what is allowed.
LMCache hands an engine's caches to every call the same way (a pointer table or a list of the
layer tensors): what is derived from them is worked out once per description (`TableCache`).
"""

from __future__ import annotations

import weakref

import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.kernels.spec import TransferError


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


_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


# ---------------------------------------------------------------- argument checks


def is_store(direction: object, op: str) -> bool:
    """D2H (1, paged -> LMCache) is a store; H2D (0) a load. IntEnum, Enum (0.4.x) or int."""
    raw = getattr(direction, "value", direction)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw not in (0, 1):
        raise TransferError(
            f"{op}: direction={direction!r} is not allowed; allowed: TransferDirection.H2D (0, LMCache -> paged) "
            "or TransferDirection.D2H (1, paged -> LMCache)"
        )
    return raw == 1


def checked_tensor(value: object, what: str, op: str, dims: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TransferError(f"{op}: {what} is a {type(value).__name__}; allowed: a torch.Tensor")
    if value.layout is not torch.strided or value.is_quantized:
        raise TransferError(f"{op}: {what} has layout {value.layout}; allowed: a plain strided tensor")
    if dims is not None and value.dim() != dims:
        raise TransferError(f"{op}: {what} has shape {tuple(value.shape)}; allowed: {dims} dims")
    return value


def int_arg(value: object, what: str, op: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransferError(f"{op}: {what}={value!r} is not allowed; allowed: an int >= {minimum}")
    return value


def slot_tensor(slot_mapping: object, op: str, what: str = "slot_mapping") -> torch.Tensor:
    tensor = checked_tensor(slot_mapping, what, op, dims=1)
    if tensor.dtype not in _INTEGER_DTYPES:
        raise TransferError(
            f"{op}: {what} has dtype {tensor.dtype}; allowed: an integer dtype (torch.int64, torch.int32, ...)"
        )
    return tensor


def device_slots(slots: torch.Tensor, device: torch.device, rows: int, op: str, what: str) -> torch.Tensor:
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


def same_dtype(tensor: torch.Tensor, dtype: torch.dtype, what: str, reference: str, op: str) -> None:
    if tensor.dtype != dtype:
        raise TransferError(
            f"{op}: {what} has dtype {tensor.dtype} but {reference} has {dtype}; allowed: the same dtype "
            "(bytes are moved, never converted)"
        )


# ---------------------------------------------------------------- tensors over raw pointers


def at_pointer(address: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
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


class TableCache:
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


tables = TableCache()


def pointer_list(table: object, entries: int, what: str, op: str) -> list[int]:
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

    return tables.get_or_build(table, ("pointers",), read)
