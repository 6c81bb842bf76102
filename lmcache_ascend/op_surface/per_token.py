"""LMCache's per-token ops: rows at a slot mapping <-> a [planes, L, T, H] buffer.

`multi_layer_kv_transfer` (what LMCache's in-process connector calls per chunk), its unilateral
form, `single_layer_kv_transfer` and the flash layout's scatter and gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmcache_ascend.kernels.paged import PagedGroup
from lmcache_ascend.kernels.resolve import PlaneSlots
from lmcache_ascend.kernels.spec import TransferError
from lmcache_ascend.layouts import MULTI_LAYER_OP, SINGLE_LAYER_OP, UNILATERAL_OP, FormatFacts
from lmcache_ascend.op_surface.arguments import (
    at_pointer,
    checked_tensor,
    device_slots,
    int_arg,
    is_store,
    pointer_list,
    same_dtype,
    slot_tensor,
)
from lmcache_ascend.op_surface.moves import byte_strides, move, repeat_key, transfer_backend
from lmcache_ascend.op_surface.runner import OpCall, Plane, run


def _token_layers(key_value_ptrs: object, layers: int, facts: FormatFacts, dtype: torch.dtype, hidden: int,
                  page_buffer_size: int, block_size: int, block_stride_elems: int, device: torch.device,
                  op: str, per_layer: int = 1) -> list[torch.Tensor]:
    """The paged tensors (one per layer, or per K/V and layer) as given, or built over the pointer table."""
    entries = layers * per_layer
    if isinstance(key_value_ptrs, (list, tuple)):
        if len(key_value_ptrs) != entries:
            raise TransferError(f"{op}: key_value_ptrs has {len(key_value_ptrs)} tensors; allowed: exactly {entries}")
        expected = _listed_layer_shape(facts, per_layer, hidden)
        for index, tensor in enumerate(key_value_ptrs):
            checked_tensor(tensor, f"key_value_ptrs[{index}]", op)
            same_dtype(tensor, dtype, f"key_value_ptrs[{index}]", "key_value", op)
            _check_listed_shape(tensor, expected, f"key_value_ptrs[{index}]", hidden, op)
        return list(key_value_ptrs)
    pointers = pointer_list(key_value_ptrs, entries, "key_value_ptrs", op)
    if per_layer == 2 or facts.mla:
        if block_stride_elems and block_size and block_stride_elems != block_size * hidden:
            nb = page_buffer_size // block_size
            return [at_pointer(p, (nb, block_size, hidden), dtype, device, (block_stride_elems, hidden, 1))
                    for p in pointers]
        return [at_pointer(p, (page_buffer_size, hidden), dtype, device) for p in pointers]
    if facts.two_major:
        if block_stride_elems and block_stride_elems != block_size * hidden:
            raise TransferError(
                f"{op}: block_stride_elems={block_stride_elems} with {facts.name}; allowed: 0 (K/V-major layers "
                "have no block-strided first dim)"
            )
        return [at_pointer(p, (2, page_buffer_size, hidden), dtype, device) for p in pointers]
    nb = page_buffer_size // block_size
    stride = block_stride_elems or 2 * block_size * hidden
    return [at_pointer(p, (nb, 2, block_size, hidden), dtype, device, (stride, block_size * hidden, hidden, 1))
            for p in pointers]


def _listed_layer_shape(facts: FormatFacts, per_layer: int, hidden: int) -> tuple:
    """The shape LMCache's torch baseline indexes a listed paged tensor with, the one it builds over a
    pointer; None: a size it leaves free (slots or blocks, bounded by the slot range check; the block
    size, which `_kv_planes` checks against the `block_size` argument)."""
    if per_layer == 2 or facts.mla:
        return (None, hidden)
    if facts.two_major:
        return (2, None, hidden)
    return (None, 2, None, hidden)


def _check_listed_shape(tensor: torch.Tensor, expected: tuple, what: str, hidden: int, op: str) -> None:
    """A listed paged tensor of another shape is refused, as the baseline refuses it: with another
    row width (key_value's hidden size, its last dim) the rows would be cut at shifted offsets."""
    shape = tensor.shape
    if len(shape) != len(expected) or any(want is not None and got != want for got, want in zip(shape, expected)):
        allowed = ", ".join("*" if want is None else str(want) for want in expected)
        raise TransferError(
            f"{op}: {what} has shape {tuple(shape)}; allowed: [{allowed}] (rows of key_value's hidden size "
            f"{hidden}, its last dim)"
        )


def _check_row_width(tensor: torch.Tensor, what: str, dims: int, head_dims: int, hidden: int, reference: str,
                     op: str) -> None:
    """`tensor` must have `dims` dims whose last `head_dims` hold `hidden` elements (a row of
    `reference`), as the baseline's reshape and indexing need: another width would cut its blocks
    into rows at shifted offsets."""
    if tensor.dim() != dims or math.prod(tensor.shape[dims - head_dims:]) != hidden:
        raise TransferError(
            f"{op}: {what} has shape {tuple(tensor.shape)}; allowed: {dims} dims whose last {head_dims} hold "
            f"{hidden} elements ({reference}'s hidden size, its last dim)"
        )


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


def _planes_of(caches_per_plane: list[list[torch.Tensor]], row_bytes: int, what: str, op: str) -> list[Plane]:
    """Planes of `row_bytes`-byte rows, each's rows per block read from its first layer's shape."""
    return [(caches, _block_size_of(caches[0], row_bytes, what, op), row_bytes) for caches in caches_per_plane]


def _nothing(*addresses: int) -> bool:
    """The repeat of a call that moves nothing (every token skipped)."""
    return True


@dataclass(eq=False)
class _ChunkCall(OpCall):
    """A call of a multi-layer op: key_value [planes, L, T, H] <-> every layer's rows at slot_mapping
    (-1: skipped), over paged layers given as a list of tensors or a pointer table of
    `page_buffer_size` slots each. LMCache makes it once per chunk, shapes unchanged: a later call
    makes the first one's launch again."""

    paged_at = 1  # key_value_ptrs
    reuses_launch = True

    key_value: torch.Tensor
    key_value_ptrs: object
    slot_mapping: torch.Tensor
    paged_memory_device: object
    page_buffer_size: int
    direction: object
    engine_kv_format: object

    @classmethod
    def repeat_key(cls, backend: str, arguments: tuple) -> tuple | None:
        # A repeat takes the addresses of the chunk (key_value) and of the slots; every argument
        # after them must be the kept call's.
        return repeat_key(cls.op, backend, (arguments[0], arguments[2]), arguments[3:])

    @staticmethod
    def repeat(kept, arguments: tuple) -> bool:
        return kept(arguments[0].data_ptr(), arguments[2].data_ptr())

    @property
    def layers(self) -> int:
        return self.key_value.shape[1]

    @property
    def hidden(self) -> int:
        return self.key_value.shape[3]

    def check_chunk(self, facts: FormatFacts) -> None:
        """The arguments both multi-layer ops take alike, in this order: the direction, key_value
        [planes, L, T, H], the slots, page_buffer_size >= 1."""
        op = self.op
        self.facts = facts
        self.store = is_store(self.direction, op)
        checked_tensor(self.key_value, "key_value", op, dims=4)
        slot_tensor(self.slot_mapping, op)
        int_arg(self.page_buffer_size, "page_buffer_size", op, 1)

    def planes_key(self) -> tuple:
        """Every argument the paged tensors are shaped by (LMCache hands the same ones every chunk)."""
        return (self.op, self.facts.name, self.key_value.dtype, self.layers, self.hidden, self.page_buffer_size,
                *self.geometry(), self.device, self.row_bytes())

    def geometry(self) -> tuple:
        """The arguments besides the chunk's that shape the paged tensors."""
        return ()

    def row_bytes(self) -> int:
        return self.hidden * self.key_value.element_size()

    def first_token(self) -> int:
        return 0

    def move(self, group: PagedGroup, rows: int, backend: str, repeatable: bool):
        """key_value <-> the group's rows at slot_mapping, from the first token moved on."""
        op, key_value, slot_mapping = self.op, self.key_value, self.slot_mapping
        tokens = key_value.shape[2]
        if slot_mapping.numel() != tokens:
            raise TransferError(
                f"{op}: slot_mapping has {slot_mapping.numel()} slots but key_value {tuple(key_value.shape)} holds "
                f"{tokens} tokens; allowed: one slot per token"
            )
        slots = device_slots(slot_mapping, group.device, rows, op, "slot_mapping")
        # A repeat reads the caller's slot tensor in place: not where it had to be converted.
        repeatable = repeatable and slots is slot_mapping
        start = self.first_token()
        count = max(tokens - start, 0)
        if count == 0:
            return _nothing if repeatable else None
        strides = byte_strides(key_value, "key_value", op)
        planes = group.plane_count
        return move(group, PlaneSlots(slots, start, count), key_value,
                    [kv * strides[0] + start * strides[2] for kv in range(planes)], [strides[2]] * planes,
                    strides[1], self.store, op, "key_value", backend, repeatable)


@dataclass(eq=False)
class _MultiLayer(_ChunkCall):
    """`multi_layer_kv_transfer`: every layer of one tensor (or, MLA, one latent tensor) per layer."""

    op = MULTI_LAYER_OP

    block_size: int = 0
    head_size: int = 0
    skip_prefix_n_tokens: int = 0
    block_stride_elems: int = 0

    def check(self, facts: FormatFacts) -> None:
        op, block_size, page_buffer_size = self.op, self.block_size, self.page_buffer_size
        self.check_chunk(facts)
        int_arg(block_size, "block_size", op)
        int_arg(self.skip_prefix_n_tokens, "skip_prefix_n_tokens", op)
        int_arg(self.block_stride_elems, "block_stride_elems", op)
        kv_size = 1 if facts.mla else 2
        if self.key_value.shape[0] != kv_size:
            raise TransferError(
                f"{op}: key_value has shape {tuple(self.key_value.shape)} for {facts.name}; allowed: "
                f"[{kv_size}, L, T, H]"
            )
        if not (facts.mla or facts.two_major) and (block_size == 0 or page_buffer_size % block_size):
            raise TransferError(
                f"{op}: block_size={block_size} for {facts.name} with page_buffer_size={page_buffer_size}; "
                "allowed: a block size > 0 dividing page_buffer_size"
            )
        self.device = torch.device(self.paged_memory_device)  # read once every argument checked above holds

    def geometry(self) -> tuple:
        return self.block_size, self.block_stride_elems

    def planes(self) -> list[Plane]:
        tensors = _token_layers(self.key_value_ptrs, self.layers, self.facts, self.key_value.dtype, self.hidden,
                                self.page_buffer_size, self.block_size, self.block_stride_elems, self.device, self.op)
        return _planes_of(_kv_planes(tensors, self.facts, self.block_size, self.op), self.row_bytes(),
                          "key_value_ptrs[0]", self.op)

    def first_token(self) -> int:
        return min(self.skip_prefix_n_tokens, self.key_value.shape[2])


@dataclass(eq=False)
class _Unilateral(_ChunkCall):
    """`multi_layer_kv_transfer_unilateral` (SGLang): separate K and V buffers per layer, [slots, H] each."""

    op = UNILATERAL_OP

    def check(self, facts: FormatFacts) -> tuple[type[_MultiLayer], tuple] | None:
        if facts.mla:  # one latent plane: moved exactly as the multi-layer op moves it
            return _MultiLayer, (self.key_value, self.key_value_ptrs, self.slot_mapping, self.paged_memory_device,
                                 self.page_buffer_size, self.direction, self.engine_kv_format)
        self.check_chunk(facts)
        if self.key_value.shape[0] != 2:
            raise TransferError(f"{self.op}: key_value has shape {tuple(self.key_value.shape)}; allowed: [2, L, T, H]")
        self.device = torch.device(self.paged_memory_device)
        return None

    def planes(self) -> list[Plane]:
        layers = self.layers
        buffers = _token_layers(self.key_value_ptrs, layers, self.facts, self.key_value.dtype, self.hidden,
                                self.page_buffer_size, 0, 0, self.device, self.op, per_layer=2)
        return _planes_of([buffers[:layers], buffers[layers:]], self.row_bytes(), "key_value_ptrs[0]", self.op)


@dataclass(eq=False)
class _SingleLayer(OpCall):
    """`single_layer_kv_transfer`: one layer, LMCache's [T, H] (MLA), [2, T, H] or token-major [T, 2, H]
    <-> vLLM's paged layer, one slot per token."""

    op = SINGLE_LAYER_OP
    paged_at = 1  # vllm_key_value_cache

    lmc_key_value_cache: torch.Tensor
    vllm_key_value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    direction: object
    engine_kv_format: object
    token_major: bool

    def check(self, facts: FormatFacts) -> None:
        op, token_major = self.op, self.token_major
        self.store = is_store(self.direction, op)
        lmc = checked_tensor(self.lmc_key_value_cache, "lmc_key_value_cache", op)
        paged = checked_tensor(self.vllm_key_value_cache, "vllm_key_value_cache", op)
        tokens = slot_tensor(self.slot_mapping, op).numel()
        same_dtype(paged, lmc.dtype, "vllm_key_value_cache", "lmc_key_value_cache", op)
        if facts.mla:
            self.cut = [[paged]]
            if lmc.dim() != 2 or lmc.shape[0] != tokens:
                raise TransferError(f"{op}: lmc_key_value_cache has shape {tuple(lmc.shape)}; allowed: [{tokens}, H]")
            _check_row_width(paged, "vllm_key_value_cache", 3, 1, lmc.shape[1], "lmc_key_value_cache", op)
            self.row_bytes = lmc.shape[1] * lmc.element_size()
            strides = byte_strides(lmc, "lmc_key_value_cache", op)
            self.offsets, self.pitch = [0], strides[0]
            return
        self.cut = _kv_planes([paged], facts, 0, op)
        expected = (tokens, 2, "H") if token_major else (2, tokens, "H")
        if lmc.dim() != 3 or tuple(lmc.shape[:2]) != expected[:2]:
            raise TransferError(
                f"{op}: lmc_key_value_cache has shape {tuple(lmc.shape)}; allowed: "
                f"[{', '.join(str(d) for d in expected)}] (token_major={token_major})"
            )
        _check_row_width(paged, "vllm_key_value_cache", 5, 2, lmc.shape[2], "lmc_key_value_cache", op)
        self.row_bytes = lmc.shape[2] * lmc.element_size()
        strides = byte_strides(lmc, "lmc_key_value_cache", op)
        self.offsets, self.pitch = ([0, strides[1]], strides[0]) if token_major else ([0, strides[0]], strides[1])

    def planes(self) -> list[Plane]:
        return _planes_of(self.cut, self.row_bytes, "vllm_key_value_cache", self.op)

    def move(self, group: PagedGroup, rows: int, backend: None, repeatable: bool) -> None:
        tokens = self.slot_mapping.numel()
        slots = device_slots(self.slot_mapping, group.device, rows, self.op, "slot_mapping")
        if tokens:
            move(group, PlaneSlots(slots, 0, tokens), self.lmc_key_value_cache, self.offsets,
                 [self.pitch] * len(self.offsets), 0, self.store, self.op, "lmc_key_value_cache", transfer_backend())


@dataclass(eq=False)
class _Flash(OpCall):
    """The flash layout's pair: key_value[:, layer_idx] [2, T, H] <-> key/value caches [NB, BS, NH, HS]
    at slot_mapping. Its subclasses say which way."""

    takes_format = False
    store = False  # a gather from the caches into key_value; else a scatter into them

    key_value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    layer_idx: int

    def check(self, facts: None) -> None:
        op, key_value, layer_idx = self.op, self.key_value, self.layer_idx
        checked_tensor(key_value, "key_value", op, dims=4)
        checked_tensor(self.key_cache, "key_cache", op)
        checked_tensor(self.value_cache, "value_cache", op)
        slot_tensor(self.slot_mapping, op)
        int_arg(layer_idx, "layer_idx", op)
        if key_value.shape[0] != 2 or layer_idx >= key_value.shape[1]:
            raise TransferError(
                f"{op}: key_value has shape {tuple(key_value.shape)} with layer_idx={layer_idx}; "
                "allowed: [2, L, T, H] with layer_idx < L"
            )
        tokens, hidden = key_value.shape[2], key_value.shape[3]
        for what, cache in (("key_cache", self.key_cache), ("value_cache", self.value_cache)):
            same_dtype(cache, key_value.dtype, what, "key_value", op)
            _check_row_width(cache, what, 4, 2, hidden, "key_value", op)
        if self.slot_mapping.numel() != tokens:
            raise TransferError(
                f"{op}: slot_mapping has {self.slot_mapping.numel()} slots but key_value holds {tokens} tokens; "
                "allowed: one slot per token"
            )

    def planes(self) -> list[Plane]:
        row = self.key_value.shape[3] * self.key_value.element_size()
        return [([cache], _block_size_of(cache, row, what, self.op), row)
                for what, cache in (("key_cache", self.key_cache), ("value_cache", self.value_cache))]

    def move(self, group: PagedGroup, rows: int, backend: None, repeatable: bool) -> None:
        key_value, op = self.key_value, self.op
        slots = device_slots(self.slot_mapping, group.device, rows, op, "slot_mapping")
        tokens = key_value.shape[2]
        if tokens == 0:
            return
        strides = byte_strides(key_value, "key_value", op)
        base = self.layer_idx * strides[1]
        move(group, PlaneSlots(slots, 0, tokens), key_value, [base, base + strides[0]], [strides[2]] * 2, 0,
             self.store, op, "key_value", transfer_backend())


class _LoadFlash(_Flash):
    op = "load_and_reshape_flash"
    store = True


class _ReshapeFlash(_Flash):
    op = "reshape_and_cache_back_flash"


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
    run(_MultiLayer, (key_value, key_value_ptrs, slot_mapping, paged_memory_device, page_buffer_size, direction,
                      engine_kv_format, block_size, head_size, skip_prefix_n_tokens, block_stride_elems))


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
    run(_Unilateral, (key_value, key_value_ptrs, slot_mapping, paged_memory_device, page_buffer_size, direction,
                      engine_kv_format))


def single_layer_kv_transfer(
    lmc_key_value_cache: torch.Tensor,
    vllm_key_value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    direction: object,
    engine_kv_format: object,
    token_major: bool = False,
) -> None:
    """One layer: LMCache's [T, H] (MLA), [2, T, H] or token-major [T, 2, H] <-> vLLM's paged layer."""
    run(_SingleLayer, (lmc_key_value_cache, vllm_key_value_cache, slot_mapping, direction, engine_kv_format,
                       token_major))


def load_and_reshape_flash(
    key_value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_idx: int,
) -> None:
    """Gather: key_value[:, layer_idx] [2, T, H] <- key/value caches [NB, BS, NH, HS] at slot_mapping."""
    run(_LoadFlash, (key_value, key_cache, value_cache, slot_mapping, layer_idx))


def reshape_and_cache_back_flash(
    key_value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_idx: int,
) -> None:
    """Scatter: key/value caches [NB, BS, NH, HS] at slot_mapping <- key_value[:, layer_idx] [2, T, H]."""
    run(_ReshapeFlash, (key_value, key_cache, value_cache, slot_mapping, layer_idx))
