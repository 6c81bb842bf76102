"""What happened to each patch in this process: its `PatchRecord`, and the declaration it
is imported from when first needed.

A record's state changes only through `PatchRecord.set`, along `model.TRANSITIONS`;
`PatchRecord.settle` writes down a whole `Outcome` (a decision or an apply).
"""

from __future__ import annotations

import importlib
from typing import Callable

from lmcache_ascend.patches.install import Outcome
from lmcache_ascend.patches.model import TRANSITIONS, CatalogueEntry, Patch, State

__all__ = ["DeclarationError", "PatchRecord", "declared_in", "load_declaration"]


class DeclarationError(Exception):
    """A patch's declaration module did not load, or does not declare what its catalogue entry says."""


def declared_in(module_name: str) -> tuple[Patch, ...]:
    """The patches `module_name` declares (``PATCHES``, or its one ``PATCH``), in order."""
    module = importlib.import_module(module_name)
    return tuple(getattr(module, "PATCHES", None) or (module.PATCH,))


def load_declaration(entry: CatalogueEntry) -> Patch:
    """The `Patch` that `entry` announces, imported from its module; raises `DeclarationError`
    if the module does not load or its declaration no longer matches the entry."""
    try:
        declared = {patch.name: patch for patch in declared_in(entry.module)}
    except Exception as error:
        raise DeclarationError(f"{entry.module}: {type(error).__name__}: {error}") from None
    patch = declared.get(entry.name)
    if patch is None:
        raise DeclarationError(f"{entry.module} declares no patch {entry.name!r} (it declares {sorted(declared)})")
    if CatalogueEntry.of(patch, entry.module) != entry:
        raise DeclarationError(
            f"the catalogue entry of {entry.name!r} is out of date: {entry!r}, but {entry.module} declares "
            f"{CatalogueEntry.of(patch, entry.module)!r} (regenerate the catalogue: see its docstring)"
        )
    return patch


class PatchRecord:
    """What happened to one patch in this process (a plain class: see `Patch`).

    ``state``, ``reason``, ``error`` and ``distribution_installed`` are read through
    properties: a decision that activation postponed (`postpone`) is made when one
    of them is first read.
    """

    def __init__(self, entry: CatalogueEntry, patch: Patch | None = None) -> None:
        self.entry = entry
        self._patch = patch
        self._declaration_error: str | None = None
        self._state = State.PENDING
        self._reason = ""
        self._error: str | None = None
        self._distribution_installed = True
        self._postponed: Callable[[], Outcome] | None = None
        self.untested = False
        self.fingerprints: dict[str, str | None] = {}
        # What apply installed and what it replaced, per attribute path (for revert).
        self.installed: dict[str, object] = {}
        self.originals: dict[str, object] = {}
        self.owners: dict[str, object] = {}
        # (module, name, ours, original): other modules' names for a replaced module-level
        # value, re-bound by apply and put back on revert where still ours.
        self.aliases: list[tuple[object, str, object, object]] = []

    @property
    def patch(self) -> Patch:
        """The declaration, imported from ``entry.module`` on first use; raises `DeclarationError`."""
        if self._patch is None:
            if self._declaration_error is None:
                try:
                    self._patch = load_declaration(self.entry)
                except DeclarationError as error:
                    self._declaration_error = str(error)
            if self._patch is None:
                raise DeclarationError(self._declaration_error)
        return self._patch

    def postpone(self, decide: Callable[[], Outcome]) -> None:
        """Leave the record's decision to `decide`, made (and settled) when the record is first read."""
        self._postponed = decide

    def _decided(self) -> "PatchRecord":
        decide = self._postponed
        if decide is not None:
            self._postponed = None
            self.settle(decide())  # the same outcome whichever thread gets here first
        return self

    @property
    def state(self) -> State:
        return self._decided()._state

    @property
    def reason(self) -> str:
        return self._decided()._reason

    @property
    def error(self) -> str | None:
        return self._decided()._error

    @property
    def distribution_installed(self) -> bool:
        return self._decided()._distribution_installed

    def set(self, state: State, reason: str, error: str | None = None) -> None:
        """Move to `state`; a move `model.TRANSITIONS` does not allow is a bug of the registry."""
        self._postponed = None
        if state is not self._state and state not in TRANSITIONS[self._state]:
            raise RuntimeError(f"patch {self.entry.name}: no transition {self._state.value} -> {state.value}")
        self._state, self._reason, self._error = state, reason, error

    def rearm(self) -> None:
        """Back to pending, to be decided again."""
        self.set(State.PENDING, "")

    def settle(self, outcome: Outcome) -> None:
        """Write down `outcome`: the one place a decision or an apply reaches the record."""
        self.set(outcome.state, outcome.reason, outcome.error)
        if outcome.distribution_missing:
            self._distribution_installed = False
        if outcome.fingerprints is not None:
            self.fingerprints = dict(outcome.fingerprints)
        if outcome.installation is not None:
            self.installed = dict(outcome.installation.installed)
            self.originals = dict(outcome.installation.originals)
            self.owners = dict(outcome.installation.owners)
            self.aliases.extend(outcome.installation.aliases)
            self.untested = outcome.untested

    def forget_installation(self) -> None:
        """Nothing of ours is in place any more (reverted)."""
        self.installed.clear()
        self.originals.clear()
        self.owners.clear()
        self.untested = False

    def as_json(self) -> dict[str, object]:
        entry = self.entry
        try:
            patch: Patch | None = self.patch
        except DeclarationError:  # its state says why; the catalogue still knows the rest
            patch = None
        return {
            "name": entry.name,
            "target": entry.target,
            "attributes": list(patch.attributes) if patch else [],
            "kind": patch.kind.value if patch else None,
            "state": self.state.value,
            "reason": self.reason,
            "untested_target": self.untested,
            "error": self.error,
            "requires": dict(entry.requires),
            "flags": list(entry.flags),
            "enabled_by": entry.enabled_by,
            "after": list(entry.after),
            "fingerprints": dict(self.fingerprints),
        }
