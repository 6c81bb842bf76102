"""The registry: which patches exist, what state each is in, and applying/reverting them.

Life of a patch in one process::

    declared --activate()--> gated (disabled? distribution installed?)
        --target imported--> guard + version gate --> build --> installed, all or nothing

Nothing here imports a patch target by itself except `import_targets` (the
CLI's ``--import``) and `apply_now` (tests).  Every failure is caught and
recorded; the user's import never sees an exception from a patch.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import traceback
import types
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat import import_hooks, markers
from lmcache_ascend.compat.guards import GuardResult, evaluate_guard
from lmcache_ascend.compat.source import NO_SOURCE, fingerprint, module_is_locatable
from lmcache_ascend.compat.versions import installed_version, specifier_error, version_satisfies
from lmcache_ascend.patches.model import (
    MISSING,
    TYPE_SLOT_ATTRIBUTES,
    Patch,
    PatchContext,
    PatchKind,
    State,
    Verdict,
    read_raw,
    resolve_owner,
    split_attribute_path,
)



def _log(level: str, message: str, *args: object) -> None:
    import logging  # lazily: activation must stay cheap

    getattr(logging.getLogger("lmcache_ascend"), level)(message, *args)

SCHEMA_VERSION = 1


@dataclass
class PatchRecord:
    """What happened to one patch in this process."""

    patch: Patch
    state: State = State.PENDING
    reason: str = ""
    error: str | None = None
    untested: bool = False
    distribution_installed: bool = True
    fingerprints: dict[str, str | None] = field(default_factory=dict)
    # What apply installed and what it replaced, per attribute path (for revert).
    installed: dict[str, object] = field(default_factory=dict)
    originals: dict[str, object] = field(default_factory=dict)
    owners: dict[str, object] = field(default_factory=dict)
    # (owner, attribute, ours, original) left on the objects of an earlier execution of
    # the target (importlib.reload): whoever bound them keeps the patch until revert.
    stale: list[tuple[object, str, object, object]] = field(default_factory=list)

    def set(self, state: State, reason: str, error: str | None = None) -> None:
        self.state, self.reason, self.error = state, reason, error

    def as_json(self) -> dict[str, object]:
        patch = self.patch
        return {
            "name": patch.name,
            "target": patch.target,
            "attributes": list(patch.attributes),
            "kind": patch.kind.value,
            "state": self.state.value,
            "reason": self.reason,
            "untested_target": self.untested,
            "error": self.error,
            "requires": dict(patch.requires),
            "flags": list(patch.flags),
            "enabled_by": patch.enabled_by,
            "after": list(patch.after),
            "fingerprints": dict(self.fingerprints),
        }


class Registry:
    """The patches of one process and their records; thread-safe."""

    def __init__(self, patches: Iterable[Patch], load_errors: Mapping[str, str] | None = None):
        self._lock = threading.RLock()
        self._records: dict[str, PatchRecord] = {}
        for patch in patches:
            if patch.name in self._records:
                raise ValueError(f"two patches are named {patch.name!r}")
            self._records[patch.name] = PatchRecord(patch)
        self.load_errors: dict[str, str] = dict(load_errors or {})
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

    # ------------------------------------------------------------- the gates
    def _gate_before_import(self, record: PatchRecord, flag_values: Mapping[str, object]) -> bool:
        """Decide what can be decided without the target; True when it should wait for the import."""
        patch = record.patch
        if not flag_values["LMCACHE_ASCEND_PATCHES"]:
            record.set(State.SKIPPED_DISABLED, "LMCACHE_ASCEND_PATCHES=0")
            return False
        disabled = flag_values["LMCACHE_ASCEND_DISABLED_PATCHES"]
        if "*" in disabled or patch.name in disabled:
            record.set(State.SKIPPED_DISABLED, "listed in LMCACHE_ASCEND_DISABLED_PATCHES")
            return False
        if patch.enabled_by is not None and not flag_values[patch.enabled_by]:
            record.set(State.SKIPPED_DISABLED, f"off by default; set {patch.enabled_by}=1")
            return False
        # Only a cheap file lookup here: versions are read when the target is imported
        # (importlib.metadata alone would cost more than activation may).
        if not module_is_locatable(patch.target):
            # A package that exists but lacks the module is usually a version the
            # patch is not for (vllm-ascend 0.18 has no DeepSeek-V4 code): say so.
            if module_is_locatable(patch.target.partition(".")[0]):
                skip_state, note = self._version_gate(record)
                if skip_state is State.SKIPPED_VERSION:
                    record.set(skip_state, note)
                    return False
            else:
                record.distribution_installed = False  # not even its top-level package is there
            record.set(State.TARGET_MISSING, f"module {patch.target} not found")
            return False
        return True

    def _version_gate(self, record: PatchRecord) -> tuple[State | None, str]:
        """(None, versions) when every requirement holds, else (the skip state, why).

        An undecidable check (no `packaging` in a bare interpreter) lets the patch through.
        """
        notes = []
        for distribution, specifier in record.patch.requires.items():
            version = installed_version(distribution)
            if version is None:
                record.distribution_installed = False
                return State.TARGET_MISSING, f"{distribution} is not installed"
            bad_specifier = specifier_error(specifier)
            if bad_specifier:
                return State.SKIPPED_VERSION, f"invalid requirement for {distribution}: {bad_specifier}"
            verdict = version_satisfies(version, specifier)
            if verdict is False:
                return State.SKIPPED_VERSION, f"{distribution} {version} is outside {specifier}"
            notes.append(f"{distribution} {version}" + (" (unchecked: packaging missing)" if verdict is None else ""))
        return None, ", ".join(notes)

    def _decide(self, record: PatchRecord, module: types.ModuleType | None) -> GuardResult | None:
        """Upstream guard then version gate; None when the patch should apply."""
        patch = record.patch
        guard = evaluate_guard(patch.guard, patch.target, module)
        if guard.verdict is Verdict.HAS_FIX:
            record.set(State.SKIPPED_UPSTREAM, f"upstream has it ({guard.how})")
            return guard
        skip_state, versions_note = self._version_gate(record)
        if skip_state is not None:
            record.set(skip_state, versions_note)
            return guard
        if module is not None and patch.host is not None:  # the host is asked only where it applies
            other_host = patch.host()
            if other_host:
                record.set(State.SKIPPED_HOST, f"{other_host}; {versions_note}")
                return guard
        record.reason = f"{versions_note}; guard: {guard.verdict.value} ({guard.how})"
        return None

    # ------------------------------------------------------------ evaluation
    def evaluate_without_import(self, flag_values: Mapping[str, object]) -> None:
        """Fill in states as far as they can be known without importing any target."""
        with self._lock:
            for record in self._records.values():
                if record.state is not State.PENDING:
                    continue
                if not self._gate_before_import(record, flag_values):
                    continue
                module = sys.modules.get(record.patch.target)
                if self._decide(record, module) is None:
                    record.set(State.PENDING, f"applies when {record.patch.target} is imported; {record.reason}")

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
                if record.state in (State.REVERTED, State.SKIPPED_DISABLED) and record.patch.name in self._hooked:
                    record.set(State.PENDING, "")  # re-armed after deactivate(): decide again
                if record.state is not State.PENDING:
                    continue
                if not self._gate_before_import(record, flag_values):
                    continue
                name, target = record.patch.name, record.patch.target
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
            if not self._gate_before_import(record, values):
                return record.state
        for prerequisite in record.patch.after:
            if prerequisite in self._records and self._records[prerequisite].state is not State.APPLIED:
                self.apply_now(prerequisite, values)
        with self._lock:
            # A version the patch is not for is not even imported (its import may need other packages).
            skip_state, note = self._version_gate(record)
            if skip_state is not None:
                record.set(skip_state, note)
                return record.state
        try:
            module = importlib.import_module(record.patch.target)
        except Exception as error:
            with self._lock:
                record.set(State.TARGET_MISSING, f"import of {record.patch.target} failed: {error}", _short_trace())
            return record.state
        self.apply_to_module(name, module)
        return record.state

    def apply_to_module(self, name: str, module: types.ModuleType) -> None:
        record = self.record(name)
        with self._lock:
            if record.state is State.APPLIED and record.installed:
                self._follow_reexecution(record, module)
            if record.state is not State.PENDING:
                return
            try:
                self._apply_locked(record, module)
            except Exception as error:  # the last line of defence: a patch never breaks an import
                record.set(State.FAILED, f"unexpected error: {type(error).__name__}: {error}", _short_trace())
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
        kept = [path for path, value in current.items() if _same(value, record.installed[path])]
        if len(kept) == len(current):
            return
        if kept or any(record.patch.name in markers.patch_names_on(value) for value in current.values()):
            record.set(
                State.OVERRIDDEN,
                f"{record.patch.target} was executed again and kept only part of the patch ({', '.join(kept)})",
            )
            return
        # An owner that survived (a module-level name: the module object stays) had its
        # attribute bound afresh by the execution; the re-apply installs over that, and
        # only owners of the earlier execution keep ours until revert.
        record.stale.extend(
            (record.owners[path], split_attribute_path(path)[1], ours, record.originals[path])
            for path, ours in record.installed.items()
            if path not in rebound
        )
        record.installed.clear()
        record.originals.clear()
        record.owners.clear()
        record.set(State.PENDING, f"{record.patch.target} was executed again (importlib.reload)")

    def _apply_locked(self, record: PatchRecord, module: types.ModuleType) -> None:
        patch = record.patch
        # 1. Resolve every attribute; what is missing is reported after the version gate.
        owners: dict[str, object] = {}
        missing: str | None = None
        for path in patch.attributes:
            owner_path, attribute = split_attribute_path(path)
            try:
                owner = resolve_owner(module, owner_path)
            except AttributeError:
                missing = f"{patch.target} has no {owner_path}"
                break
            raw = read_raw(owner, attribute)
            if patch.kind is not PatchKind.ADD and raw is MISSING and not hasattr(owner, attribute):
                missing = f"{patch.target} has no {path}"
                break
            owners[path] = owner
            record.originals[path] = raw

        # 2. Never twice: a mark of this patch on a current value means it is already in
        #    (checked before the guard, which would take our own work for upstream's).
        if missing is None and any(patch.name in markers.patch_names_on(raw) for raw in record.originals.values()):
            # Another copy of the registry installed it: ours to report, not to revert.
            record.originals.clear()
            record.set(State.APPLIED, "already applied (marked objects found)")
            return

        # 3. Upstream guard and version gate, then a missing target.
        if self._decide(record, module) is not None:
            record.originals.clear()
            return
        if missing is not None:
            record.originals.clear()
            record.set(State.TARGET_MISSING, missing)
            return
        record.fingerprints = {
            path: fingerprint(raw) if raw is not MISSING else None for path, raw in record.originals.items()
        }

        # 4a. WRAP needs something to call.
        not_callable = [
            path for path, raw in record.originals.items()
            if patch.kind is PatchKind.WRAP and raw is not MISSING and not _is_callable_member(raw)
        ]
        if not_callable:
            record.originals.clear()
            record.set(State.FAILED, f"target attribute not callable: {', '.join(not_callable)}")
            return

        # 4. ADD must not shadow an attribute upstream now defines itself.
        if patch.kind is PatchKind.ADD:
            present = [p for p in patch.attributes if record.originals[p] is not MISSING]
            if present:
                record.set(State.SKIPPED_UPSTREAM, f"upstream defines {', '.join(present)}")
                record.originals.clear()
                return

        # 5. Prerequisites first; a dependent of a patch that is out can't go in.
        if not self._prerequisites_in(record):
            record.originals.clear()
            return

        # 6. The flags this patch owns are checked now, by the patch that reads them
        #    (activation leaves them alone: upstream may read them with its own rules).
        flag_problems = _owned_flag_problems(patch)
        if flag_problems:
            record.originals.clear()
            record.set(State.FAILED, "; ".join(flag_problems))
            return

        # 7. Build the new values; nothing is touched if this raises.
        try:
            new_values = dict(patch.build(PatchContext(patch, module)))
        except Exception as error:
            record.originals.clear()
            record.set(State.FAILED, f"build raised {type(error).__name__}: {error}", _short_trace())
            return
        if set(new_values) != set(patch.attributes):
            record.originals.clear()
            record.set(
                State.FAILED,
                f"build returned {sorted(new_values)}, expected exactly {sorted(patch.attributes)}",
            )
            return
        # REPLACE puts a function where a function was, and data where data was.
        mismatched = [
            path for path, value in new_values.items()
            if patch.kind is PatchKind.REPLACE and record.originals[path] is not MISSING
            and _is_callable_member(value) != _is_callable_member(record.originals[path])
        ]
        if mismatched:
            record.originals.clear()
            record.set(State.FAILED, f"target attribute not callable where the replacement is (or the reverse): {', '.join(mismatched)}")
            return
        for value in new_values.values():
            markers.mark(value, patch.name)

        # 8. Install all or none.
        done: list[str] = []
        try:
            for path in patch.attributes:
                attribute = split_attribute_path(path)[1]
                setattr(owners[path], attribute, new_values[path])
                done.append(path)
                if attribute in TYPE_SLOT_ATTRIBUTES:
                    _forget_abc_answers(record.originals[path], new_values[path])
        except Exception as error:
            for path in reversed(done):
                _restore(owners[path], split_attribute_path(path)[1], record.originals[path])
            record.originals.clear()
            record.set(State.FAILED, f"installing raised {type(error).__name__}: {error}", _short_trace())
            return
        record.installed = {path: read_raw(owners[path], split_attribute_path(path)[1]) for path in patch.attributes}
        record.owners = owners

        # 9. Drift: a target whose source we never tested still applies, but says so;
        #    code without source is untested too unless the patch lists it so.
        untested = [
            path + (" has no source" if print_ == NO_SOURCE else "")
            for path, print_ in record.fingerprints.items()
            if record.originals[path] is not MISSING
            and print_ is not None
            and print_ not in patch.tested_fingerprints.get(path, ())
        ]
        record.untested = bool(untested)
        note = record.reason
        if untested:
            note = f"untested target ({', '.join(untested)}); {note}"
        record.set(State.APPLIED, note)
        _log("debug", "lmcache-ascend: applied %s", patch.name)

    def _prerequisites_in(self, record: PatchRecord) -> bool:
        for prerequisite in record.patch.after:
            other = self._records.get(prerequisite)
            if other is None:
                record.set(State.FAILED, f"needs patch {prerequisite!r}, which is not declared")
                return False
            module = sys.modules.get(other.patch.target)
            # PENDING: not yet in; APPLIED: its target may have been executed again.
            if other.state in (State.PENDING, State.APPLIED) and module is not None and not import_hooks.is_initializing(module):
                self.apply_to_module(prerequisite, module)
            if other.state in (State.APPLIED, State.SKIPPED_UPSTREAM):
                continue
            # The dependent inherits why its prerequisite is out, as long as that is a skip.
            inherited = other.state if other.state in (State.SKIPPED_DISABLED, State.SKIPPED_VERSION, State.SKIPPED_HOST) else State.FAILED
            record.set(inherited, f"needs {prerequisite}, which is {other.state.value}: {other.reason}")
            return False
        return True

    # ---------------------------------------------------------------- revert
    def revert(self, name: str) -> State:
        """Restore the originals of `name` where the current values are still ours."""
        record = self.record(name)
        with self._lock:
            for dependent in self._records.values():  # what was built on top goes first
                if name in dependent.patch.after and dependent.installed:
                    self.revert(dependent.patch.name)
            for owner, attribute, ours, original in record.stale:
                if _same(read_raw(owner, attribute), ours):
                    _restore(owner, attribute, original)
            record.stale.clear()
            self._notice_override(record)
            if record.state not in (State.APPLIED, State.OVERRIDDEN) or not record.installed:
                return record.state  # not applied, or applied by another copy: nothing of ours to undo
            module = sys.modules.get(record.patch.target)
            kept: list[str] = []
            for path, ours in record.installed.items():
                owner_path, attribute = split_attribute_path(path)
                try:
                    owner = resolve_owner(module, owner_path)
                except AttributeError:
                    kept.append(path)
                    continue
                if _same(read_raw(owner, attribute), ours):
                    _restore(owner, attribute, record.originals[path])
                else:
                    kept.append(path)
            record.installed.clear()
            record.originals.clear()
            record.owners.clear()
            record.untested = False
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
        module = sys.modules.get(record.patch.target)
        if module is None:
            return
        for path, ours in record.installed.items():
            owner_path, attribute = split_attribute_path(path)
            try:
                current = read_raw(resolve_owner(module, owner_path), attribute)
            except AttributeError:
                current = MISSING
            if not _same(current, ours):
                record.set(State.OVERRIDDEN, f"{path} was replaced after we applied")
                return

    # ------------------------------------------------------------------ CLI
    def import_targets(self) -> None:
        """Import every target that passed the early gates (the CLI's --import)."""
        for record in list(self._records.values()):
            if record.patch.name not in self._hooked:
                continue
            try:
                importlib.import_module(record.patch.target)
            except Exception as error:
                with self._lock:
                    if record.state is State.PENDING:
                        record.set(
                            State.TARGET_MISSING,
                            f"import of {record.patch.target} failed: {type(error).__name__}: {error}",
                        )


def _register_post_import_hook(target: str, hook) -> None:
    # Every execution: a reloaded target gets the patch again (see _follow_reexecution).
    import_hooks.register_post_import_hook(target, hook, every_execution=True)


def _is_callable_member(raw: object) -> bool:
    return callable(raw) or isinstance(raw, (classmethod, staticmethod, property))


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


def _same(current: object, ours: object) -> bool:
    if isinstance(ours, tuple):  # __bases__ tuples are rebuilt by type machinery
        return current == ours
    return current is ours


def _restore(owner: object, attribute: str, original: object) -> None:
    before = read_raw(owner, attribute) if attribute in TYPE_SLOT_ATTRIBUTES else None
    if original is MISSING:
        if attribute in vars(owner):
            delattr(owner, attribute)
    else:
        setattr(owner, attribute, original)
    if before is not None:
        _forget_abc_answers(before, original)


def _forget_abc_answers(old_bases: tuple, new_bases: tuple) -> None:
    """Clear the issubclass caches of every ABC a __bases__ change added or removed.

    ABCMeta caches both answers: without this, ``isinstance(x, SupportsHMA)`` could
    keep saying "no" after we add the base (if asked before) or "yes" after revert.
    """
    import abc

    for base in set(old_bases) ^ set(new_bases):
        for klass in getattr(base, "__mro__", ()):
            if isinstance(klass, abc.ABCMeta):
                klass._abc_caches_clear()


def _short_trace() -> str:
    return "".join(traceback.format_exc(limit=4))


# -------------------------------------------------------------------- the process registry
_PROCESS_REGISTRY: Registry | None = None
_PROCESS_LOCK = threading.Lock()


def load_declared_patches() -> tuple[list[Patch], dict[str, str]]:
    """Import every module in the catalogue; a broken declaration is reported, not raised."""
    from lmcache_ascend.patches.catalogue import PATCH_MODULES

    patches: list[Patch] = []
    errors: dict[str, str] = {}
    for module_name in PATCH_MODULES:
        try:
            module = importlib.import_module(module_name)
            declared = getattr(module, "PATCHES", None) or (module.PATCH,)
            patches.extend(declared)
        except Exception as error:
            errors[module_name] = f"{type(error).__name__}: {error}"
    return patches, errors


def process_registry() -> Registry:
    """The registry of this process, built on first use from the catalogue."""
    global _PROCESS_REGISTRY
    with _PROCESS_LOCK:
        if _PROCESS_REGISTRY is None:
            patches, errors = load_declared_patches()
            _PROCESS_REGISTRY = Registry(patches, errors)
            for module_name, error in errors.items():
                _log("warning", "lmcache-ascend: patch module %s did not load: %s", module_name, error)
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
