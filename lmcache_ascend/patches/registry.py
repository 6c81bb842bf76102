"""The registry: the patches of one process, activating, applying and reverting them.

A patch is gated at activation (`gates.flag_gate`), decided when its target is imported
(`gates.decide`: guard, version, host), installed all or nothing (`install`) and recorded
(`records.PatchRecord`).  Activation reads only the catalogue: a declaration is imported with
its target.  Only `import_target` (the CLI's ``--import``, and the tests) imports a target.
Every failure is recorded, never raised into the user's import.  A reloaded target is not
followed: its record says overridden.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import types
from typing import Iterable, Mapping

from lmcache_ascend.compat import import_hooks
from lmcache_ascend.compat.source import fingerprint, module_is_locatable
from lmcache_ascend.patches import gates
from lmcache_ascend.patches.install import Outcome, install, kind_refusal, resolve, same, set_raw, short_trace
from lmcache_ascend.patches.model import CatalogueEntry, Patch, State, look_up, read_raw
from lmcache_ascend.patches.records import DeclarationError, PatchRecord


def _log(level: str, message: str, *args: object) -> None:
    import logging  # lazily: activation must stay cheap

    getattr(logging.getLogger("lmcache_ascend"), level)(message, *args)


class Registry:
    """The patches of one process and their records (thread-safe), from declarations or catalogue entries."""

    def __init__(self, patches: Iterable[Patch | CatalogueEntry]):
        self._lock = threading.RLock()
        self._records: dict[str, PatchRecord] = {}
        for item in patches:
            if item.name in self._records:
                raise ValueError(f"two patches are named {item.name!r}")
            entry, patch = (item, None) if isinstance(item, CatalogueEntry) else (CatalogueEntry.of(item, None), item)
            self._records[item.name] = PatchRecord(entry, patch)
        self._load_errors: dict[str, str] = {}  # declaration module -> why it did not load
        self.activated_by: list[str] = []
        self._hooked: set[str] = set()
        # A hook that fired can't be re-armed by the import system; disarming makes pending ones do nothing.
        self.armed = False

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

    @property
    def load_errors(self) -> dict[str, str]:
        """Declaration modules that did not load, and why (asking loads every declaration)."""
        self.load_declarations(self.names())
        return dict(self._load_errors)

    def load_declarations(self, names: Iterable[str]) -> None:
        """Import the declarations of `names` and their prerequisites, outside the lock (an import may wait
        for another thread); one that fails leaves its record failed."""
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

    def evaluate_without_import(self, flag_values: Mapping[str, object]) -> None:
        """Fill in states as far as they can be known without importing any target."""
        self.load_declarations(self.names())  # the guards are in the declarations
        with self._lock:
            for record in self._undecided(gates.before_import, flag_values):
                target = record.entry.target
                skip, note = gates.decide(record.patch, sys.modules.get(target))
                record.settle(skip or Outcome(State.PENDING, f"applies when {target} is imported; {note}"))

    def _undecided(self, gate, flag_values: Mapping[str, object]):
        """The pending records that `gate` leaves undecided; it settles the others."""
        for record in self._records.values():
            if record.state is State.PENDING:
                skip = gate(record.entry, flag_values)
                if skip is None:
                    yield record
                else:
                    record.settle(skip)

    def activate(self, flag_values: Mapping[str, object], source: str) -> None:
        """Register post-import hooks for every patch that passes the early gates (`flag_values` validated)."""
        with self._lock:
            self.activated_by.append(source)
            self.armed = True
            to_hook, to_apply = self._arm(flag_values)
        # Outside the lock: a target half imported by another thread is waited for, and
        # that thread's own hooks need the lock to apply.
        for name, target in to_hook:
            import_hooks.register_post_import_hook(target, self._hook_for(name))
        for name, target in to_apply:
            import_hooks.register_post_import_hook(target, functools.partial(self.apply_to_module, name))

    def _arm(self, flag_values: Mapping[str, object]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Gate every pending record; returns the (name, target) pairs to hook (once per patch)
        and to apply (re-activated after their hook fired)."""
        to_hook: list[tuple[str, str]] = []
        to_apply: list[tuple[str, str]] = []
        for record in self._records.values():
            if record.state in (State.REVERTED, State.SKIPPED_DISABLED) and record.entry.name in self._hooked:
                record.set(State.PENDING, "")  # re-armed after deactivate(): decide again
        for record in self._undecided(gates.flag_gate, flag_values):
            name, target = record.entry.name, record.entry.target
            if not module_is_locatable(target):
                # Why it is missing takes the installed versions, which cost more than activation may.
                record.postpone(functools.partial(gates.missing_target, record.entry))
                continue
            if name not in self._hooked:
                self._hooked.add(name)
                to_hook.append((name, target))
            elif target in sys.modules:
                to_apply.append((name, target))
        return to_hook, to_apply

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

    def import_target(self, record: PatchRecord) -> types.ModuleType | None:
        """`record`'s target, imported; None (settled on a pending record) where the import fails or
        the versions rule the patch out (the target, which may need other packages, is not imported)."""
        with self._lock:
            skip, _ = gates.version_gate(record.entry)
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
                    record.set(State.TARGET_MISSING, f"import of {target} failed: {type(error).__name__}: {error}",
                               short_trace())
            return None

    def apply_to_module(self, name: str, module: types.ModuleType) -> None:
        record = self.record(name)
        self.load_declarations([name])
        with self._lock:
            if record.state is not State.PENDING:
                return
            try:
                self._bring_in_prerequisites(record.patch)
                record.settle(self._decide_and_install(record, module))
            except Exception as error:  # the last line of defence: a patch never breaks an import
                record.set(State.FAILED, f"unexpected error: {type(error).__name__}: {error}", short_trace())
            if record.state is State.APPLIED:
                _log("debug", "lmcache-ascend: applied %s", name)
            if record.state is State.FAILED:
                _log("warning", "lmcache-ascend: patch %s failed: %s", name, record.reason)

    def _decide_and_install(self, record: PatchRecord, module: types.ModuleType) -> Outcome:
        from lmcache_ascend.compat import markers

        patch = record.patch
        owners, originals, missing = resolve(patch, module)
        # Our mark on a current value: another copy of the registry installed it (ours to report,
        # not to revert).  Checked before the guard, which would take our work for upstream's.
        if missing is None and any(patch.name in markers.patch_names_on(raw) for raw in originals.values()):
            return Outcome(State.APPLIED, "already applied (marked objects found)")
        skip, note = gates.decide(patch, module)
        if skip is not None:
            return skip
        if missing is not None:
            return Outcome(State.TARGET_MISSING, missing)
        record.fingerprints = fingerprints = {path: fingerprint(raw) for path, raw in originals.items()}
        states = {name: (other.state, other.reason) for name, other in self._records.items() if name in patch.after}
        return (kind_refusal(patch, originals) or gates.prerequisite_refusal(patch, states)
                or gates.owned_flag_refusal(patch) or install(patch, module, owners, originals, fingerprints, note))

    def _bring_in_prerequisites(self, patch: Patch) -> None:
        """Apply the prerequisites whose targets are imported and still pending."""
        for other in filter(None, map(self._records.get, patch.after)):
            module = sys.modules.get(other.entry.target)
            if other.state is State.PENDING and module is not None and not import_hooks.is_initializing(module):
                self.apply_to_module(other.entry.name, module)

    def revert(self, name: str) -> State:
        """Restore the originals of `name` where the current values are still ours."""
        record = self.record(name)
        with self._lock:
            for dependent in self._records.values():  # what was built on top goes first
                if name in dependent.entry.after and dependent.installed:
                    self.revert(dependent.entry.name)
            for owner, attribute, ours, original in record.aliases:
                if same(read_raw(owner, attribute), ours):
                    set_raw(owner, attribute, original)
            record.aliases.clear()
            self._notice_override(record)
            if record.state not in (State.APPLIED, State.OVERRIDDEN) or not record.installed:
                return record.state  # not applied, or applied by another copy: nothing of ours to undo
            kept = []
            for path, owner, attribute, still_ours in _installed_places(record):
                if still_ours:
                    set_raw(owner, attribute, record.originals[path])
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
        if record.state is not State.APPLIED or not record.installed or record.entry.target not in sys.modules:
            return
        replaced = next((path for path, _, _, still_ours in _installed_places(record) if not still_ours), None)
        if replaced is not None:
            record.set(State.OVERRIDDEN, f"{replaced} was replaced after we applied")

    def import_targets(self) -> None:
        """Import every target that passed the early gates (the CLI's --import)."""
        for record in list(self._records.values()):
            if record.entry.name in self._hooked:
                self.import_target(record)  # the post-import hook applies it


def _installed_places(record: PatchRecord):
    """(path, owner, attribute, whether our value is still there) of what `record` installed."""
    module = sys.modules.get(record.entry.target)
    for path in record.installed:
        try:
            owner, attribute, current = look_up(module, path)
        except AttributeError:  # its owner is gone
            yield path, None, path, False
        else:
            yield path, owner, attribute, same(current, record.installed[path])


_PROCESS_REGISTRY: Registry | None = None
_PROCESS_LOCK = threading.Lock()


def process_registry() -> Registry:
    """The registry of this process, built on first use from the catalogue (no declaration is imported)."""
    global _PROCESS_REGISTRY
    with _PROCESS_LOCK:
        if _PROCESS_REGISTRY is None:
            from lmcache_ascend.patches.catalogue import CATALOGUE

            _PROCESS_REGISTRY = Registry(CATALOGUE)
        return _PROCESS_REGISTRY
