"""Whether a patch goes in: the flags, the installed versions, upstream's own fix, the host and
the prerequisites, each answering with the skip it decides or None (changing no record,
importing no target; activation needs only the flag gate and a file lookup).
"""

from __future__ import annotations

import types
from typing import Mapping

from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat.source import module_is_locatable
from lmcache_ascend.patches.install import Outcome
from lmcache_ascend.patches.model import CatalogueEntry, Patch, State


def flag_gate(entry: CatalogueEntry, flag_values: Mapping[str, object]) -> Outcome | None:
    if not flag_values["LMCACHE_ASCEND_PATCHES"]:
        return Outcome(State.SKIPPED_DISABLED, "LMCACHE_ASCEND_PATCHES=0")
    disabled = flag_values["LMCACHE_ASCEND_DISABLED_PATCHES"]
    if "*" in disabled or entry.name in disabled:
        return Outcome(State.SKIPPED_DISABLED, "listed in LMCACHE_ASCEND_DISABLED_PATCHES")
    if entry.enabled_by is not None and not flag_values[entry.enabled_by]:
        return Outcome(State.SKIPPED_DISABLED, f"off by default; set {entry.enabled_by}=1")
    return None


def before_import(entry: CatalogueEntry, flag_values: Mapping[str, object]) -> Outcome | None:
    """What can be decided without the target or the declaration; None: it waits for the import."""
    skip = flag_gate(entry, flag_values)
    if skip is not None or module_is_locatable(entry.target):  # a cheap file lookup
        return skip
    return missing_target(entry)


def missing_target(entry: CatalogueEntry) -> Outcome:
    """Why `entry`'s target is not there: its package is absent, or usually a version the patch is not for."""
    reason = f"module {entry.target} not found"
    if not module_is_locatable(entry.target.partition(".")[0]):  # not even its package is there
        return Outcome(State.TARGET_MISSING, reason, distribution_missing=True)
    # vllm-ascend 0.18 has no DeepSeek-V4 code: say so.
    skip, _ = version_gate(entry)
    if skip is not None and skip.state is State.SKIPPED_VERSION:
        return skip
    return Outcome(State.TARGET_MISSING, reason, distribution_missing=bool(skip and skip.distribution_missing))


def version_gate(patch: Patch | CatalogueEntry) -> tuple[Outcome | None, str]:
    """(None, the versions found) when every requirement holds, else (the skip, ""); without
    `packaging` (a bare interpreter) the check lets the patch through."""
    from lmcache_ascend.compat.versions import installed_version, version_satisfies

    notes = []
    for distribution, specifier in patch.requires.items():
        version = installed_version(distribution)
        if version is None:
            return Outcome(State.TARGET_MISSING, f"{distribution} is not installed", distribution_missing=True), ""
        try:
            verdict = version_satisfies(version, specifier)
        except ValueError as error:  # packaging's InvalidSpecifier
            return Outcome(State.SKIPPED_VERSION, f"invalid requirement for {distribution}: {error}"), ""
        if verdict is False:
            return Outcome(State.SKIPPED_VERSION, f"{distribution} {version} is outside {specifier}"), ""
        notes.append(f"{distribution} {version}" + (" (unchecked: packaging missing)" if verdict is None else ""))
    return None, ", ".join(notes)


def decide(patch: Patch, module: types.ModuleType | None) -> tuple[Outcome | None, str]:
    """Upstream guard, version gate, host: (None, why it applies) or (the skip, "")."""
    from lmcache_ascend.compat.guards import Verdict, evaluate_guard

    guard = evaluate_guard(patch.guard, patch.target, module)
    if guard.verdict is Verdict.HAS_FIX:
        return Outcome(State.SKIPPED_UPSTREAM, f"upstream has it ({guard.how})"), ""
    skip, versions_note = version_gate(patch)
    if skip is not None:
        return skip, ""
    if module is not None and patch.host is not None:  # the host is asked only where it applies
        other_host = patch.host()
        if other_host:
            return Outcome(State.SKIPPED_HOST, f"{other_host}; {versions_note}"), ""
    return None, f"{versions_note}; guard: {guard.verdict.value} ({guard.how})"


def prerequisite_refusal(patch: Patch, states: Mapping[str, tuple[State, str]]) -> Outcome | None:
    """Why `patch` can't go in for its prerequisites (`states`: name -> (state, reason)), or None."""
    for prerequisite in patch.after:
        if prerequisite not in states:
            return Outcome(State.FAILED, f"needs patch {prerequisite!r}, which is not declared")
        state, reason = states[prerequisite]
        if state not in (State.APPLIED, State.SKIPPED_UPSTREAM):
            # A prerequisite's skips are its dependents'; any other state that is not in fails them.
            inherited = state in (State.SKIPPED_DISABLED, State.SKIPPED_VERSION, State.SKIPPED_HOST)
            return Outcome(state if inherited else State.FAILED,
                           f"needs {prerequisite}, which is {state.value}: {reason}")
    return None


def owned_flag_refusal(patch: Patch) -> Outcome | None:
    """What is wrong with the flags `patch` owns, checked when it goes in (activation leaves them
    alone: upstream may read them by its own rules), or None."""
    problems = []
    for name in patch.flags:
        if not flag_table.get_flag(name).owned_by_patches:
            continue  # validated at activation
        try:
            flag_table.flag_value(name)
        except flag_table.FlagError as error:
            problems.append(str(error))
    return Outcome(State.FAILED, "; ".join(problems)) if problems else None
