"""LMCache's per-token ops: rows at a slot mapping <-> a [planes, L, T, H] buffer.

`multi_layer_kv_transfer` (what LMCache's in-process connector calls per chunk), its unilateral
form, `single_layer_kv_transfer` and the flash layout's scatter and gather.
"""

from __future__ import annotations

import math

import torch

from lmcache_ascend.kernels.paged import PagedGroup
from lmcache_ascend.kernels.resolve import PlaneSlots
from lmcache_ascend.kernels.spec import TransferError
from lmcache_ascend.op_surface.arguments import (
    at_pointer,
    checked_tensor,
    device_slots,
    int_arg,
    is_store,
    pointer_list,
    same_dtype,
    slot_tensor,
    tables,
)
from lmcache_ascend.layouts import FormatFacts
from lmcache_ascend.op_surface.formats import format_facts
from lmcache_ascend.op_surface.moves import byte_strides, move, paged_group, repeat_key, repeats, transfer_backend


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


def _token_group(op: str, key_value_ptrs: object, key: tuple, planes) -> tuple[PagedGroup, int]:
    """The group of a token op's paged planes (`planes()` builds them) and its slot count: built once
    per description of the caches and `key`, the arguments that shape the tensors (`_TableCache`)."""
    def build() -> tuple[PagedGroup, int]:
        row = key[-1]
        group = paged_group([(caches, _block_size_of(caches[0], row, "key_value_ptrs[0]", op), row) for caches in planes()])
        return group, min(geometry.num_blocks * plane.block_size
                          for per_layer in group.geometry for geometry, plane in zip(per_layer, group.planes))

    return tables.get_or_build(key_value_ptrs, key, build)


def _token_move(op: str, key_value: torch.Tensor, group: PagedGroup, rows: int, slot_mapping: torch.Tensor,
                store: bool, start: int, backend: str, repeatable: bool = False):
    """key_value [planes, L, T, H] <-> the group's rows at slot_mapping[start:] (tokens from `start`);
    `repeatable`: returns the move's repeat (see `move`)."""
    tokens = key_value.shape[2]
    if slot_mapping.numel() != tokens:
        raise TransferError(
            f"{op}: slot_mapping has {slot_mapping.numel()} slots but key_value {tuple(key_value.shape)} holds "
            f"{tokens} tokens; allowed: one slot per token"
        )
    slots = device_slots(slot_mapping, group.device, rows, op, "slot_mapping")
    # A repeat reads the caller's slot tensor in place: not where it had to be converted.
    repeatable = repeatable and slots is slot_mapping
    count = max(tokens - start, 0)
    if count == 0:
        return _nothing if repeatable else None
    strides = byte_strides(key_value, "key_value", op)
    planes = group.plane_count
    return move(group, PlaneSlots(slots, start, count), key_value,
                 [kv * strides[0] + start * strides[2] for kv in range(planes)], [strides[2]] * planes,
                 strides[1], store, op, "key_value", backend, repeatable)


def _nothing(*addresses: int) -> bool:
    """The repeat of a call that moves nothing (every token skipped)."""
    return True


def _repeated(op: str, paged: object, tensors: tuple, scalars: tuple) -> tuple[bool, tuple | None, str]:
    """(whether the repeat kept for this call ran it, the handle to keep one under after the whole
    path (None: keep none), the backend). `tensors` start with the chunk buffer and the slot (or
    block id) tensor, whose addresses a repeat takes."""
    backend = transfer_backend()
    key = repeat_key(op, backend, tensors, scalars)
    if key is None:
        return False, None, backend
    handle, repeat = repeats.lookup(paged, key)
    if repeat is None:
        return False, handle, backend
    # A kept repeat that refuses these addresses leaves the whole path to the call, and stays.
    return repeat(tensors[0].data_ptr(), tensors[1].data_ptr()), None, backend


