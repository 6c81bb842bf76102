"""The declaration of a patch and the vocabulary around it (standard library only)."""

from __future__ import annotations

import enum
import functools
import inspect
import types
from typing import Any, Callable, Mapping

from lmcache_ascend.compat.source import function_behind


def _no_guard() -> object:
    from lmcache_ascend.compat.guards import UpstreamGuard

    return UpstreamGuard()


# A module-level wrapper, wrapt's convention: ``wrapper(wrapped, instance, args, kwargs)``, where
# ``wrapped`` is the original bound to ``instance`` (the object, the class for a classmethod,
# None for a function or staticmethod); it returns what the call returns.
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


class _Missing:
    """Marks an attribute absent from its owner's ``__dict__`` (falsy)."""

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


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


# The states each state may go to (`PatchRecord.set` refuses the rest): a decided record goes
# back to pending only to be decided again, and fails when its declaration does not load.
_DECIDED = (State.SKIPPED_DISABLED, State.SKIPPED_VERSION, State.SKIPPED_UPSTREAM, State.SKIPPED_HOST,
            State.TARGET_MISSING)
TRANSITIONS: dict[State, frozenset[State]] = {
    State.PENDING: frozenset(State) - {State.REVERTED, State.OVERRIDDEN},
    State.APPLIED: frozenset({State.REVERTED, State.OVERRIDDEN}),
    State.OVERRIDDEN: frozenset({State.OVERRIDDEN, State.REVERTED, State.PENDING}),
    State.REVERTED: frozenset({State.PENDING}),
    State.FAILED: frozenset({State.FAILED, State.PENDING}),
    **{state: frozenset({State.PENDING, State.FAILED}) for state in _DECIDED},
}

# Patch's fields: (name, default factory); None for the required ones.
_PATCH_FIELDS: dict[str, Callable[[], object] | None] = {
    "name": None, "target": None, "attributes": None, "kind": None,
    "summary": None, "why": None, "mirrors": None, "delete_when": None,
    "build": lambda: None,  # Callable[[PatchContext], Mapping[str, object]] | None
    "wrappers": dict,  # Mapping[str, Wrapper]
    "requires": dict,  # Mapping[distribution, PEP 440 specifier]
    "guard": _no_guard,  # UpstreamGuard
    "flags": tuple,
    "enabled_by": lambda: None,
    "host": lambda: None,  # None (any host), or a callable: None on a host it serves, else why not
    "after": tuple,  # patches that must be in (applied, or found upstream) before this one
    "tested_fingerprints": dict,  # Mapping[attribute path, tuple of fingerprints]
}


class Patch:
    """One change to one upstream module (immutable; keywords only): ``wrappers`` put `Wrapper` functions
    around the originals, ``build(PatchContext)`` returns the other paths' values.  A plain class: a frozen
    dataclass costs milliseconds of activation."""

    def __init__(self, **fields: object) -> None:
        missing = [name for name, default in _PATCH_FIELDS.items() if default is None and name not in fields]
        unknown = sorted(set(fields) - set(_PATCH_FIELDS))
        if missing or unknown:
            raise TypeError(f"Patch({fields.get('name')!r}): missing fields {missing}, unknown fields {unknown}")
        for name, default in _PATCH_FIELDS.items():
            object.__setattr__(self, name, fields[name] if name in fields else default())
        self._check()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Patch {self.name!r} is immutable: use .replace({name}=...)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Patch {self.name!r} is immutable")

    def __repr__(self) -> str:
        return f"Patch(name={self.name!r}, target={self.target!r}, kind={self.kind})"

    def replace(self, **changes: object) -> "Patch":
        return Patch(**{**{name: getattr(self, name) for name in _PATCH_FIELDS}, **changes})

    def _check(self) -> None:
        problems = []
        if not self.name or self.name != self.name.strip() or " " in self.name:
            problems.append(f"name {self.name!r} must be a non-empty word without spaces")
        if not self.attributes:
            problems.append("attributes must name at least one attribute")
        problems += [f"attribute path {path!r} is not a dotted name" for path in self.attributes
                     if not path or path.startswith(".") or path.endswith(".")]
        if self.name in self.after:
            problems.append("a patch can't come after itself")
        for field in ("tested_fingerprints", "wrappers"):
            problems += [f"{field} names {path!r}, which is not among attributes" for path in getattr(self, field)
                         if path not in self.attributes]
        if self.build is None and set(self.wrappers) != set(self.attributes):
            unbuilt = sorted(set(self.attributes) - set(self.wrappers))
            problems.append(f"no build and no wrapper for {', '.join(unbuilt)}")
        if self.wrappers and self.kind is PatchKind.ADD:
            problems.append("an ADD patch has nothing to wrap")
        if problems:
            raise ValueError(f"patch {self.name!r}: " + "; ".join(problems))


