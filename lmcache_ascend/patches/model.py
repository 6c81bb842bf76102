"""The declaration of a patch and the vocabulary around it (standard library only)."""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class _Missing:
    """Marks an attribute absent from its owner's ``__dict__``."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()

# Attributes of a class that are not in its __dict__ but can still be set and restored.
TYPE_SLOT_ATTRIBUTES = frozenset({"__bases__"})


class PatchKind(enum.Enum):
    WRAP = "wrap"  # the new value calls the original
    REPLACE = "replace"  # the new value stands in for the original, which must exist
    ADD = "add"  # the attribute must not exist before


class State(enum.Enum):
    PENDING = "pending"
    APPLIED = "applied"
    SKIPPED_DISABLED = "skipped-disabled"
    SKIPPED_VERSION = "skipped-version"
    SKIPPED_UPSTREAM = "skipped-upstream-has-it"
    SKIPPED_HOST = "skipped-host"
    TARGET_MISSING = "target-missing"
    FAILED = "failed"
    REVERTED = "reverted"
    OVERRIDDEN = "overridden"


class Verdict(enum.Enum):
    """What a source guard found out about upstream."""

    HAS_FIX = "has-fix"
    LACKS_FIX = "lacks-fix"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class UpstreamGuard:
    """How to tell that upstream already has what a patch adds.

    ``probe`` inspects the imported target module and answers True (upstream has
    it), False (it lacks it) or None (can't tell); it is the first and strongest
    test.  Without an import (the listing CLI), or when the probe can't tell, the
    target module's source text is searched: any of ``fixed_if_source_contains``
    means upstream has it, any of ``unfixed_if_source_contains`` means it lacks
    it.  When neither answers (no source, e.g. a .pyc-only install) the verdict is
    UNKNOWN and the patch's version requirements decide alone.
    """

    probe: Callable[[types.ModuleType], bool | None] | None = None
    fixed_if_source_contains: tuple[str, ...] = ()
    unfixed_if_source_contains: tuple[str, ...] = ()


@dataclass(frozen=True)
class Patch:
    """One change to one upstream module, declared once.

    ``build`` receives a `PatchContext` and returns the raw values to install,
    keyed by the dotted attribute paths of ``attributes`` (all of them, no
    more): the framework installs all or none, marks what it installs and can
    restore the originals.
    """

    name: str
    target: str
    attributes: tuple[str, ...]
    kind: PatchKind
    build: Callable[["PatchContext"], Mapping[str, object]]
    summary: str
    why: str
    mirrors: str
    delete_when: str
    requires: Mapping[str, str] = field(default_factory=dict)
    guard: UpstreamGuard = field(default_factory=UpstreamGuard)
    flags: tuple[str, ...] = ()
    enabled_by: str | None = None
    # The machines the patch is for: None (any), or a callable answering None on
    # such a host and the reason otherwise; asked when the target is imported.
    host: Callable[[], str | None] | None = None
    # Patches that must be in (applied, or found upstream) before this one.
    after: tuple[str, ...] = ()
    tested_fingerprints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not self.name or self.name != self.name.strip() or " " in self.name:
            problems.append(f"name {self.name!r} must be a non-empty word without spaces")
        if not self.attributes:
            problems.append("attributes must name at least one attribute")
        for path in self.attributes:
            if not path or path.startswith(".") or path.endswith("."):
                problems.append(f"attribute path {path!r} is not a dotted name")
        if self.name in self.after:
            problems.append("a patch can't come after itself")
        for path in self.tested_fingerprints:
            if path not in self.attributes:
                problems.append(f"tested_fingerprints names {path!r}, which is not among attributes")
        if problems:
            raise ValueError(f"patch {self.name!r}: " + "; ".join(problems))


def split_attribute_path(path: str) -> tuple[str, str]:
    """``"Cls.Inner.meth"`` -> (``"Cls.Inner"``, ``"meth"``); a module-level name has owner ``""``."""
    owner, _, name = path.rpartition(".")
    return owner, name


def resolve_owner(module: types.ModuleType, owner_path: str) -> object:
    """The object that owns an attribute: the module itself or a (nested) class in it."""
    owner: object = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    return owner


def read_raw(owner: object, name: str) -> object:
    """The raw value stored on `owner` for `name` (no descriptor binding, no inheritance)."""
    if isinstance(owner, type) and name in TYPE_SLOT_ATTRIBUTES:
        return getattr(owner, name)
    return vars(owner).get(name, MISSING)


class PatchContext:
    """What a patch's ``build`` may look at: the target module and its originals."""

    def __init__(self, patch: Patch, module: types.ModuleType):
        self.patch = patch
        self.module = module

    def owner(self, path: str) -> object:
        return resolve_owner(self.module, split_attribute_path(path)[0])

    def original(self, path: str) -> object:
        """The raw original (e.g. the classmethod object itself), or MISSING."""
        owner_path, name = split_attribute_path(path)
        return read_raw(resolve_owner(self.module, owner_path), name)

    def original_function(self, path: str) -> Callable[..., Any]:
        """The plain function behind an attribute, own or inherited, for wrapping."""
        raw = self.original(path)
        if raw is MISSING:
            raw = getattr(self.owner(path), split_attribute_path(path)[1])
            raw = getattr(raw, "__func__", raw)  # inherited classmethod comes back bound
        if isinstance(raw, (classmethod, staticmethod)):
            return raw.__func__
        if isinstance(raw, property):
            return raw.fget
        return raw