def _multi_layer_arguments(op: str, direction: object, key_value: object, slot_mapping: object,
                           page_buffer_size: object) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """The arguments both multi-layer ops take alike, checked in this order: (whether the call
    stores, key_value [planes, L, T, H], the slot tensor); page_buffer_size must be >= 1."""
    store = is_store(direction, op)
    key_value = checked_tensor(key_value, "key_value", op, dims=4)
    slot_mapping = slot_tensor(slot_mapping, op)
    int_arg(page_buffer_size, "page_buffer_size", op, 1)
    return store, key_value, slot_mapping


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
    facts = format_facts(engine_kv_format, op)
    store, key_value, slot_mapping = _multi_layer_arguments(op, direction, key_value, slot_mapping, page_buffer_size)
    int_arg(block_size, "block_size", op)
    int_arg(skip_prefix_n_tokens, "skip_prefix_n_tokens", op)
    int_arg(block_stride_elems, "block_stride_elems", op)
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
    repeats.keep(handle, repeat)


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
    facts = format_facts(engine_kv_format, op)
    if facts.mla:
        multi_layer_kv_transfer(key_value, key_value_ptrs, slot_mapping, paged_memory_device, page_buffer_size,
                                direction, engine_kv_format)
        return
    store, key_value, slot_mapping = _multi_layer_arguments(op, direction, key_value, slot_mapping, page_buffer_size)
    if key_value.shape[0] != 2:
        raise TransferError(f"{op}: key_value has shape {tuple(key_value.shape)}; allowed: [2, L, T, H]")
    layers, hidden, device = key_value.shape[1], key_value.shape[3], torch.device(paged_memory_device)

    def planes() -> list[list[torch.Tensor]]:
        buffers = _token_layers(key_value_ptrs, layers, facts, key_value.dtype, hidden, page_buffer_size, 0, 0,
                                device, op, per_layer=2)
        return [buffers[:layers], buffers[layers:]]

    key = (op, facts.name, key_value.dtype, layers, hidden, page_buffer_size, device, hidden * key_value.element_size())
    group, rows = _token_group(op, key_value_ptrs, key, planes)
    repeats.keep(handle, _token_move(op, key_value, group, rows, slot_mapping, store, 0, backend,
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
    facts = format_facts(engine_kv_format, op)
    store = is_store(direction, op)
    lmc = checked_tensor(lmc_key_value_cache, "lmc_key_value_cache", op)
    paged = checked_tensor(vllm_key_value_cache, "vllm_key_value_cache", op)
    slot_mapping = slot_tensor(slot_mapping, op)
    same_dtype(paged, lmc.dtype, "vllm_key_value_cache", "lmc_key_value_cache", op)
    tokens = slot_mapping.numel()
    if facts.mla:
        expected = (tokens, None)
        planes = [[paged]]
        if lmc.dim() != 2 or lmc.shape[0] != tokens:
            raise TransferError(f"{op}: lmc_key_value_cache has shape {tuple(lmc.shape)}; allowed: [{tokens}, H]")
        _check_row_width(paged, "vllm_key_value_cache", 3, 1, lmc.shape[1], "lmc_key_value_cache", op)
        hidden_bytes = lmc.shape[1] * lmc.element_size()
        strides = byte_strides(lmc, "lmc_key_value_cache", op)
        offsets, pitch = [0], strides[0]
    else:
        planes = _kv_planes([paged], facts, 0, op)
        expected = (tokens, 2, "H") if token_major else (2, tokens, "H")
        if lmc.dim() != 3 or tuple(lmc.shape[:2]) != expected[:2]:
            raise TransferError(
                f"{op}: lmc_key_value_cache has shape {tuple(lmc.shape)}; allowed: "
                f"[{', '.join(str(d) for d in expected)}] (token_major={token_major})"
            )
        _check_row_width(paged, "vllm_key_value_cache", 5, 2, lmc.shape[2], "lmc_key_value_cache", op)
        hidden_bytes = lmc.shape[2] * lmc.element_size()
        strides = byte_strides(lmc, "lmc_key_value_cache", op)
        if token_major:
            offsets, pitch = [0, strides[1]], strides[0]
        else:
            offsets, pitch = [0, strides[0]], strides[1]
    group = paged_group([(caches, _block_size_of(caches[0], hidden_bytes, "vllm_key_value_cache", op), hidden_bytes)
                    for caches in planes])
    rows = group.geometry[0][0].num_blocks * group.planes[0].block_size
    slots = device_slots(slot_mapping, group.device, rows, op, "slot_mapping")
    if tokens:
        move(group, PlaneSlots(slots, 0, tokens), lmc, offsets, [pitch] * len(offsets), 0, store, op,
              "lmc_key_value_cache", transfer_backend())


def _flash(op: str, key_value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           slot_mapping: torch.Tensor, layer_idx: int, store: bool) -> None:
    key_value = checked_tensor(key_value, "key_value", op, dims=4)
    key_cache = checked_tensor(key_cache, "key_cache", op)
    value_cache = checked_tensor(value_cache, "value_cache", op)
    slot_mapping = slot_tensor(slot_mapping, op)
    int_arg(layer_idx, "layer_idx", op)
    if key_value.shape[0] != 2 or layer_idx >= key_value.shape[1]:
        raise TransferError(
            f"{op}: key_value has shape {tuple(key_value.shape)} with layer_idx={layer_idx}; "
            "allowed: [2, L, T, H] with layer_idx < L"
        )
    tokens, hidden = key_value.shape[2], key_value.shape[3]
    for what, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        same_dtype(cache, key_value.dtype, what, "key_value", op)
        _check_row_width(cache, what, 4, 2, hidden, "key_value", op)
    if slot_mapping.numel() != tokens:
        raise TransferError(
            f"{op}: slot_mapping has {slot_mapping.numel()} slots but key_value holds {tokens} tokens; "
            "allowed: one slot per token"
        )
    row = hidden * key_value.element_size()
    group = paged_group([([cache], _block_size_of(cache, row, what, op), row)
                    for what, cache in (("key_cache", key_cache), ("value_cache", value_cache))])
    rows = min(group.geometry[0][p].num_blocks * group.planes[p].block_size for p in range(2))
    slots = device_slots(slot_mapping, group.device, rows, op, "slot_mapping")
    if tokens == 0:
        return
    strides = byte_strides(key_value, "key_value", op)
    base = layer_idx * strides[1]
    move(group, PlaneSlots(slots, 0, tokens), key_value, [base, base + strides[0]], [strides[2]] * 2, 0, store,
          op, "key_value", transfer_backend())


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
