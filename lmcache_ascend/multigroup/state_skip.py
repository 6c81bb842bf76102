"""Which KV-cache groups hold recurrent state and are left out of LMCache.

DeepSeek-V4 on vllm-ascend has groups whose specs hold compressor/indexer
state (class names ending in ``State``) rather than per-token KV; they are not
needed to reuse a prefix, so storing them only costs space and bandwidth. The
C4 indexer KV group is real per-token KV and is kept.

The decision comes from two flags (see `lmcache_ascend.flags`):
``LMCACHE_ASCEND_SKIP_STATE_GROUPS`` (on by default) and
``LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST`` (spec class names to skip, each a
type `spec_kinds.SPEC_KINDS` knows; empty keeps `DEFAULT_STATE_SPEC_CLASS_NAMES`).
Groups whose spec makes reuse impossible (``SpecKind.NO_REUSE``) are never moved,
whatever the flags say.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_ascend.multigroup.spec_kinds import SPEC_KINDS, SpecKind, known_spec_names, names_of_kind

__all__ = [
    "DEFAULT_STATE_SPEC_CLASS_NAMES",
    "StateGroupPolicy",
    "policy_from_values",
]

# The spec types classified as not needed for reuse (`spec_kinds.SpecKind.SKIP`):
# vllm-ascend's DeepSeek-V4 state specs among them. The C4 indexer *KV* spec is
# deliberately absent: its rows are needed for reuse.
DEFAULT_STATE_SPEC_CLASS_NAMES: frozenset[str] = frozenset(names_of_kind(SpecKind.SKIP))


@dataclass(frozen=True)
class StateGroupPolicy:
    """``skip_state_groups``: whether state groups are skipped at all;
    ``state_spec_class_names``: the spec class names that count as state."""

    skip_state_groups: bool = True
    state_spec_class_names: frozenset[str] = DEFAULT_STATE_SPEC_CLASS_NAMES

    def is_state_spec(self, spec_class_name: str) -> bool:
        return spec_class_name in self.state_spec_class_names


def policy_from_values(skip_state_groups: object, allowlist: object) -> StateGroupPolicy:
    """Policy from already-parsed flag values (bool, tuple of names).

    Raises ValueError naming the flag when a value has the wrong type, so a
    bad LMCache YAML value fails as clearly as a bad environment value.
    """
    if not isinstance(skip_state_groups, bool):
        raise ValueError(
            f"LMCACHE_ASCEND_SKIP_STATE_GROUPS={skip_state_groups!r} is not a boolean; allowed: true/false"
        )
    if isinstance(allowlist, str):
        allowlist = tuple(part.strip() for part in allowlist.split(",") if part.strip())
    if not isinstance(allowlist, (tuple, list, frozenset, set)) or not all(
        isinstance(name, str) and name.isidentifier() for name in allowlist
    ):
        raise ValueError(
            f"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST={allowlist!r} is not allowed; "
            "allowed: comma-separated spec class names (Python identifiers)"
        )
    unknown = sorted(set(allowlist) - known_spec_names())
    if unknown:
        raise ValueError(
            f"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST names {', '.join(unknown)}, which is no known KV-cache "
            f"spec type (a misspelt name would move every state group); allowed: {', '.join(sorted(SPEC_KINDS))}"
        )
    names = frozenset(allowlist) if allowlist else DEFAULT_STATE_SPEC_CLASS_NAMES
    return StateGroupPolicy(skip_state_groups=skip_state_groups, state_spec_class_names=names)

