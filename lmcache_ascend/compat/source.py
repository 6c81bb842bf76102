"""Finding a module's source text without importing it, and fingerprints of targets.

The listing CLI evaluates source guards without importing patch targets, so it
locates ``pkg/sub/mod.py`` on ``sys.path`` itself (``importlib.util.find_spec``
would import the parent packages, i.e. all of vLLM).  A ``.pyc``-only install
has no source: the guard then answers "unknown" and the version gate decides.
"""

from __future__ import annotations

import functools
import os
import sys
import types


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


def module_directory(module_name: str) -> str | None:
    """The sys.path entry holding `module_name` as source, bytecode or a package (no import).

    A plain file-system search: asking the import system's finders instead would
    run every meta-path finder, the start-up hook's among them, which activates
    this package from inside its own activation.
    """
    module = sys.modules.get(module_name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin:
        return os.path.dirname(os.path.dirname(origin) if origin.endswith("__init__.py") else origin)
    parts = module_name.split(".")
    for entry in sys.path:
        root = entry or os.getcwd()
        if _found_in(root, parts):
            return root
    return None


def _found_in(root: str, parts: list[str]) -> bool:
    base = os.path.join(root, *parts)
    for suffix in (".py", ".pyc", os.sep + "__init__.py", os.sep + "__init__.pyc"):
        if os.path.isfile(base + suffix):
            return True
    return os.path.isdir(base) and os.path.isdir(os.path.join(base, "__pycache__"))


def module_is_locatable(module_name: str) -> bool:
    """Whether `module_name` exists on sys.path as source or bytecode (no import).

    A submodule is looked for beside its top-level package first (one entry, not
    all of sys.path: activation asks this for every patch target).
    """
    if module_name in sys.modules:
        return True
    top, dot, _ = module_name.partition(".")
    root = module_directory(top) if top in sys.modules else _package_root(top, tuple(sys.path))
    if root is None or not dot:
        return root is not None
    if _found_in(root, module_name.split(".")):
        return True
    # A namespace package may spread over several entries.
    return module_directory(module_name) is not None


@functools.lru_cache(maxsize=64)
def _package_root(package: str, search_path: tuple[str, ...]) -> str | None:
    """`module_directory` of a top-level package not imported yet, for one sys.path (cached:
    activation asks it for every patch target)."""
    for entry in search_path:
        root = entry or os.getcwd()
        if _found_in(root, [package]):
            return root
    return None


def module_source_text(module_name: str) -> str | None:
    path = module_source_path(module_name)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def _code_object_of(value: object) -> object:
    """The object whose source defines `value` (functions behind descriptors)."""
    if isinstance(value, (classmethod, staticmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value


# The fingerprint of code whose source can't be read (a .pyc-only install, generated
# code): never a hash, so it is untested unless a patch lists it as tested.
NO_SOURCE = "no-source"


def fingerprint(value: object) -> str | None:
    """A short hash of the source of a patch target; `NO_SOURCE` for code without
    readable source; None for data (fingerprints cover code only).

    Blank lines and trailing blanks are ignored so that re-indenting a file's
    whitespace does not read as a different target.
    """
    import hashlib  # lazily: only the CLI and apply time need fingerprints
    import inspect

    target = _code_object_of(value)
    if not isinstance(target, (types.FunctionType, type, types.MethodType)):
        return None
    try:
        text = inspect.getsource(target)
    except (OSError, TypeError):
        return NO_SOURCE
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]
