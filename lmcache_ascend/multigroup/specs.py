"""The one typed geometry of vLLM's KV-cache groups, and the row rules every layer uses.

vLLM's hybrid KV cache manager gives a model several KV-cache groups; each has
its own block table (``block_ids[g]``), block size in tokens, optional
compression (``compress_ratio`` tokens per stored row) and optional sliding
window. `KVGroupSpec` holds those facts and whether LMCache moves the group,
validated once when it is made; the scheduler's slot builder, the worker's
chunk planner and the connector all read it. Its rules live here once:
`chunk_row_window` (which rows of a group a chunk moves; `sliding_tail_first_row`
is the sliding-window part of it) and `cached_row_count` (the rows of vLLM's
cached prefix, which a load leaves alone).

A leaf module (numpy and the standard library only): vLLM's scheduler process
imports it. `kv_groups_from_config` reads plain attributes of a
``KVCacheConfig``-like object (duck-typed), never importing vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from lmcache_ascend.multigroup.spec_kinds import BUNDLE_SPEC_NAMES, SpecKind, classify
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy

__all__ = [
    "KVGroupSpec",
    "KVGroups",
    "RowKey",
    "RowWindow",
    "cached_row_count",
    "chunk_row_window",
    "geometry_digest",
    "kv_groups_from_specs",
    "kv_groups_from_config",
    "sliding_tail_first_row",
]


# One slot mapping of a request: (KV-cache group index, compress ratio of the layers it addresses).
# A group has one per compress ratio of its layers (`KVGroupSpec.ratios`); its block ids are shared.
RowKey = tuple[int, int]


def _positive_int(group_index: Any, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(
            f"KV-cache group {group_index}: {name}={value!r} is not allowed; it must be a positive integer"
        )
    return int(value)


@dataclass(frozen=True)
class KVGroupSpec:
    """One vLLM KV-cache group: its geometry and whether LMCache moves it.

    ``block_size`` is in tokens (vLLM's ``KVCacheSpec.block_size``); a block of
    a group with ``compress_ratio`` c holds ``block_size // c`` paged rows, one
    row per c tokens. ``sliding_window`` is in tokens (None: full attention), a
    multiple of c. ``is_state`` marks groups holding recurrent state;
    ``transferred`` is False for a group LMCache leaves out (a state group under
    the state-skip policy). ``no_reuse`` names why the group makes prefix reuse
    impossible (its spec is `SpecKind.NO_REUSE`): such a group is never moved,
    and a layout with one reuses nothing. Every value is checked here, naming
    the group.

    ``layer_ratios`` holds, per layer, its own compress ratio where the group's
    layers compress at several (vLLM 0.32 puts DeepSeek-V4's ratio-4 and ratio-128
    caches and the ratio-4 indexer's K in one group of 256-token blocks: 64 rows
    per block of the first, 2 of the second; the block ids are shared). Such a
    group has one row geometry per ratio (`at_ratio`), and ``compress_ratio`` is
    the smallest of them; the per-row rules of one ratio (`rows_per_block`,
    `num_rows`, `window_rows`) refuse it rather than answer for one ratio only.
    Only a worker sees the layers' specs: vLLM hands its scheduler the first
    layer's spec of such a group, so the block ids the scheduler ships depend on
    tokens per block alone (`geometry_digest`).
    """

    group_index: int
    spec_class_name: str
    block_size: int
    compress_ratio: int = 1
    sliding_window: int | None = None
    is_state: bool = False
    transferred: bool = True
    no_reuse: str | None = None
    layer_ratios: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.group_index, bool) or not isinstance(self.group_index, int) or self.group_index < 0:
            raise ValueError(f"KV-cache group index {self.group_index!r} is not allowed; it must be an int >= 0")
        name = f"{self.group_index} ({self.spec_class_name})"
        object.__setattr__(self, "block_size", _positive_int(name, "block_size", self.block_size))
        object.__setattr__(self, "compress_ratio", _positive_int(name, "compress_ratio", self.compress_ratio))
        if self.block_size % self.compress_ratio:
            raise ValueError(
                f"KV-cache group {name}: block_size={self.block_size} is not a multiple of "
                f"compress_ratio={self.compress_ratio}; a block must hold whole rows"
            )
        if self.sliding_window is not None:
            window = _positive_int(name, "sliding_window", self.sliding_window)
            if window % self.compress_ratio:
                raise ValueError(
                    f"KV-cache group {name}: sliding_window={window} is not allowed; it must be a positive "
                    f"multiple of compress_ratio={self.compress_ratio}"
                )
            object.__setattr__(self, "sliding_window", window)
        if self.layer_ratios:
            layer_ratios = tuple(
                (str(layer), _positive_int(name, f"compress ratio of layer {layer!r}", ratio))
                for layer, ratio in self.layer_ratios
            )
            object.__setattr__(self, "layer_ratios", layer_ratios)
            ratios = sorted({ratio for _, ratio in layer_ratios})
            uneven = [ratio for ratio in ratios if self.block_size % ratio]
            if uneven:
                raise ValueError(
                    f"KV-cache group {name}: block_size={self.block_size} is not a multiple of the compress "
                    f"ratios {uneven} of some of its layers; a block must hold whole rows of every layer"
                )
            if self.sliding_window is not None and len(ratios) > 1:
                raise ValueError(
                    f"KV-cache group {name}: a sliding window of {self.sliding_window} tokens over layers that "
                    f"compress at several ratios {ratios} has no one tail of rows per chunk"
                )
            if self.compress_ratio != ratios[0]:
                raise ValueError(
                    f"KV-cache group {name}: compress_ratio={self.compress_ratio} must be the smallest of its "
                    f"layers' ratios {ratios}"
                )

    @functools.cached_property
    def ratios(self) -> tuple[int, ...]:
        """Every compress ratio of the group's layers, ascending (one for most groups)."""
        if not self.layer_ratios:
            return (self.compress_ratio,)
        return tuple(sorted({ratio for _, ratio in self.layer_ratios}))

    @property
    def mixed_ratios(self) -> bool:
        """Whether the group's layers compress at several ratios (one row geometry per ratio)."""
        return len(self.ratios) > 1

    def ratio_of(self, layer_name: str) -> int:
        """The compress ratio of `layer_name`'s rows in this group (the group's, where its layers share one)."""
        if not self.layer_ratios:
            return self.compress_ratio
        ratio = dict(self.layer_ratios).get(layer_name)
        if ratio is None:
            raise ValueError(
                f"KV-cache group {self.group_index} ({self.spec_class_name}): layer {layer_name!r} is not one of its "
                f"layers, whose compress ratios differ ({self.ratios}); its rows per block are not known"
            )
        return ratio

    @property
    def row_keys(self) -> tuple[RowKey, ...]:
        """The group's slot mappings, one per compress ratio of its layers."""
        return tuple((self.group_index, ratio) for ratio in self.ratios)

    def at_ratio(self, ratio: int) -> "KVGroupSpec":
        """The group's row geometry for its layers of compress ratio `ratio`: the same group index, block
        size and block ids, `block_size // ratio` rows per block."""
        geometry = self._row_geometries.get(ratio)
        if geometry is None:
            raise ValueError(
                f"KV-cache group {self.group_index} ({self.spec_class_name}) has no layer of compress ratio "
                f"{ratio}; its ratios: {self.ratios}"
            )
        return geometry

    @functools.cached_property
    def _row_geometries(self) -> dict[int, "KVGroupSpec"]:
        # Made once: every request's slots of every step ask for them.
        if not self.layer_ratios:
            return {self.compress_ratio: self}
        return {ratio: dataclasses.replace(self, compress_ratio=ratio, layer_ratios=()) for ratio in self.ratios}

    def single_ratio(self, rule: str) -> int:
        """The group's one compress ratio; a group whose layers compress at several is refused, naming `rule`."""
        if self.mixed_ratios:
            raise ValueError(
                f"KV-cache group {self.group_index} ({self.spec_class_name}): its layers compress at ratios "
                f"{self.ratios}, so {rule} depends on the layer; take the group's row geometry of one ratio "
                "(at_ratio)"
            )
        return self.compress_ratio

    @property
    def rows_per_block(self) -> int:
        return self.block_size // self.single_ratio("rows per block")

    @property
    def window_rows(self) -> int | None:
        """Rows holding the sliding window's tokens (None: full attention)."""
        return None if self.sliding_window is None else self.sliding_window // self.single_ratio("window rows")

    def num_rows(self, num_tokens: int) -> int:
        """Paged rows that `num_tokens` tokens occupy: ceil(T / compress_ratio)."""
        return -(-num_tokens // self.single_ratio("the row count"))

    def num_blocks(self, num_tokens: int) -> int:
        """Paged blocks that hold the rows of the first `num_tokens` tokens."""
        # ceil(ceil(T / c) / (b / c)) rows per block is ceil(T / b): c divides b (checked above).
        return -(-num_tokens // self.block_size)


def sliding_tail_first_row(chunk_first_row, chunk_end_row, window_rows: int, block_rows: int):
    """First row a sliding-window group keeps of the chunk's rows [first, end).

    The kept rows are those of every paged block that holds one of the chunk's
    last `window_rows` rows: the window's start rounded down to its block, never
    before the chunk.  Whole blocks, because vLLM hands a request the blocks of
    its window whole and its attention kernels read them whole: a block loaded
    only from the window's first row would keep another request's rows in its
    head.  Takes ints or numpy arrays of rows (all chunks of a request at once).
    """
    tail = np.maximum(chunk_first_row, chunk_end_row - window_rows)
    return np.maximum(chunk_first_row, tail // block_rows * block_rows)


@dataclass(frozen=True)
class RowWindow:
    """Which rows of a group's slot mapping a chunk moves: [first, first + count)."""

    first: int
    count: int


def chunk_row_window(group: KVGroupSpec, start, end):
    """Rows of `group`'s slot mapping that the chunk of tokens [start, end) moves.

    Compressed groups: rows ``[start / ratio, ceil(end / ratio))``; sliding-window
    groups only their tail (`sliding_tail_first_row`). Ints give a `RowWindow`;
    numpy arrays of starts and ends give a pair of arrays (first, count).
    """
    ratio = group.single_ratio("a chunk's row window")
    if np.any(np.asarray(start) % ratio):
        raise ValueError(
            f"KV-cache group {group.group_index}: chunk start {start} is not a multiple of compress_ratio={ratio}"
        )
    first = start // ratio
    last = -(-end // ratio)
    if group.sliding_window is not None:
        first = sliding_tail_first_row(first, last, group.window_rows, group.rows_per_block)
    if isinstance(first, np.ndarray):
        return first, last - first
    return RowWindow(int(first), int(last - first))


def cached_row_count(group: KVGroupSpec, cached_tokens: int, num_rows: int) -> int:
    """Leading rows of a slot mapping of `num_rows` rows that vLLM's cached prefix holds.

    A row is vLLM's only when all of its compress_ratio tokens are cached; a load
    leaves these rows alone (rewriting blocks vLLM may be reading races with it).
    """
    return max(0, min(cached_tokens // group.single_ratio("the cached row count"), num_rows))


def _shipped_fields(group: KVGroupSpec) -> dict[str, Any]:
    """The fields of `group` that the block ids a scheduler ships for it depend on.

    A step ships ``ceil(tokens / block_size)`` block ids per group whatever its layers' compress
    ratios, and a chunk's blocks are those its tokens fall in; only a sliding window's tail (the
    blocks of its last rows) depends on the ratio. vLLM's scheduler sees one layer's spec of a
    group whose layers compress at several ratios, its workers every layer's: both agree on the
    tokens per block, which is what the ids are counted in; each worker addresses its own layers'
    rows with their own ratios (checked against its tensors at registration).
    """
    fields = {field.name: getattr(group, field.name) for field in dataclasses.fields(group)}
    del fields["layer_ratios"]
    if group.sliding_window is None:
        del fields["compress_ratio"]
    return fields


def geometry_digest(groups: Iterable[KVGroupSpec]) -> int:
    """A 64-bit digest of the geometry of `groups` that a step's block ids depend on (in group order),
    the same in every process (`_shipped_fields`: tokens per block, windows, which groups move).

    The scheduler and the workers each build their groups from vLLM's KV-cache config; a
    step's block ids carry the scheduler's digest (`StepBlockIds.geometry_digest`) instead of
    the groups, and a worker compares it with its own. Each field is written as its name and
    ``repr`` (ints, strings, bools and None only), so no per-process string hashing enters it.
    """
    text = "|".join(
        ";".join(f"{name}={value!r}" for name, value in _shipped_fields(group).items())
        for group in sorted(groups, key=lambda group: group.group_index)
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class KVGroups:
    """All KV-cache groups of a model plus the settings that shape transfers.

    ``vllm_block_size`` is ``cache_config.block_size`` (under the hybrid
    manager, the GCD of the group block sizes).
    """

    groups: tuple[KVGroupSpec, ...]
    vllm_block_size: int

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("KVGroups needs at least one KV-cache group; got none")
        for position, group in enumerate(self.groups):
            if group.group_index != position:
                raise ValueError(
                    f"group at position {position} has group_index={group.group_index}; "
                    "groups must be listed in vLLM's order"
                )
        if self.vllm_block_size <= 0:
            raise ValueError(f"vllm_block_size={self.vllm_block_size} must be a positive integer")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_multi_group(self) -> bool:
        return len(self.groups) > 1

    # Read on every scheduler step: computed once per layout (the layout is frozen).
    @functools.cached_property
    def transferred(self) -> tuple[bool, ...]:
        """Per group, whether LMCache stores and loads it."""
        return tuple(group.transferred for group in self.groups)

    @functools.cached_property
    def no_reuse_groups(self) -> tuple[KVGroupSpec, ...]:
        """The groups that make prefix reuse impossible (empty: reuse may be exact)."""
        return tuple(group for group in self.groups if group.no_reuse is not None)

    @functools.cached_property
    def transferred_group_indices(self) -> tuple[int, ...]:
        return tuple(group.group_index for group in self.groups if group.transferred)

    @functools.cached_property
    def geometry_digest(self) -> int:
        """`geometry_digest` of the groups: what a step's block ids carry in their place."""
        return geometry_digest(self.groups)

    @functools.cached_property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(group.block_size for group in self.groups)

    def groups_by_index(self) -> dict[int, KVGroupSpec]:
        return {group.group_index: group for group in self.groups}


def _unpacked_specs(spec: Any) -> list[Any]:
    # UniformTypeKVCacheSpecs wraps one spec per layer in `kv_cache_specs`;
    # the block table is shared, but compression and windows live on the
    # inner specs, so they must be read there (else the ratio comes out as 1).
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return list(inner.values())
    return [spec]


def _compress_ratio(spec: Any) -> int:
    """Tokens per stored row: vllm-ascend's ``compress_ratio``; vLLM's ``tokens_per_state`` (DeepSeek-V4's
    compressed caches in vLLM 0.32), where it is a whole number of tokens (a state-space spec's -1 and
    a fraction of a token mean no compression of token rows)."""
    ratio = getattr(spec, "compress_ratio", None)
    if ratio is None:
        ratio = getattr(spec, "tokens_per_state", 1)
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            ratio = 1
    return int(ratio or 1)


def _one_value(group_index: int, name: str, values: Iterable[Any]) -> Any:
    distinct = set(values)
    if len(distinct) != 1:
        raise ValueError(
            f"KV-cache group {group_index}: its layers disagree on {name} "
            f"({sorted(distinct, key=repr)}); one group must share one {name}"
        )
    return distinct.pop()


def _class_names(spec: Any) -> list[str]:
    """The spec's class name, then its ancestors' (most derived first), without `object`."""
    return [cls.__name__ for cls in type(spec).__mro__ if cls is not object]


def _spec_to_group(group_index: int, spec: Any, policy: StateGroupPolicy) -> KVGroupSpec:
    if type(spec).__name__ not in BUNDLE_SPEC_NAMES and isinstance(getattr(spec, "kv_cache_specs", None), dict):
        classify(type(spec).__name__, _class_names(spec)[1:])  # an unknown bundle type is refused too
    inner_specs = _unpacked_specs(spec)
    class_name = _one_value(group_index, "spec class", (type(s).__name__ for s in inner_specs))
    try:
        verdict = classify(class_name, _class_names(inner_specs[0])[1:])
    except ValueError as error:
        raise ValueError(f"KV-cache group {group_index}: {error}") from None
    no_reuse = None
    if verdict.kind is SpecKind.NO_REUSE:
        no_reuse = f"{class_name}: {verdict.reason}"
    ratios = sorted({_compress_ratio(s) for s in inner_specs})
    compress_ratio = ratios[0]
    sliding_window = _one_value(
        group_index, "sliding_window", (getattr(s, "sliding_window", None) for s in inner_specs)
    )
    layer_ratios: tuple[tuple[str, int], ...] = ()
    if len(ratios) > 1 and sliding_window is not None and no_reuse is None:
        no_reuse = (
            f"{class_name}: a {sliding_window}-token sliding window over layers that compress at several "
            f"ratios {ratios}: no one tail of rows per chunk is known for it"
        )
    elif len(ratios) > 1:
        # vLLM's DeepSeek-V4 puts ratio-4 and ratio-128 compressed caches in one group: one block
        # holds block_size // ratio rows of each layer, at its own ratio, under the shared block ids.
        inner = getattr(spec, "kv_cache_specs", None)
        layer_ratios = tuple((str(layer), _compress_ratio(inner_spec)) for layer, inner_spec in inner.items())
    return KVGroupSpec(
        group_index=group_index,
        spec_class_name=class_name,
        block_size=int(spec.block_size),
        compress_ratio=compress_ratio,
        sliding_window=sliding_window,
        is_state=no_reuse is not None or policy.is_state_spec(class_name),
        no_reuse=no_reuse,
        layer_ratios=layer_ratios,
    )


def kv_groups_from_config(
    kv_cache_config: Any,
    vllm_block_size: int,
    policy: StateGroupPolicy,
) -> KVGroups:
    """The layout of a vLLM ``KVCacheConfig`` (read by attribute, never imported)."""
    kv_cache_groups: Sequence[Any] = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if not kv_cache_groups:
        raise ValueError(
            f"kv_cache_config={kv_cache_config!r} has no kv_cache_groups; "
            "the connector needs vLLM's KVCacheConfig to plan per-group transfers"
        )
    groups = tuple(
        _spec_to_group(index, group.kv_cache_spec, policy) for index, group in enumerate(kv_cache_groups)
    )
    return kv_groups_from_specs(groups, vllm_block_size, policy)


def kv_groups_from_specs(
    groups: Sequence[KVGroupSpec], vllm_block_size: int, policy: StateGroupPolicy
) -> KVGroups:
    """Layout of already-typed groups; the policy decides which groups move."""
    moved = tuple(
        dataclasses.replace(
            group, transferred=group.no_reuse is None and not (policy.skip_state_groups and group.is_state)
        )
        for group in groups
    )
    no_reuse = any(group.no_reuse is not None for group in moved)
    if len(moved) > 0 and not no_reuse and not any(group.transferred for group in moved):
        raise ValueError(
            "every KV-cache group would be skipped as a state group "
            f"({[g.spec_class_name for g in groups]}); check LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"
        )
    return KVGroups(groups=moved, vllm_block_size=vllm_block_size)
