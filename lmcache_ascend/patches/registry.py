"""The registry: which patches exist, what state each is in, and applying/reverting them.

Life of a patch in one process::

    declared --activate()--> gated (disabled? distribution installed?)
        --target imported--> decide (guard + version gate) --> install (wrappers, build;
        all or nothing: `lmcache_ascend.patches.install`) --> record

Deciding and installing return an `Outcome`; `PatchRecord.settle` is the one
place that writes it down.

A patch's declaration module is imported only when it is needed: when its
target is imported (the post-import hook), or when someone asks for the patch
itself (`PatchRecord.patch`: the CLI, tests).  Until then the registry works from
the patch's `CatalogueEntry` (name, target, requirements, flags, prerequisites),
so activation imports no declaration and none of the logic they import.

Nothing here imports a patch target by itself except `import_targets` (the
CLI's ``--import``) and `apply_now` (tests).  Every failure is caught and
recorded; the user's import never sees an exception from a patch.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import types
from typing import Callable, Iterable, Mapping

from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat import import_hooks
from lmcache_ascend.compat.source import fingerprint, module_is_locatable
from lmcache_ascend.patches.install import Outcome, install, kind_refusal, resolve, restore, same, short_trace
from lmcache_ascend.patches.model import (
    MISSING,
    CatalogueEntry,
    Patch,
    State,
    read_raw,
    resolve_owner,
    split_attribute_path,
)

# Imported at the first apply, not at activation (which needs none of them):
# compat.markers, compat.bindings, compat.guards, compat.versions.


def _log(level: str, message: str, *args: object) -> None:
    import logging  # lazily: activation must stay cheap

    getattr(logging.getLogger("lmcache_ascend"), level)(message, *args)


SCHEMA_VERSION = 1


class DeclarationError(Exception):
    """A patch's declaration module did not load, or does not declare what its catalogue entry says."""


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
        # (owner, attribute, ours, original) outside the target's current objects, put
        # back on revert where still ours: other modules' names for a replaced value
        # (bound before activation, re-bound by apply), and the objects of an earlier
        # execution of the target (importlib.reload), which keep the patch until revert.
        self.elsewhere: list[tuple[object, str, object, object]] = []

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
        self._postponed = None
        self._state, self._reason, self._error = state, reason, error

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
            self.elsewhere.extend(outcome.installation.aliases)
            self.untested = outcome.untested

    def forget_installation(self) -> None:
        """Nothing of ours is in place any more (reverted, or the target was executed again)."""
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


