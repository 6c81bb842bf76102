"""Finding a module's source text without importing it, and fingerprints of targets.

The listing CLI evaluates source guards without importing patch targets, so it locates
``pkg/sub/mod.py`` on ``sys.path`` itself (``importlib.util.find_spec`` would import the parent
packages, i.e. all of vLLM, and run every meta-path finder, the start-up hook's among them).
A ``.pyc``-only install has no source: the guard then answers "unknown".
"""

from __future__ import annotations

import functools
import os
import sys
import types

# The fingerprint of code whose source can't be read (a .pyc-only install, generated code):
# never a hash, so it is untested unless a patch lists it as tested.
NO_SOURCE = "no-source"


def module_source_path(module_name: str) -> str | None:
    """Path of the .py file of `module_name` (imported or not), or None when there is none."""
    module = sys.modules.get(module_name)
    if module is not None:
        path = getattr(module, "__file__", None)
        return path if path and path.endswith(".py") and os.path.exists(path) else None
    parts = module_name.split(".")
    for entry in sys.path:
        base = os.path.join(entry or os.getcwd(), *parts)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def _found_in(root: str, parts: tuple[str, ...]) -> bool:
    base = os.path.join(root, *parts)
    for suffix in (".py", ".pyc", os.sep + "__init__.py", os.sep + "__init__.pyc"):
        if os.path.isfile(base + suffix):
            return True
    return os.path.isdir(base) and os.path.isdir(os.path.join(base, "__pycache__"))


def _root_holding(parts: tuple[str, ...], search_path: tuple[str, ...]) -> str | None:
    for entry in search_path:
        if _found_in(entry or os.getcwd(), parts):
            return entry or os.getcwd()
    return None


@functools.lru_cache(maxsize=64)
def _package_root(package: str, search_path: tuple[str, ...]) -> str | None:
    """`_root_holding` a top-level package not imported yet (cached: activation asks for every target)."""
    return _root_holding((package,), search_path)


def module_directory(module_name: str) -> str | None:
    """The sys.path entry holding `module_name` as source, bytecode or a package (no import)."""
    module = sys.modules.get(module_name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin:
        return os.path.dirname(os.path.dirname(origin) if origin.endswith("__init__.py") else origin)
    return _root_holding(tuple(module_name.split(".")), tuple(sys.path))


def module_is_locatable(module_name: str) -> bool:
    """Whether `module_name` exists on sys.path as source or bytecode (no import); a submodule is
    looked for beside its top-level package first (one entry, not all of sys.path)."""
    if module_name in sys.modules:
        return True
    top, dot, _ = module_name.partition(".")
    root = module_directory(top) if top in sys.modules else _package_root(top, tuple(sys.path))
    if root is None or not dot:
        return root is not None
    # A namespace package may spread over several entries.
    return _found_in(root, tuple(module_name.split("."))) or module_directory(module_name) is not None


def module_source_text(module_name: str) -> str | None:
    path = module_source_path(module_name)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def function_behind(value: object) -> object:
    """The function behind a raw attribute value (a classmethod's, a property's getter), or `value`."""
    if isinstance(value, (classmethod, staticmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value


def fingerprint(value: object) -> str | None:
    """A short hash of the source of a patch target, blank lines and trailing blanks ignored;
    `NO_SOURCE` for code without readable source; None for data (fingerprints cover code only)."""
    import hashlib  # lazily: only the CLI and apply time need fingerprints
    import inspect

    target = function_behind(value)
    if not isinstance(target, (types.FunctionType, type, types.MethodType)):
        return None
    try:
        text = inspect.getsource(target)
    except (OSError, TypeError):
        return NO_SOURCE
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]
