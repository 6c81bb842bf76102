"""Which KV-cache groups hold compressor state, and whether they are left out of LMCache.

DeepSeek-V4 on vllm-ascend has groups whose specs hold compressor/indexer
state (class names ending in ``State``) rather than per-token KV. They are
moved like any other group by default, because a prefill resumed after a
reused prefix reads them: the ratio-4 compressors' windows overlap, so the
previous window's state rows are read at every chunk boundary, and any
compressor reads its open window when the prefix does not end on a multiple of
its ratio (LMCache recomputes a whole prompt's last token, so a full hit
resumes one token short of a 128 boundary). Left out, those rows would be the
new request's stale blocks, and the outputs would silently differ.
vllm-ascend's own prefix cache keeps them too (as sliding-window groups).

The decision comes from two flags (see `lmcache_ascend.flags`):
``LMCACHE_ASCEND_SKIP_STATE_GROUPS`` (off by default; an opt-in for a model
whose compressors read no state across a chunk boundary) and
``LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST`` (spec class names to skip, each a
type `spec_kinds.SPEC_KINDS` classes ``SKIP``; empty keeps
`DEFAULT_STATE_SPEC_CLASS_NAMES`). The C4 indexer KV group is real per-token KV
and is never skipped. Groups whose spec makes reuse impossible
(``SpecKind.NO_REUSE``) are never moved, whatever the flags say.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_ascend.multigroup.spec_kinds import SPEC_KINDS, SpecKind, known_spec_names, names_of_kind

__all__ = [
    "DEFAULT_STATE_SPEC_CLASS_NAMES",
    "StateGroupPolicy",
    "policy_from_values",
]

# The spec types the skip may leave out (`spec_kinds.SpecKind.SKIP`): vllm-ascend's
# DeepSeek-V4 compressor-state specs. The C4 indexer *KV* spec is deliberately
# absent: its rows are per-token KV.
DEFAULT_STATE_SPEC_CLASS_NAMES: frozenset[str] = frozenset(names_of_kind(SpecKind.SKIP))


@dataclass(frozen=True)
class StateGroupPolicy:
    """``skip_state_groups``: whether state groups are skipped at all (off: they
    are moved, which keeps a reused prefix exact); ``state_spec_class_names``:
    the spec class names that count as state."""

    skip_state_groups: bool = False
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