class Registry:
    """The patches of one process and their records; thread-safe.

    Built from declarations (`Patch`) or from catalogue entries, whose declarations
    are imported when first needed (see the module's docstring).
    """

    def __init__(self, patches: Iterable[Patch | CatalogueEntry]):
        self._lock = threading.RLock()
        self._records: dict[str, PatchRecord] = {}
        for item in patches:
            if item.name in self._records:
                raise ValueError(f"two patches are named {item.name!r}")
            if isinstance(item, CatalogueEntry):
                self._records[item.name] = PatchRecord(item)
            else:
                self._records[item.name] = PatchRecord(CatalogueEntry.of(item, module=None), item)
        self._load_errors: dict[str, str] = {}  # declaration module -> why it did not load
        self.activated_by: list[str] = []
        self._hooked: set[str] = set()
        # A hook that fired can't be re-armed by the import system; disarming makes pending ones do nothing.
        self.armed = False

    # ------------------------------------------------------------------ queries
    def names(self) -> list[str]:
        return list(self._records)

    def record(self, name: str) -> PatchRecord:
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(f"no patch named {name!r}; known: {', '.join(self._records) or '(none)'}") from None

    def records(self) -> list[PatchRecord]:
        with self._lock:
            for record in self._records.values():
                self._notice_override(record)
            return list(self._records.values())

    def state(self, name: str) -> State:
        record = self.record(name)
        with self._lock:
            self._notice_override(record)
        return record.state

    # ---------------------------------------------------------- declarations
    @property
    def load_errors(self) -> dict[str, str]:
        """Declaration modules that did not load, and why (asking loads every declaration)."""
        self.load_declarations(self.names())
        return dict(self._load_errors)

    def load_declarations(self, names: Iterable[str]) -> None:
        """Import the declarations of `names` and of their prerequisites, outside the lock
        (an import may wait for another thread); one that fails leaves its record failed."""
        pending = list(names)
        seen: set[str] = set()
        while pending:
            record = self._records.get(pending.pop())
            if record is None or record.entry.name in seen:
                continue
            seen.add(record.entry.name)
            pending.extend(record.entry.after)
            try:
                record.patch
            except DeclarationError as error:
                with self._lock:
                    if record.state is not State.FAILED:
                        _log("warning", "lmcache-ascend: patch %s: declaration did not load: %s",
                             record.entry.name, error)
                        record.set(State.FAILED, f"declaration did not load: {error}")
                    self._load_errors[record.entry.module or record.entry.name] = str(error)

    # ------------------------------------------------------------- the gates
    def _flag_gate(self, entry: CatalogueEntry, flag_values: Mapping[str, object]) -> Outcome | None:
        """The skip the flags decide (off, disabled by name, not enabled), or None."""
        if not flag_values["LMCACHE_ASCEND_PATCHES"]:
            return Outcome(State.SKIPPED_DISABLED, "LMCACHE_ASCEND_PATCHES=0")
        disabled = flag_values["LMCACHE_ASCEND_DISABLED_PATCHES"]
        if "*" in disabled or entry.name in disabled:
            return Outcome(State.SKIPPED_DISABLED, "listed in LMCACHE_ASCEND_DISABLED_PATCHES")
        if entry.enabled_by is not None and not flag_values[entry.enabled_by]:
            return Outcome(State.SKIPPED_DISABLED, f"off by default; set {entry.enabled_by}=1")
        return None

    def _gate_before_import(self, entry: CatalogueEntry, flag_values: Mapping[str, object]) -> Outcome | None:
        """Decide what can be decided without the target (nor the declaration); None when it
        should wait for the import."""
        skip = self._flag_gate(entry, flag_values)
        if skip is not None or module_is_locatable(entry.target):  # a cheap file lookup
            return skip
        return _missing_target(entry)

    def _decide(self, patch: Patch, module: types.ModuleType | None) -> tuple[Outcome | None, str]:
        """Upstream guard, version gate, host: (None, why it applies) or (the skip, "")."""
        from lmcache_ascend.compat.guards import Verdict, evaluate_guard

        guard = evaluate_guard(patch.guard, patch.target, module)
        if guard.verdict is Verdict.HAS_FIX:
            return Outcome(State.SKIPPED_UPSTREAM, f"upstream has it ({guard.how})"), ""
        skip, versions_note = _version_gate(patch)
        if skip is not None:
            return skip, ""
        if module is not None and patch.host is not None:  # the host is asked only where it applies
            other_host = patch.host()
            if other_host:
                return Outcome(State.SKIPPED_HOST, f"{other_host}; {versions_note}"), ""
        return None, f"{versions_note}; guard: {guard.verdict.value} ({guard.how})"

    # ------------------------------------------------------------ evaluation
    def evaluate_without_import(self, flag_values: Mapping[str, object]) -> None:
        """Fill in states as far as they can be known without importing any target."""
        self.load_declarations(self.names())  # the guards are in the declarations
        with self._lock:
            for record in self._records.values():
                if record.state is not State.PENDING:
                    continue
                early = self._gate_before_import(record.entry, flag_values)
                if early is not None:
                    record.settle(early)
                    continue
                target = record.entry.target
                skip, note = self._decide(record.patch, sys.modules.get(target))
                record.settle(skip or Outcome(State.PENDING, f"applies when {target} is imported; {note}"))

    # ----------------------------------------------------------------- apply
    def activate(self, flag_values: Mapping[str, object], source: str) -> None:
        """Register post-import hooks for every patch that passes the early gates."""
        unknown = [n for n in flag_values["LMCACHE_ASCEND_DISABLED_PATCHES"] if n != "*" and n not in self._records]
        if unknown:  # a typo would leave the patch on
            raise flag_table.FlagError(
                f"LMCACHE_ASCEND_DISABLED_PATCHES names unknown patches {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(self._records)} (or '*')"
            )
        to_hook: list[tuple[str, str]] = []  # first activation: one hook per patch, for good
        to_apply: list[tuple[str, str]] = []  # re-activation of an imported target: apply when complete
        with self._lock:
            self.activated_by.append(source)
            self.armed = True
            for record in self._records.values():
                if record.state in (State.REVERTED, State.SKIPPED_DISABLED) and record.entry.name in self._hooked:
                    record.set(State.PENDING, "")  # re-armed after deactivate(): decide again
                if record.state is not State.PENDING:
                    continue
                early = self._flag_gate(record.entry, flag_values)
                if early is not None:
                    record.settle(early)
                    continue
                name, target = record.entry.name, record.entry.target
                if not module_is_locatable(target):
                    # Why it is missing takes the installed versions, which cost more than
                    # activation may: it is found out when someone asks.
                    record.postpone(functools.partial(_missing_target, record.entry))
                    continue
                if name not in self._hooked:
                    self._hooked.add(name)
                    to_hook.append((name, target))
                elif target in sys.modules:  # imported while disarmed: its hook has fired already
                    to_apply.append((name, target))
        # Outside the lock: a target half imported by another thread is waited for, and
        # that thread's own hooks need the lock to apply.
        for name, target in to_hook:
            _register_post_import_hook(target, self._hook_for(name))
        for name, target in to_apply:
            import_hooks.register_post_import_hook(target, functools.partial(self.apply_to_module, name))

    def deactivate(self) -> None:
        """Disarm every hook and revert every applied patch (tests; `LMCACHE_ASCEND_PATCHES=0` at run time)."""
        with self._lock:
            self.armed = False
            self.revert_all()

    def _hook_for(self, name: str):
        def on_target_imported(module: types.ModuleType) -> None:
            if self.armed:
                self.apply_to_module(name, module)

        on_target_imported.__qualname__ = f"lmcache_ascend[{name}]"
        return on_target_imported

    def apply_now(self, name: str, flag_values: Mapping[str, object] | None = None) -> State:
        """Import the target and apply `name` now (tests, CLI); returns the resulting state."""
        record = self.record(name)
        values = flag_table.validate_all() if flag_values is None else flag_values
        with self._lock:
            if record.state in (State.REVERTED, State.FAILED, State.OVERRIDDEN):
                record.set(State.PENDING, "")
            if record.state is State.APPLIED:
                return record.state
            if record.state is not State.PENDING:
                # A gate decided earlier (e.g. disabled); decide again with the given flags.
                record.set(State.PENDING, "")
            early = self._gate_before_import(record.entry, values)
            if early is not None:
                record.settle(early)
                return record.state
        for prerequisite in record.entry.after:
            if prerequisite in self._records and self._records[prerequisite].state is not State.APPLIED:
                self.apply_now(prerequisite, values)
        module = self._import_target(record)
        if module is not None:
            self.apply_to_module(name, module)
        return record.state

    def _import_target(self, record: PatchRecord) -> types.ModuleType | None:
        """`record`'s target, imported; None where its versions rule the patch out (then the
        target is not even imported: its import may need other packages) or the import fails,
        either settled on a record still pending."""
        with self._lock:
            skip, _ = _version_gate(record.entry)
            if skip is not None:
                if record.state is State.PENDING:
                    record.settle(skip)
                return None
        target = record.entry.target
        try:
            return importlib.import_module(target)
        except Exception as error:
            with self._lock:
                if record.state is State.PENDING:
                    record.set(
                        State.TARGET_MISSING, f"import of {target} failed: {type(error).__name__}: {error}", short_trace()
                    )
            return None

    def apply_to_module(self, name: str, module: types.ModuleType) -> None:
        record = self.record(name)
        self.load_declarations([name])
        with self._lock:
            if record.state is State.APPLIED and record.installed:
                self._follow_reexecution(record, module)
            if record.state is not State.PENDING:
                return
            try:
                self._bring_in_prerequisites(record.patch)
                record.settle(self._decide_and_install(record.patch, module))
            except Exception as error:  # the last line of defence: a patch never breaks an import
                record.set(State.FAILED, f"unexpected error: {type(error).__name__}: {error}", short_trace())
            if record.state is State.APPLIED:
                _log("debug", "lmcache-ascend: applied %s", name)
            if record.state is State.FAILED:
                _log("warning", "lmcache-ascend: patch %s failed: %s", name, record.reason)

    def _follow_reexecution(self, record: PatchRecord, module: types.ModuleType) -> None:
        """The target's body ran again (importlib.reload): re-apply to the objects it made.

        Nothing happens while our values are in place.  When none of them is there
        and nothing of this patch is (fresh objects), the patch goes pending to be
        applied once to the new objects; what is left in between is `overridden`.
        """
        current = {}
        rebound = set()  # paths whose owner survived the execution (the module itself)
        for path in record.installed:
            owner_path, attribute = split_attribute_path(path)
            try:
                owner = resolve_owner(module, owner_path)
                current[path] = read_raw(owner, attribute)
            except AttributeError:
                current[path] = MISSING
                continue
            if owner is record.owners[path]:
                rebound.add(path)
        kept = [path for path, value in current.items() if same(value, record.installed[path])]
        if len(kept) == len(current):
            return
        from lmcache_ascend.compat import markers

        if kept or any(record.patch.name in markers.patch_names_on(value) for value in current.values()):
            record.set(
                State.OVERRIDDEN,
                f"{record.patch.target} was executed again and kept only part of the patch ({', '.join(kept)})",
            )
            return
        # An owner that survived (a module-level name: the module object stays) had its
        # attribute bound afresh by the execution; the re-apply installs over that, and
        # only owners of the earlier execution keep ours until revert.
        record.elsewhere.extend(
            (record.owners[path], split_attribute_path(path)[1], ours, record.originals[path])
            for path, ours in record.installed.items()
            if path not in rebound
        )
        record.forget_installation()
        record.set(State.PENDING, f"{record.patch.target} was executed again (importlib.reload)")

    def _decide_and_install(self, patch: Patch, module: types.ModuleType) -> Outcome:
        """Decide whether `patch` goes in on `module`, and install it if so."""
        from lmcache_ascend.compat import markers

        resolution = resolve(patch, module)
        # Never twice: a mark of this patch on a current value means it is already in
        # (checked before the guard, which would take our own work for upstream's).
        if resolution.missing is None and any(
            patch.name in markers.patch_names_on(raw) for raw in resolution.originals.values()
        ):
            # Another copy of the registry installed it: ours to report, not to revert.
            return Outcome(State.APPLIED, "already applied (marked objects found)")
        skip, note = self._decide(patch, module)
        if skip is not None:
            return skip
        if resolution.missing is not None:
            return Outcome(State.TARGET_MISSING, resolution.missing)
        fingerprints = {
            path: fingerprint(raw) if raw is not MISSING else None for path, raw in resolution.originals.items()
        }
        refusal = kind_refusal(patch, resolution) or self._prerequisite_refusal(patch)
        if refusal is None:
            # The flags this patch owns are checked now, by the patch that reads them
            # (activation leaves them alone: upstream may read them with its own rules).
            flag_problems = _owned_flag_problems(patch)
            refusal = Outcome(State.FAILED, "; ".join(flag_problems)) if flag_problems else None
        if refusal is not None:
            return refusal.replace(fingerprints=fingerprints)
        return install(patch, module, resolution, fingerprints, note).replace(fingerprints=fingerprints)

    def _bring_in_prerequisites(self, patch: Patch) -> None:
        """Apply the prerequisites whose targets are imported (or executed again) and still pending."""
        for prerequisite in patch.after:
            other = self._records.get(prerequisite)
            if other is None:
                continue
            module = sys.modules.get(other.entry.target)
            # PENDING: not yet in; APPLIED: its target may have been executed again.
            if other.state in (State.PENDING, State.APPLIED) and module is not None and not import_hooks.is_initializing(module):
                self.apply_to_module(prerequisite, module)

    def _prerequisite_refusal(self, patch: Patch) -> Outcome | None:
        """Why `patch` can't go in for its prerequisites, or None; a skip is inherited as such."""
        for prerequisite in patch.after:
            other = self._records.get(prerequisite)
            if other is None:
                return Outcome(State.FAILED, f"needs patch {prerequisite!r}, which is not declared")
            if other.state in (State.APPLIED, State.SKIPPED_UPSTREAM):
                continue
            inherited = other.state if other.state in (State.SKIPPED_DISABLED, State.SKIPPED_VERSION, State.SKIPPED_HOST) else State.FAILED
            return Outcome(inherited, f"needs {prerequisite}, which is {other.state.value}: {other.reason}")
        return None

    # ---------------------------------------------------------------- revert
    def revert(self, name: str) -> State:
        """Restore the originals of `name` where the current values are still ours."""
        record = self.record(name)
        with self._lock:
            for dependent in self._records.values():  # what was built on top goes first
                if name in dependent.entry.after and dependent.installed:
                    self.revert(dependent.entry.name)
            for owner, attribute, ours, original in record.elsewhere:
                if same(read_raw(owner, attribute), ours):
                    restore(owner, attribute, original)
            record.elsewhere.clear()
            self._notice_override(record)
            if record.state not in (State.APPLIED, State.OVERRIDDEN) or not record.installed:
                return record.state  # not applied, or applied by another copy: nothing of ours to undo
            module = sys.modules.get(record.entry.target)
            kept: list[str] = []
            for path, ours in record.installed.items():
                owner_path, attribute = split_attribute_path(path)
                try:
                    owner = resolve_owner(module, owner_path)
                except AttributeError:
                    kept.append(path)
                    continue
                if same(read_raw(owner, attribute), ours):
                    restore(owner, attribute, record.originals[path])
                else:
                    kept.append(path)
            record.forget_installation()
            if kept:
                record.set(State.OVERRIDDEN, f"replaced by someone else, left as found: {', '.join(kept)}")
            else:
                record.set(State.REVERTED, "originals restored")
            return record.state

    def revert_all(self) -> None:
        for name in reversed(self.names()):
            self.revert(name)

    def _notice_override(self, record: PatchRecord) -> None:
        if record.state is not State.APPLIED or not record.installed:
            return
        module = sys.modules.get(record.entry.target)
        if module is None:
            return
        for path, ours in record.installed.items():
            owner_path, attribute = split_attribute_path(path)
            try:
                current = read_raw(resolve_owner(module, owner_path), attribute)
            except AttributeError:
                current = MISSING
            if not same(current, ours):
                record.set(State.OVERRIDDEN, f"{path} was replaced after we applied")
                return

    # ------------------------------------------------------------------ CLI
    def import_targets(self) -> None:
        """Import every target that passed the early gates (the CLI's --import)."""
        for record in list(self._records.values()):
            if record.entry.name in self._hooked:
                self._import_target(record)  # the post-import hook applies it


