"""Installing a patch on its target: every attribute set, or none, and put back on revert."""

from __future__ import annotations

import traceback
import types
from typing import Mapping

from lmcache_ascend.compat.source import NO_SOURCE
from lmcache_ascend.patches.model import (
    MISSING,
    Patch,
    PatchContext,
    PatchKind,
    State,
    read_raw,
    resolve_owner,
    split_attribute_path,
    wrapped_member,
)


# A plain slotted class: a frozen dataclass or a named tuple costs more at import than activation may.
class Outcome:
    """What deciding about or applying a patch came to (``error``: a traceback), with what an apply
    installed (as `records.PatchRecord` keeps it)."""

    __slots__ = ("state", "reason", "error", "untested", "distribution_missing", "installed", "originals", "aliases")

    def __init__(self, state: State, reason: str, error: str | None = None, untested: bool = False,
                 distribution_missing: bool = False, installed: Mapping[str, object] | None = None,
                 originals: Mapping[str, object] | None = None, aliases: tuple = ()) -> None:
        self.state, self.reason, self.error = state, reason, error
        self.untested, self.distribution_missing = untested, distribution_missing
        self.installed, self.originals, self.aliases = installed, originals, aliases


def resolve(patch: Patch, module: types.ModuleType) -> tuple[dict[str, object], dict[str, object], str | None]:
    """(owners, raw originals, what is missing or None) of the patch's attributes."""
    owners: dict[str, object] = {}
    originals: dict[str, object] = {}
    for path in patch.attributes:
        owner_path, attribute = split_attribute_path(path)
        try:
            owner = resolve_owner(module, owner_path)
        except AttributeError:
            return owners, originals, f"{patch.target} has no {owner_path}"
        raw = read_raw(owner, attribute)
        if patch.kind is not PatchKind.ADD and raw is MISSING and not hasattr(owner, attribute):
            return owners, originals, f"{patch.target} has no {path}"
        owners[path] = owner
        originals[path] = raw
    return owners, originals, None


def kind_refusal(patch: Patch, originals: Mapping[str, object]) -> Outcome | None:
    """WRAP needs something to call; ADD must not shadow what upstream now defines itself."""
    if patch.kind is PatchKind.WRAP:
        not_callable = [path for path, raw in originals.items() if raw is not MISSING and not _is_callable_member(raw)]
        if not_callable:
            return Outcome(State.FAILED, f"target attribute not callable: {', '.join(not_callable)}")
    if patch.kind is PatchKind.ADD:
        present = [path for path in patch.attributes if originals[path] is not MISSING]
        if present:
            return Outcome(State.SKIPPED_UPSTREAM, f"upstream defines {', '.join(present)}")
    return None


def _value_refusal(patch: Patch, new_values: Mapping[str, object], originals: Mapping[str, object]) -> Outcome | None:
    """Why the built values can't go in: not the declared paths, or (REPLACE) code for data or the reverse."""
    if set(new_values) != set(patch.attributes) or len(new_values) != len(patch.attributes):
        expected = sorted(patch.attributes)
        return Outcome(State.FAILED, f"build returned {sorted(new_values)}, expected exactly {expected}")
    mismatched = [
        path for path, value in new_values.items()
        if patch.kind is PatchKind.REPLACE and originals[path] is not MISSING
        and _is_callable_member(value) != _is_callable_member(originals[path])
    ]
    if mismatched:
        return Outcome(State.FAILED, "target attribute not callable where the replacement is (or the reverse): "
                       + ", ".join(mismatched))
    return None


def install(patch: Patch, module: types.ModuleType, owners: Mapping[str, object], originals: Mapping[str, object],
            fingerprints: Mapping[str, str | None], note: str) -> Outcome:
    """Build the new values and set them all, or none."""
    try:  # nothing is touched if this raises
        new_values = dict(patch.build(PatchContext(patch, module))) if patch.build is not None else {}
        for path, wrapper in patch.wrappers.items():
            new_values[path] = wrapped_member(owners[path], split_attribute_path(path)[1], originals[path], wrapper)
    except Exception as error:
        return Outcome(State.FAILED, f"build raised {type(error).__name__}: {error}", short_trace())
    refusal = _value_refusal(patch, new_values, originals)
    if refusal is not None:
        return refusal
    from lmcache_ascend.compat import bindings, markers

    for value in new_values.values():
        markers.mark(value, patch.name)
    done: list[str] = []
    try:
        for path in patch.attributes:
            set_raw(owners[path], split_attribute_path(path)[1], new_values[path])
            done.append(path)
    except Exception as error:
        for path in reversed(done):
            set_raw(owners[path], split_attribute_path(path)[1], originals[path])
        return Outcome(State.FAILED, f"installing raised {type(error).__name__}: {error}", short_trace())
    installed = {path: read_raw(owners[path], split_attribute_path(path)[1]) for path in patch.attributes}
    replaced = [(originals[path], installed[path]) for path in patch.attributes if owners[path] is module]
    aliases = bindings.rebind_aliases(module, replaced, __name__.split(".", 1)[0])
    # A target whose source was never tested still applies, but says so (data has no fingerprint).
    untested = [path + (" has no source" if print_ == NO_SOURCE else "") for path, print_ in fingerprints.items()
                if print_ is not None and print_ not in patch.tested_fingerprints.get(path, ())]
    if untested:
        note = f"untested target ({', '.join(untested)}); {note}"
    return Outcome(State.APPLIED, note, untested=bool(untested), installed=installed, originals=dict(originals),
                   aliases=aliases)


def _is_callable_member(raw: object) -> bool:
    return callable(raw) or isinstance(raw, (classmethod, staticmethod, property))


def same(current: object, ours: object) -> bool:
    return current == ours if isinstance(ours, tuple) else current is ours  # type machinery rebuilds __bases__


def set_raw(owner: object, attribute: str, value: object) -> None:
    """Set the raw value of `owner.attribute`, MISSING deleting it (the reverse of `model.read_raw`)."""
    before = read_raw(owner, attribute) if attribute == "__bases__" else None
    if value is MISSING:
        if attribute in vars(owner):
            delattr(owner, attribute)
    else:
        setattr(owner, attribute, value)
    if before is not None:
        _forget_abc_answers(before, value)


def _forget_abc_answers(old_bases: tuple, new_bases: tuple) -> None:
    """Clear the caches of every ABC a __bases__ change added or removed, which would keep
    ``isinstance(x, SupportsHMA)``'s answer from before."""
    import abc

    for base in set(old_bases) ^ set(new_bases):
        for klass in getattr(base, "__mro__", ()):
            if isinstance(klass, abc.ABCMeta):
                klass._abc_caches_clear()


def short_trace() -> str:
    return "".join(traceback.format_exc(limit=4))
