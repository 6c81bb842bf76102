"""KV layouts: one module per layout, each the one place that says how it is laid out and moved.

A layout (a K/V-merged cache, a K/V-separate cache, an MLA latent cache, ...) is met
twice: a vLLM attention backend allocates it and the worker registers it, and LMCache
names it with one of its engine KV formats when its op surface moves it. Each module
of this folder defines `LAYOUT`, a `Layout` named after the module, answering both:

- vLLM's side: the worker's names for a registered layer of this layout
  (`worker_formats`, which `kv_worker.layer_planes.KVFormat` is made of), how a registered
  tuple or a backend-described tensor is recognised as it, and the backends whose
  cache packs K and V in a way only this layout explains (`packed_backends`);
- LMCache's side: its engine KV formats of this layout (`formats`, LMCache's integer
  codes, names and structural modifiers, and which ops take each), how the block
  op cuts a paged cache of it into planes (`cut_block_planes`) and, where they are
  not K/V halves of token rows, where its planes lie in LMCache's objects
  (`block_object_regions`).

The registry imports every module of this folder, so adding a layout is adding one
file. Pure logic: torch only, nothing from vLLM or LMCache (LMCache imports
`lmcache_ascend.ops`, which reads these facts).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

__all__ = [
    "BLOCK_OP",
    "DescribedTraits",
    "DimRole",
    "FormatFacts",
    "LAYOUTS",
    "Layout",
    "MULTI_LAYER_OP",
    "PER_TOKEN_OPS",
    "PackedKV",
    "SINGLE_LAYER_OP",
    "TupleTraits",
    "UNILATERAL_OP",
    "format_by_code",
    "formats_taken_by",
    "kv_halves",
    "layout_of",
    "packed_kv_by_backend",
    "paged_layer_shape",
    "planes_of_tuples",
]

# LMCache's KV-movement ops, by the names it calls them.
MULTI_LAYER_OP = "multi_layer_kv_transfer"
UNILATERAL_OP = "multi_layer_kv_transfer_unilateral"
SINGLE_LAYER_OP = "single_layer_kv_transfer"
BLOCK_OP = "multi_layer_block_kv_transfer"
# The per-token ops follow the baseline's three paged shapes: MLA rows, blocks-first K/V, K/V-major.
PER_TOKEN_OPS = frozenset({MULTI_LAYER_OP, SINGLE_LAYER_OP})


class DimRole(enum.Enum):
    """What one dim of a registered tensor is, as its attention backend documents it."""

    BLOCK = "block"  # num_blocks
    TOKEN = "token"  # slot inside a block (block_size)
    HEAD = "head"  # KV head (or head slot)
    KV = "kv"  # 2: K, then V
    CONTENT = "content"  # the elements of one (head, token) cell, moved whole


class PackedKV(enum.Enum):
    """How a CONTENT dim that holds K and V together splits them."""

    NONE = "none"  # the content is K or V alone, or a latent (MLA)
    PER_CELL = "per-cell"  # each (head, token) cell holds that token's K, then its V: moved whole
    # Per block and head, the [TOKEN, CONTENT] interior holds every token's K row,
    # then every token's V row (vLLM CPU_ATTN: view(..., 2 * block_size, head_size)).
    ROWS_PER_BLOCK_HEAD = "rows-per-block-head"
    # vLLM >= 0.32: the spec publishes two head slots (`num_head_slots=2`) instead of
    # one per KV head: slot 0 is K, slot 1 V, each (slot, token) cell that token's K
    # (or V) of every head side by side.
    KV_HEAD_SLOTS = "kv-head-slots"


@dataclass(frozen=True)
class FormatFacts:
    """One of LMCache's engine KV formats (`EngineKVFormat` in 0.5.x, `GPUKVFormat` in 0.4.x, the same
    values): its code, its enum member's name, the structural modifiers LMCache 0.5.6's torch baseline
    dispatches on (`gpu_connector/kv_format/specs/`), and the ops that take it."""

    value: int
    name: str
    ops: frozenset[str] = frozenset()
    cross_layer: bool = False  # one tensor holds every layer: [NB, NL, 2, ...]
    kv_list: bool = False  # two lists [K layers], [V layers] (SGLang MHA)
    mla: bool = False  # one latent plane, no K/V split
    hnd: bool = False  # heads before block tokens
    fused: bool = False  # K and V packed into the last dim: one plane
    two_major: bool = False  # [2, NB, ...]: K and V are two leading planes
    pbs_fused: bool = False  # blocks and block tokens folded into one axis
    kv_tuple: bool = False  # per layer a (K, V) tuple, or MLA planes (DSv4 bundled)
    single_kv: bool = False  # each entry is one K or V tensor
    layout: str = field(default="", compare=False)  # the layout module declaring it, set by the registry

    @property
    def single_plane(self) -> bool:
        """The chunk holds one plane per layer ([NL, T, H]) rather than K and V ([2, NL, T, H])."""
        return self.mla or self.fused or self.single_kv


@dataclass(frozen=True)
class TupleTraits:
    """What the worker sees of a layer registered as a tuple of tensors (vllm-ascend's form)."""

    count: int  # tensors registered
    uniform: bool  # one scheduler group, one paging geometry, no folded dtype views
    dtypes: int  # distinct dtypes
    same_shapes: bool  # every tensor has the first one's shape


@dataclass(frozen=True)
class DescribedTraits:
    """What the worker sees of a single tensor read with its backend's dims."""

    roles: tuple[DimRole, ...]
    heads_split: bool  # heads outside the token row: a plane per head
    kv_split: bool  # K and V outside the token row: a plane each


# A block op cut: per plane the per-layer blocks-first tensors, in chunk order, from the paged
# cache as given (tensors, or tensors over the pointer table); `refuse(message)` raises the
# op's argument error.
BlockCut = Callable[[object, FormatFacts, Callable[[str], None]], list]


@dataclass(frozen=True)
class Layout:
    # Order the worker asks layouts in: the first that recognises a layer names it.
    rank: int
    worker_formats: Mapping[str, str] = field(default_factory=dict)  # KVFormat member name -> value
    recognise_tuple: Callable[[TupleTraits], str | None] | None = None
    recognise_described: Callable[[DescribedTraits], str | None] | None = None
    packed_backends: Mapping[str, PackedKV] = field(default_factory=dict)  # backend get_name() -> packing
    formats: Sequence[FormatFacts] = ()
    cut_block_planes: BlockCut | None = None
    # Where each plane's rows lie in one of the block op's LMCache objects, where the layout
    # places them otherwise than K/V halves of token rows: (object, row bytes per plane, layer
    # count, first token, refuse) -> (plane offsets, row pitches, layer stride), in bytes.
    block_object_regions: Callable | None = None
    name: str = ""  # its module's, set by the registry


def kv_halves(layers: Sequence[torch.Tensor], facts: FormatFacts) -> list[list[torch.Tensor]]:
    """K and V per layer of a cache that holds them in one tensor: the leading dim of 2 (two-major)
    or the one after the blocks."""
    if facts.two_major:
        return [[layer[kv] for layer in layers] for kv in range(2)]
    return [[layer[:, kv] for layer in layers] for kv in range(2)]


def paged_layer_shape(facts: FormatFacts, nb: int, bs: int, nh: int, hs: int) -> tuple[int, ...]:
    """The shape of one layer's paged tensor of a per-layer format (LMCache's `paged_layer_shape`)."""
    if facts.pbs_fused:
        return (nb * bs, 1, hs)
    if facts.mla:
        return (nb, bs, hs)
    if facts.fused and facts.hnd:
        return (nb, nh, bs, hs)
    if facts.fused or facts.single_kv:
        return (nb, bs, nh, hs)
    if facts.two_major:
        return (2, nb, nh, bs, hs) if facts.hnd else (2, nb, bs, nh, hs)
    return (nb, 2, nh, bs, hs) if facts.hnd else (nb, 2, bs, nh, hs)


def planes_of_tuples(paged: Sequence, facts: FormatFacts, refuse: Callable[[str], None],
                     length_allowed: Callable[[int], bool], wanted: str) -> list[list[torch.Tensor]]:
    """Planes of a cache registered as one tuple per layer, every tuple of one allowed length."""
    counts = {len(entry) if isinstance(entry, (list, tuple)) else -1 for entry in paged}
    if len(counts) != 1 or -1 in counts or not length_allowed(next(iter(counts))):
        refuse(f"paged_buffer_ptrs_tensor for {facts.name} must be a list of per-layer {wanted}; "
               f"got lengths {sorted(counts)}")
    return [[entry[plane] for entry in paged] for plane in range(counts.pop())]


def _load() -> tuple[Layout, ...]:
    layouts = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        layout = dataclasses.replace(importlib.import_module(f"{__name__}.{info.name}").LAYOUT, name=info.name)
        for facts in layout.formats:
            object.__setattr__(facts, "layout", layout.name)
        layouts.append(layout)
    return tuple(sorted(layouts, key=lambda layout: layout.rank))


LAYOUTS: tuple[Layout, ...] = _load()
_BY_NAME = {layout.name: layout for layout in LAYOUTS}
_FORMATS: dict[int, FormatFacts] = {facts.value: facts for layout in LAYOUTS for facts in layout.formats}


def format_by_code() -> dict[int, FormatFacts]:
    """Every engine KV format a layout declares, by LMCache's code, in code order."""
    return dict(sorted(_FORMATS.items()))


def formats_taken_by(op: str) -> tuple[int, ...]:
    """LMCache's codes of the formats `op` moves, in code order."""
    return tuple(value for value, facts in sorted(_FORMATS.items()) if op in facts.ops)


def layout_of(facts: FormatFacts) -> Layout:
    return _BY_NAME[facts.layout]


def packed_kv_by_backend() -> dict[str, PackedKV]:
    """Backends (by `get_name()`) whose cache packs K and V together, and how: from every layout."""
    return {backend: packing for layout in LAYOUTS for backend, packing in layout.packed_backends.items()}