def _missing_target(entry: CatalogueEntry) -> Outcome:
    """Why `entry`'s target is not there: its package is absent, or (for a package that
    exists but lacks the module) usually a version the patch is not for."""
    missing = Outcome(State.TARGET_MISSING, f"module {entry.target} not found")
    if not module_is_locatable(entry.target.partition(".")[0]):
        return missing.replace(distribution_missing=True)  # not even its package is there
    # vllm-ascend 0.18 has no DeepSeek-V4 code: say so.
    skip, _ = _version_gate(entry)
    if skip is not None and skip.state is State.SKIPPED_VERSION:
        return skip
    return missing.replace(distribution_missing=bool(skip and skip.distribution_missing))


def _version_gate(patch: Patch | CatalogueEntry) -> tuple[Outcome | None, str]:
    """(None, the versions found) when every requirement holds, else (the skip, "").

    An undecidable check (no `packaging` in a bare interpreter) lets the patch through.
    """
    from lmcache_ascend.compat.versions import installed_version, specifier_error, version_satisfies

    notes = []
    for distribution, specifier in patch.requires.items():
        version = installed_version(distribution)
        if version is None:
            return Outcome(State.TARGET_MISSING, f"{distribution} is not installed", distribution_missing=True), ""
        bad_specifier = specifier_error(specifier)
        if bad_specifier:
            return Outcome(State.SKIPPED_VERSION, f"invalid requirement for {distribution}: {bad_specifier}"), ""
        verdict = version_satisfies(version, specifier)
        if verdict is False:
            return Outcome(State.SKIPPED_VERSION, f"{distribution} {version} is outside {specifier}"), ""
        notes.append(f"{distribution} {version}" + (" (unchecked: packaging missing)" if verdict is None else ""))
    return None, ", ".join(notes)


