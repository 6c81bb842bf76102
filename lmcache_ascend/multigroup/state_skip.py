"""Which KV-cache groups hold recurrent state and are left out of LMCache.

DeepSeek-V4 on vllm-ascend has groups whose specs hold compressor/indexer
state (class names ending in ``State``) rather than per-token KV; they are not
needed to reuse a prefix, so storing them only costs space and bandwidth. The
C4 indexer KV group is real per-token KV and is kept.

The decision comes from two flags (see `lmcache_ascend.flags`):
``LMCACHE_ASCEND_SKIP_STATE_GROUPS`` (on by default) and
``LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST`` (spec class names to skip; empty
keeps `DEFAULT_STATE_SPEC_CLASS_NAMES`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_STATE_SPEC_CLASS_NAMES",
    "StateGroupPolicy",
    "policy_from_values",
]

# vllm-ascend's DeepSeek-V4 state specs (from LMCache-Ascend #246). The C4
# indexer *KV* spec is deliberately absent: its rows are needed for reuse.
DEFAULT_STATE_SPEC_CLASS_NAMES: frozenset[str] = frozenset(
    {
        "C4AttnKVState",
        "C4AttnScoreState",
        "C4IndexerKVState",
        "C4IndexerScoreState",
        "C128AttnKVState",
        "C128AttnScoreState",
    }
)


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
    names = frozenset(allowlist) if allowlist else DEFAULT_STATE_SPEC_CLASS_NAMES
    return StateGroupPolicy(skip_state_groups=skip_state_groups, state_spec_class_names=names)

