"""Typed descriptions of vLLM's KV-cache groups, as LMCache's connector needs them.

vLLM's hybrid KV cache manager gives a model several KV-cache groups; each has
its own block table (``block_ids[g]``), block size in tokens, optional
compression (``compress_ratio`` tokens per stored row) and optional sliding
window. This module turns those facts into frozen dataclasses without importing
vLLM: `layout_from_kv_cache_config` reads plain attributes of a
``KVCacheConfig``-like object (duck-typed), and `group_spec_from_attributes` is
the one place that validates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from lmcache_ascend.multigroup.state_skip import StateGroupPolicy

__all__ = [
    "KVGroupSpec",
    "MultiGroupLayout",
    "group_spec_from_attributes",
    "layout_from_groups",
    "layout_from_kv_cache_config",
]


@dataclass(frozen=True)
class KVGroupSpec:
    """One vLLM KV-cache group, seen from the connector.

    ``block_size`` is in tokens (vLLM's ``KVCacheSpec.block_size``); a block of
    a group with ``compress_ratio`` c holds ``block_size // c`` paged rows, one
    row per c tokens. ``sliding_window`` is in tokens (None: full attention).
    ``is_state`` marks groups holding recurrent state, which are not needed for
    prefix reuse and are skipped when the state-skip policy says so.
    """

    group_index: int
    spec_class_name: str
    block_size: int
    compress_ratio: int = 1
    sliding_window: int | None = None
    is_state: bool = False

    @property
    def rows_per_block(self) -> int:
        return self.block_size // self.compress_ratio

    def num_rows(self, num_tokens: int) -> int:
        """Paged rows that `num_tokens` tokens occupy: ceil(T / compress_ratio)."""
        return -(-num_tokens // self.compress_ratio)


@dataclass(frozen=True)
class MultiGroupLayout:
    """All KV-cache groups of a model plus the settings that shape transfers.

    ``vllm_block_size`` is ``cache_config.block_size`` (under the hybrid
    manager, the GCD of the group block sizes). ``transferred`` says per group
    whether LMCache stores and loads it (False for skipped state groups).
    """

    groups: tuple[KVGroupSpec, ...]
    vllm_block_size: int
    transferred: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("MultiGroupLayout needs at least one KV-cache group; got none")
        if len(self.transferred) != len(self.groups):
            raise ValueError(
                f"transferred has {len(self.transferred)} entries for {len(self.groups)} groups"
            )
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

    @property
    def transferred_group_indices(self) -> tuple[int, ...]:
        return tuple(index for index, keep in enumerate(self.transferred) if keep)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(group.block_size for group in self.groups)


def _positive_int(group_index: int, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"KV-cache group {group_index}: {name}={value!r} is not allowed; "
            "it must be a positive integer"
        )
    return value


def group_spec_from_attributes(
    group_index: int,
    spec_class_name: str,
    block_size: int,
    compress_ratio: int = 1,
    sliding_window: int | None = None,
    is_state: bool = False,
) -> KVGroupSpec:
    """Validated `KVGroupSpec` from plain attribute values."""
    block_size = _positive_int(group_index, "block_size", block_size)
    compress_ratio = _positive_int(group_index, "compress_ratio", compress_ratio)
    if block_size % compress_ratio:
        raise ValueError(
            f"KV-cache group {group_index} ({spec_class_name}): block_size={block_size} "
            f"is not a multiple of compress_ratio={compress_ratio}; a block must hold whole rows"
        )
    if sliding_window is not None:
        sliding_window = _positive_int(group_index, "sliding_window", sliding_window)
    return KVGroupSpec(
        group_index=group_index,
        spec_class_name=spec_class_name,
        block_size=block_size,
        compress_ratio=compress_ratio,
        sliding_window=sliding_window,
        is_state=is_state,
    )


def _unpacked_specs(spec: Any) -> list[Any]:
    # UniformTypeKVCacheSpecs wraps one spec per layer in `kv_cache_specs`;
    # the block table is shared, but compression and windows live on the
    # inner specs, so they must be read there (else the ratio comes out as 1).
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return list(inner.values())
    return [spec]


def _one_value(group_index: int, name: str, values: Iterable[Any]) -> Any:
    distinct = set(values)
    if len(distinct) != 1:
        raise ValueError(
            f"KV-cache group {group_index}: its layers disagree on {name} "
            f"({sorted(distinct, key=repr)}); one group must share one {name}"
        )
    return distinct.pop()


def _spec_to_group(group_index: int, spec: Any, policy: StateGroupPolicy) -> KVGroupSpec:
    inner_specs = _unpacked_specs(spec)
    class_name = _one_value(group_index, "spec class", (type(s).__name__ for s in inner_specs))
    compress_ratio = _one_value(
        group_index, "compress_ratio", (int(getattr(s, "compress_ratio", 1) or 1) for s in inner_specs)
    )
    sliding_window = _one_value(
        group_index, "sliding_window", (getattr(s, "sliding_window", None) for s in inner_specs)
    )
    return group_spec_from_attributes(
        group_index=group_index,
        spec_class_name=class_name,
        block_size=int(spec.block_size),
        compress_ratio=compress_ratio,
        sliding_window=sliding_window,
        is_state=policy.is_state_spec(class_name),
    )


def layout_from_kv_cache_config(
    kv_cache_config: Any,
    vllm_block_size: int,
    policy: StateGroupPolicy,
) -> MultiGroupLayout:
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
    return layout_from_groups(groups, vllm_block_size, policy)


def layout_from_groups(
    groups: Sequence[KVGroupSpec], vllm_block_size: int, policy: StateGroupPolicy
) -> MultiGroupLayout:
    """Layout of already-typed groups; the policy decides which groups move."""
    transferred = tuple(not (policy.skip_state_groups and group.is_state) for group in groups)
    if len(groups) > 0 and not any(transferred):
        raise ValueError(
            "every KV-cache group would be skipped as a state group "
            f"({[g.spec_class_name for g in groups]}); check LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"
        )
    return MultiGroupLayout(groups=tuple(groups), vllm_block_size=vllm_block_size, transferred=transferred)
