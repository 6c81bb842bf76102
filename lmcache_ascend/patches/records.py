"""What happened to each patch in this process (`PatchRecord`), and its declaration, imported
when first needed."""

from __future__ import annotations

import importlib
from typing import Callable

from lmcache_ascend.patches.install import Outcome
from lmcache_ascend.patches.model import TRANSITIONS, CatalogueEntry, Patch, State


class DeclarationError(Exception):
    """A patch's declaration module did not load, or does not declare what its catalogue entry says."""


def declared_in(module_name: str) -> tuple[Patch, ...]:
    """The patches `module_name` declares (``PATCHES``, or its one ``PATCH``), in order."""
    module = importlib.import_module(module_name)
    return tuple(getattr(module, "PATCHES", None) or (module.PATCH,))


def load_declaration(entry: CatalogueEntry) -> Patch | str:
    """The `Patch` that `entry` announces, imported from its module, or why it can't be had."""
    try:
        declared = {patch.name: patch for patch in declared_in(entry.module)}
    except Exception as error:
        return f"{entry.module}: {type(error).__name__}: {error}"
    patch = declared.get(entry.name)
    if patch is None:
        return f"{entry.module} declares no patch {entry.name!r} (it declares {sorted(declared)})"
    if CatalogueEntry.of(patch, entry.module) != entry:
        return (f"the catalogue entry of {entry.name!r} is out of date: {entry!r}, but {entry.module} declares "
                f"{CatalogueEntry.of(patch, entry.module)!r} (regenerate the catalogue: see its docstring)")
    return patch


class PatchRecord:
    """What happened to one patch in this process.  A decision that activation postponed
    (`postpone`) is made when ``state``, ``reason``, ``error`` or ``distribution_installed`` is
    first read; the state changes only through `set`, along `model.TRANSITIONS`."""

    def __init__(self, entry: CatalogueEntry, patch: Patch | None = None) -> None:
        self.entry = entry
        self._patch: Patch | str | None = patch  # the declaration, or why it did not load
        self._state = State.PENDING
        self._reason = ""
        self._error: str | None = None
        self._distribution_installed = True
        self._postponed: Callable[[], Outcome] | None = None
        self.untested = False
        self.fingerprints: dict[str, str | None] = {}
        # Per attribute path, what apply installed and what it replaced; other modules' names it
        # rebound: (module, name, ours, original).
        self.installed: dict[str, object] = {}
        self.originals: dict[str, object] = {}
        self.aliases: list[tuple[object, str, object, object]] = []

    @property
    def patch(self) -> Patch:
        """The declaration, imported on first use; raises `DeclarationError`."""
        if self._patch is None:
            self._patch = load_declaration(self.entry)
        if isinstance(self._patch, str):
            raise DeclarationError(self._patch)
        return self._patch

    def postpone(self, decide: Callable[[], Outcome]) -> None:
        self._postponed = decide

    def _decided(self) -> "PatchRecord":
        decide = self._postponed
        if decide is not None:
            self._postponed = None
            self.settle(decide())  # the same outcome whichever thread gets here first
        return self

    state = property(lambda self: self._decided()._state)
    reason = property(lambda self: self._decided()._reason)
    error = property(lambda self: self._decided()._error)
    distribution_installed = property(lambda self: self._decided()._distribution_installed)

    def set(self, state: State, reason: str, error: str | None = None) -> None:
        self._postponed = None
        if state is not self._state and state not in TRANSITIONS[self._state]:
            raise RuntimeError(f"patch {self.entry.name}: no transition {self._state.value} -> {state.value}")
        self._state, self._reason, self._error = state, reason, error

    def settle(self, outcome: Outcome) -> None:
        """Write down a decision or an apply."""
        self.set(outcome.state, outcome.reason, outcome.error)
        if outcome.distribution_missing:
            self._distribution_installed = False
        if outcome.installed is not None:
            self.installed, self.originals = dict(outcome.installed), dict(outcome.originals)
            self.aliases.extend(outcome.aliases)
            self.untested = outcome.untested

    def forget_installation(self) -> None:
        self.installed.clear()
        self.originals.clear()
        self.untested = False

    def as_json(self) -> dict[str, object]:
        entry = self.entry
        try:
            patch: Patch | None = self.patch
        except DeclarationError:  # its state says why; the catalogue still knows the rest
            patch = None
        return {
            "name": entry.name, "target": entry.target,
            "attributes": list(patch.attributes) if patch else [], "kind": patch.kind.value if patch else None,
            "state": self.state.value, "reason": self.reason, "untested_target": self.untested, "error": self.error,
            "requires": dict(entry.requires), "flags": list(entry.flags), "enabled_by": entry.enabled_by,
            "after": list(entry.after), "fingerprints": dict(self.fingerprints),
        }