class CatalogueEntry:
    """What activation knows of a patch without importing its declaration: enough to gate it and
    hook its target.  ``module`` declares it (None for a `Patch` given to a `Registry` directly)."""

    __slots__ = ("name", "module", "target", "requires", "flags", "enabled_by", "after")

    def __init__(self, name: str, *, module: str | None, target: str, requires: Mapping[str, str],
                 flags: tuple[str, ...] = (), enabled_by: str | None = None, after: tuple[str, ...] = ()) -> None:
        self.name, self.module, self.target = name, module, target
        self.requires, self.flags, self.enabled_by, self.after = dict(requires), tuple(flags), enabled_by, tuple(after)

    @classmethod
    def of(cls, patch: "Patch", module: str | None) -> "CatalogueEntry":
        return cls(patch.name, module=module, target=patch.target, requires=patch.requires, flags=patch.flags,
                   enabled_by=patch.enabled_by, after=patch.after)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CatalogueEntry):
            return NotImplemented
        return all(getattr(self, field) == getattr(other, field) for field in self.__slots__)

    __hash__ = None  # mutable containers inside: compared, never hashed

    def __repr__(self) -> str:
        fields = ", ".join(f"{field}={getattr(self, field)!r}" for field in self.__slots__)
        return f"CatalogueEntry({fields})"


def split_attribute_path(path: str) -> tuple[str, str]:
    """``"Cls.Inner.meth"`` -> (``"Cls.Inner"``, ``"meth"``); a module-level name has owner ``""``."""
    return path.rpartition(".")[::2]


def resolve_owner(module: types.ModuleType, owner_path: str) -> object:
    return functools.reduce(getattr, filter(None, owner_path.split(".")), module)


def read_raw(owner: object, name: str) -> object:
    """The raw value stored on `owner` for `name` (no descriptor binding, no inheritance)."""
    if isinstance(owner, type) and name == "__bases__":  # not in __dict__, but set and restored
        return getattr(owner, name)
    return vars(owner).get(name, MISSING)


def look_up(module: types.ModuleType, path: str) -> tuple[object, str, object]:
    """(owner, attribute name, raw value) of `path` on `module`; AttributeError if its owner is gone."""
    owner_path, name = split_attribute_path(path)
    owner = resolve_owner(module, owner_path)
    return owner, name, read_raw(owner, name)


class PatchContext:
    """What a patch's ``build`` may look at: the target module and its originals."""

    def __init__(self, patch: Patch, module: types.ModuleType):
        self.patch = patch
        self.module = module

    def original(self, path: str) -> object:
        """The raw original (e.g. the classmethod object itself), or MISSING."""
        return look_up(self.module, path)[2]

    def original_function(self, path: str) -> Callable[..., Any]:
        """The plain function behind an attribute, own or inherited, for wrapping."""
        owner, name, raw = look_up(self.module, path)
        if raw is MISSING:
            raw = getattr(owner, name)
            raw = getattr(raw, "__func__", raw)  # inherited classmethod comes back bound
        return function_behind(raw)

    def wrapped(self, path: str, wrapper: Wrapper) -> object:
        """The value for `path` that calls `wrapper` around the original (`wrapped_member`)."""
        return wrapped_member(*look_up(self.module, path), wrapper)


def adds_keywords(**defaults: object) -> Callable[[Wrapper], Wrapper]:
    """Declare the keyword-only arguments a wrapper pops from ``kwargs``: the installed signature shows them."""

    def declare(wrapper: Wrapper) -> Wrapper:
        wrapper.added_keywords = dict(defaults)
        return wrapper

    return declare


def wrapped_member(owner: object, name: str, raw: object, wrapper: Wrapper) -> object:
    """The value for `owner.name` (raw value `raw`, MISSING when inherited) that calls `wrapper`, bound as `raw` is."""
    if raw is MISSING:
        raw = inspect.getattr_static(owner, name)
    if isinstance(raw, property):
        raise TypeError(f"{name} is a property: wrap its getter with a build instead")
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if isinstance(raw, classmethod):
        def call(cls, *args, **kwargs):
            return wrapper(types.MethodType(function, cls), cls, args, kwargs)
    elif isinstance(raw, staticmethod) or not isinstance(owner, type):  # or a module's function
        def call(*args, **kwargs):
            return wrapper(function, None, args, kwargs)
    else:
        def call(self, *args, **kwargs):
            return wrapper(types.MethodType(function, self), self, args, kwargs)
    call = _like(call, function, wrapper)
    for method_kind in (staticmethod, classmethod):
        if isinstance(raw, method_kind):
            return method_kind(call)
    return call


def _like(call: Callable[..., Any], original: Callable[..., Any], wrapper: Wrapper) -> Callable[..., Any]:
    """`call` with the original's name, doc and signature (plus the wrapper's added keywords)."""
    functools.update_wrapper(call, original)
    added = getattr(wrapper, "added_keywords", None)
    if added:  # keyword-only, before any **kwargs
        signature = inspect.signature(original)
        parameters = list(signature.parameters.values())
        at = len(parameters) - (1 if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD else 0)
        extra = [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=value) for key, value in added.items()]
        call.__signature__ = signature.replace(parameters=parameters[:at] + extra + parameters[at:])
    return call