def _register_post_import_hook(target: str, hook) -> None:
    # Every execution: a reloaded target gets the patch again (see _follow_reexecution).
    import_hooks.register_post_import_hook(target, hook, every_execution=True)


def _owned_flag_problems(patch: Patch) -> list[str]:
    problems = []
    for name in patch.flags:
        if not flag_table.get_flag(name).owned_by_patches:
            continue  # validated at activation
        try:
            flag_table.flag_value(name)
        except flag_table.FlagError as error:
            problems.append(str(error))
    return problems


# -------------------------------------------------------------------- the process registry
_PROCESS_REGISTRY: Registry | None = None
_PROCESS_LOCK = threading.Lock()


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


def process_registry() -> Registry:
    """The registry of this process, built on first use from the catalogue (no declaration is imported)."""
    global _PROCESS_REGISTRY
    with _PROCESS_LOCK:
        if _PROCESS_REGISTRY is None:
            from lmcache_ascend.patches.catalogue import CATALOGUE

            _PROCESS_REGISTRY = Registry(CATALOGUE)
        return _PROCESS_REGISTRY


# Module-level shortcuts on the process registry, for tests and tools.
def apply_now(name: str, flag_values: Mapping[str, object] | None = None) -> State:
    return process_registry().apply_now(name, flag_values)


def revert(name: str) -> State:
    return process_registry().revert(name)


def state(name: str) -> State:
    return process_registry().state(name)


def record(name: str) -> PatchRecord:
    return process_registry().record(name)
