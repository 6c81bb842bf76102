"""A patch's upstream guard (how to tell upstream already has the change) and its evaluation."""

from __future__ import annotations

import enum
import types
from typing import Callable, NamedTuple

from lmcache_ascend.compat.source import module_source_text


class Verdict(enum.Enum):
    HAS_FIX = "has-fix"
    LACKS_FIX = "lacks-fix"
    UNKNOWN = "unknown"


class UpstreamGuard(NamedTuple):
    """``probe`` answers on the imported target: True (upstream has it), False (it lacks it) or None;
    without the import, or without an answer, the target's source is searched for the strings.
    Where neither answers, the version requirements decide alone."""

    probe: Callable[[types.ModuleType], bool | None] | None = None
    fixed_if_source_contains: tuple[str, ...] = ()
    unfixed_if_source_contains: tuple[str, ...] = ()


class GuardResult(NamedTuple):
    verdict: Verdict
    how: str  # a few words for the CLI: which test decided


def evaluate_guard(guard: UpstreamGuard, target: str, module: types.ModuleType | None) -> GuardResult:
    """What `guard` says about `target`; `module` is None when it must not be imported."""
    if module is not None and guard.probe is not None:
        try:
            answer = guard.probe(module)
        except Exception as error:  # a probe that trips on a changed module can't tell
            answer = None
            probe_note = f"probe raised {type(error).__name__}: {error}"
        else:
            probe_note = "probe could not tell"
        if isinstance(answer, bool):
            return GuardResult(Verdict.HAS_FIX if answer else Verdict.LACKS_FIX, "capability probe")
    else:
        probe_note = "no probe" if guard.probe is None else "probe needs the import"

    if not (guard.fixed_if_source_contains or guard.unfixed_if_source_contains):
        return GuardResult(Verdict.UNKNOWN, probe_note)
    text = module_source_text(target)
    if text is None:
        return GuardResult(Verdict.UNKNOWN, f"{probe_note}; no source for {target}")
    # The probe's note stays in the answer: "could not tell" is worth seeing in the state.
    found = [(Verdict.HAS_FIX, needle) for needle in guard.fixed_if_source_contains if needle in text]
    found += [(Verdict.LACKS_FIX, needle) for needle in guard.unfixed_if_source_contains if needle in text]
    if found:
        return GuardResult(found[0][0], f"{probe_note}; source has {found[0][1]!r}")
    return GuardResult(Verdict.UNKNOWN, f"{probe_note}; source markers absent")
