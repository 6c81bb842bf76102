"""What each dim of a registered KV-cache tensor is, as its attention backend documents it.

vLLM hands the worker one tensor per layer whose meaning depends on the attention
backend that allocated it: the same 4-dim shape is ``[num_blocks, block_size,
heads, head_size]`` for one backend and ``[num_blocks, heads, block_size,
2 * head_size]`` for another.  Guessing from the number of dims moves the wrong
bytes, so a layer is only accepted with a `BackendDims`, built from the
backend's own description (see `lmcache_ascend.connector.attention_backends`; the roles
and the backends' K/V packing are the layouts', `lmcache_ascend.layouts`), and
turned here into planes of the transfer kernels: per plane, blocks of
`block_size` contiguous rows of `row_bytes`, blocks `block_stride_bytes` apart.

- token-major caches (rows of all heads side by side) are one plane per K / V;
- head-major caches (per block, per head, the block's token rows) are one plane
  per head (and per K / V), each addressed at its head's offset;
- vLLM's CPU backend keeps, per block and head, every token's K row and then every
  token's V row inside a ``[block_size, 2 * head_size]`` interior
  (`PackedKV.ROWS_PER_BLOCK_HEAD`): that interior is re-read as ``[2, block_size,
  head_size]``, so a token's K and V are the rows it really owns.

Pure logic: torch only, no vLLM / LMCache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from lmcache_ascend.kv_worker.errors import KVCacheShapeError
from lmcache_ascend.layouts import DimRole, PackedKV, packed_kv_by_backend

__all__ = [
    "BackendDims",
    "DescribedPlane",
    "DimRole",
    "PackedKV",
    "PACKED_KV_BY_BACKEND",
    "ShapeProbe",
    "UNREADABLE_BY_BACKEND",
    "cell_dims",
    "described_planes",
    "dims_from_probe",
]


# Backends whose cache packs K and V together, by `get_name()`, and how: each layout names the
# backends only it explains. A packing backend missing here is refused: its rows cannot be
# told apart without reading it.
PACKED_KV_BY_BACKEND: Mapping[str, PackedKV] = packed_kv_by_backend()

# Backends whose kernels re-read the cache in a way its shape and spec do not show,
# so that a token's bytes cannot be located exactly: refused, with the reason.
UNREADABLE_BY_BACKEND: Mapping[str, str] = {
    "ROCM_ATTN": (
        "its kernels re-read each block's K and V regions through PagedAttention.split_kv_cache as an "
        "x-packed key [heads, head_size / x, block_size, x] (x = 16 bytes of elements) and a value "
        "[heads, head_size, block_size] (interleaved when AITER's fused rope + cache write is on, a run-time "
        "switch): a token's bytes are scattered inside its block, which get_kv_cache_shape and the spec "
        "do not describe and lmcache-ascend does not read yet"
    ),
    "TURBOQUANT": (
        "each (token, head) slot packs quantized K and V whose size depends on the TurboQuant preset, and on "
        "vLLM >= 0.32 its store kernels may instead write a per-block data region followed by a metadata region "
        "(norms, scales), chosen at run time and visible in neither the shape nor the spec: a token's bytes "
        "cannot be located exactly"
    ),
}


@dataclass(frozen=True)
class BackendDims:
    """Role of each dim of a registered tensor (logical order), as its backend documents it."""

    backend: str
    dims: tuple[DimRole, ...]
    packed_kv: PackedKV = PackedKV.NONE
    # The backend's declared physical order (outermost first, indices into `dims`);
    # the registered tensor's strides are checked against it.  None: not declared.
    stride_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        dims = tuple(self.dims)
        object.__setattr__(self, "dims", dims)
        counts = {role: dims.count(role) for role in DimRole}
        problems = []
        if counts[DimRole.BLOCK] != 1 or counts[DimRole.TOKEN] != 1:
            problems.append("exactly one block dim and one token dim")
        if counts[DimRole.HEAD] > 1 or counts[DimRole.KV] > 1:
            problems.append("at most one head dim and one K/V dim")
        if self.packed_kv is not PackedKV.NONE and (counts[DimRole.KV] or counts[DimRole.CONTENT] != 1):
            problems.append("packed K/V content needs one content dim and no separate K/V dim")
        if self.stride_order is not None and sorted(self.stride_order) != list(range(len(dims))):
            problems.append(f"a stride order that permutes 0..{len(dims) - 1} (got {self.stride_order})")
        if problems:
            roles = [role.value for role in dims]
            raise KVCacheShapeError(f"backend {self.backend!r}: layout {roles} is not valid; it needs " + "; ".join(problems))

    def describe(self) -> str:
        text = "[" + ", ".join(role.value for role in self.dims) + "]"
        if self.packed_kv is not PackedKV.NONE:
            text += f" with K/V packed {self.packed_kv.value}"
        return text


@dataclass(frozen=True)
class ShapeProbe:
    """Distinct sizes handed to a backend's `get_kv_cache_shape` to learn what each dim is.

    Chosen so that no size, nor 2 * head_size, equals another (nor 1 or 2), and
    block_size is a multiple of 16 and 32 as block-size checks of backends ask.
    """

    num_blocks: int = 13
    block_size: int = 64
    num_kv_heads: int = 3
    head_size: int = 80


def _refuse_unreadable(backend: str) -> None:
    reason = UNREADABLE_BY_BACKEND.get(backend)
    if reason is not None:
        raise KVCacheShapeError(f"backend {backend!r} is refused: {reason}")


def _cell_packing(backend: str, what: str) -> PackedKV:
    """How `backend` splits K and V inside the content dim; KVCacheShapeError if that is not known."""
    packed = PACKED_KV_BY_BACKEND.get(backend)
    if packed not in (PackedKV.PER_CELL, PackedKV.ROWS_PER_BLOCK_HEAD):
        known = sorted(name for name, rule in PACKED_KV_BY_BACKEND.items() if rule is not PackedKV.KV_HEAD_SLOTS)
        raise KVCacheShapeError(f"backend {backend!r}: {what}; how it splits them is known for {known} only")
    return packed


def dims_from_probe(
    backend: str,
    probed_shape: Sequence[int],
    probe: ShapeProbe,
    stride_order: Sequence[int] | None = None,
    head_size_v: int | None = None,
) -> BackendDims:
    """The layout a backend documents through the shape it returned for `probe`.

    A dim of 2 * head_size, or head_size + `head_size_v` where the backend declares
    a V head size of its own (FLASH_ATTN_DIFFKV), packs K and V in one dim: accepted
    only for a backend of `PACKED_KV_BY_BACKEND`; a size matching nothing is refused.
    """
    _refuse_unreadable(backend)
    sizes = {
        probe.num_blocks: DimRole.BLOCK,
        probe.block_size: DimRole.TOKEN,
        probe.num_kv_heads: DimRole.HEAD,
        2: DimRole.KV,
        probe.head_size: DimRole.CONTENT,
        1: DimRole.CONTENT,  # a singleton (MLA's one latent "head") is moved with its content
    }
    packed_sizes = {2 * probe.head_size}
    if head_size_v:
        packed_sizes.add(probe.head_size + head_size_v)
    dims = []
    packed = PackedKV.NONE
    for size in probed_shape:
        role = sizes.get(int(size))
        if role is None and int(size) in packed_sizes:
            packed = _cell_packing(
                backend,
                f"get_kv_cache_shape{_probe_call(probe)} = {tuple(probed_shape)} packs K and V in one dim of "
                f"{int(size)} (head_size + V head size)",
            )
            role = DimRole.CONTENT
        if role is None:
            raise KVCacheShapeError(
                f"backend {backend!r}: get_kv_cache_shape{_probe_call(probe)} = {tuple(probed_shape)} has a dim of "
                f"size {size} that is none of num_blocks, block_size, num_kv_heads, 2 (K/V), head_size, "
                "head_size + V head size or 1"
            )
        dims.append(role)
    return BackendDims(backend, tuple(dims), packed, None if stride_order is None else tuple(stride_order))


def _probe_call(probe: ShapeProbe) -> str:
    return (
        f"(num_blocks={probe.num_blocks}, block_size={probe.block_size}, "
        f"num_kv_heads={probe.num_kv_heads}, head_size={probe.head_size})"
    )


def cell_dims(backend: str, packs_kv: bool, head_slots: int | None = None) -> BackendDims:
    """vLLM >= 0.32: every per-layer view is logical [blocks, head slots, tokens, cell content].

    (`vllm.v1.kv_cache_interface.create_kv_cache_views`; the physical order is the
    resolved `KVCacheLayout` and shows in the view's strides.)  From the layer's
    spec, after the backend's `customize_spec`: `head_slots` is its
    `num_head_slots` (None: one slot per KV head), `packs_kv` whether a cell holds K
    and V (attention specs with head_size_v).  Whatever is not one KV head per slot
    needs the backend's split to be known (`PACKED_KV_BY_BACKEND`).
    """
    _refuse_unreadable(backend)
    if head_slots is not None:
        if head_slots != 2 or PACKED_KV_BY_BACKEND.get(backend) is not PackedKV.KV_HEAD_SLOTS:
            known = sorted(name for name, rule in PACKED_KV_BY_BACKEND.items() if rule is PackedKV.KV_HEAD_SLOTS)
            raise KVCacheShapeError(
                f"backend {backend!r}: its spec publishes {head_slots} head slots per block instead of one per KV "
                f"head; what each slot holds is known for {known} (2 slots: K, V) only"
            )
        return BackendDims(backend, (DimRole.BLOCK, DimRole.KV, DimRole.TOKEN, DimRole.CONTENT))
    packed = PackedKV.NONE
    if packs_kv:
        packed = _cell_packing(backend, "its KV-cache cells pack K and V")
    return BackendDims(backend, (DimRole.BLOCK, DimRole.HEAD, DimRole.TOKEN, DimRole.CONTENT), packed)


@dataclass(frozen=True)
class DescribedPlane:
    """One plane of a described layer: `num_blocks` blocks of `block_size` contiguous rows."""

    head: int | None  # the KV head it holds, when heads are split into planes
    kv: int | None  # 0 (K) or 1 (V), when K and V are split into planes
    blocks: torch.Tensor  # uint8 [num_blocks, block_size, row_bytes] over the tensor's storage
    block_stride_bytes: int

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def row_bytes(self) -> int:
        return int(self.blocks.shape[2])


def _where(layer_name: str, tensor: torch.Tensor, backend_dims: BackendDims) -> str:
    return (
        f"layer {layer_name!r} (shape {tuple(tensor.shape)}, strides {tensor.stride()}, dtype {tensor.dtype}, "
        f"backend {backend_dims.backend!r}, layout {backend_dims.describe()})"
    )


def _unpack_rows_per_block_head(
    where: str, shape: list[int], strides: list[int], roles: list[DimRole]
) -> tuple[list[int], list[int], list[DimRole]]:
    """Re-read [.., TOKEN, CONTENT ..] of 2 * head_size as [.., KV, TOKEN, CONTENT ..] of head_size."""
    token, content = roles.index(DimRole.TOKEN), roles.index(DimRole.CONTENT)
    block_size, width = shape[token], shape[content]
    if strides[content] != 1 or strides[token] != width or width % 2:
        raise KVCacheShapeError(
            f"{where}: K/V rows per block and head need a contiguous [block_size, 2 * head_size] interior "
            f"(token stride == content size, content stride 1, even content)"
        )
    half = width // 2
    shape = shape[:token] + [2, block_size] + shape[token + 1 :]
    strides = strides[:token] + [block_size * half, half] + strides[token + 1 :]
    roles = roles[:token] + [DimRole.KV, DimRole.TOKEN] + roles[token + 1 :]
    content = roles.index(DimRole.CONTENT)
    shape[content] = half
    return shape, strides, roles


def _check_stride_order(where: str, tensor: torch.Tensor, backend_dims: BackendDims) -> None:
    if backend_dims.stride_order is None:
        return
    physical = [dim for dim in backend_dims.stride_order if tensor.shape[dim] > 1]
    strides = [tensor.stride(dim) for dim in physical]
    if any(outer < inner for outer, inner in zip(strides, strides[1:])):
        raise KVCacheShapeError(
            f"{where}: the strides disagree with the backend's stride order {backend_dims.stride_order} "
            "(outermost first); the cache was not allocated the way the backend declares"
        )


def described_planes(layer_name: str, tensor: torch.Tensor, backend_dims: BackendDims) -> tuple[DescribedPlane, ...]:
    """The planes of `tensor` read with `layout`; KVCacheShapeError for anything the kernels cannot address."""
    where = _where(layer_name, tensor, backend_dims)
    if not isinstance(tensor, torch.Tensor):
        raise KVCacheShapeError(f"layer {layer_name!r}: a {type(tensor).__name__} is not a KV-cache tensor")
    if tensor.ndim != len(backend_dims.dims):
        raise KVCacheShapeError(f"{where}: {tensor.ndim} dims, but the backend documents {len(backend_dims.dims)}")
    if tensor.dtype.is_complex or tensor.layout is not torch.strided:
        raise KVCacheShapeError(f"{where}: allowed: a plain strided real or integer tensor")
    _check_stride_order(where, tensor, backend_dims)
    shape, strides, roles = list(tensor.shape), list(tensor.stride()), list(backend_dims.dims)
    if backend_dims.packed_kv is PackedKV.ROWS_PER_BLOCK_HEAD:
        shape, strides, roles = _unpack_rows_per_block_head(where, shape, strides, roles)
    block, token = roles.index(DimRole.BLOCK), roles.index(DimRole.TOKEN)
    if shape[block] <= 0 or shape[token] <= 0:
        raise KVCacheShapeError(f"{where}: num_blocks and block_size must be > 0")
    # Heads and K/V physically outside the token row become planes; everything
    # inside it (content, and heads or K/V stored per token) is the row.
    split = [d for d, role in enumerate(roles) if role in (DimRole.HEAD, DimRole.KV) and shape[d] > 1
             and strides[d] > strides[token]]
    row_dims = sorted(
        (d for d in range(len(roles)) if d not in split and d not in (block, token) and shape[d] > 1),
        key=lambda d: -strides[d],
    )
    expected = 1
    for d in reversed(row_dims):
        if strides[d] != expected:
            raise KVCacheShapeError(
                f"{where}: the bytes of one token row are not contiguous (dim {d}, a {roles[d].value} dim, has "
                f"stride {strides[d]}, expected {expected}); the transfer kernels move contiguous rows"
            )
        expected *= shape[d]
    row_elements = expected
    if shape[token] > 1 and strides[token] != row_elements:
        raise KVCacheShapeError(
            f"{where}: token rows of a block are not back to back (token stride {strides[token]}, "
            f"row {row_elements} elements)"
        )
    item = tensor.element_size()
    row_bytes = row_elements * item
    block_stride = strides[block] * item if shape[block] > 1 else shape[token] * row_bytes
    if block_stride < shape[token] * row_bytes:
        raise KVCacheShapeError(f"{where}: blocks overlap (block stride {block_stride} B < {shape[token] * row_bytes} B)")
    head = next((d for d in split if roles[d] is DimRole.HEAD), None)
    kv = next((d for d in split if roles[d] is DimRole.KV), None)
    base = tensor.storage_offset() * item
    storage = tensor.untyped_storage()
    planes = []
    for h in range(shape[head]) if head is not None else (None,):
        for k in range(shape[kv]) if kv is not None else (None,):
            offset = base + (h or 0) * (strides[head] * item if head is not None else 0)
            offset += (k or 0) * (strides[kv] * item if kv is not None else 0)
            view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            view.set_(storage, offset, (shape[block], shape[token], row_bytes), (block_stride, row_bytes, 1))
            planes.append(DescribedPlane(h, k, view, block_stride))
    return tuple(planes)
