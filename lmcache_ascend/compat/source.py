"""Finding a module and its source without importing it, and fingerprints of targets.

``importlib.util.find_spec`` would import the parent packages (all of vLLM) and run every
meta-path finder: the listing CLI and activation look ``pkg/sub/mod.py`` up on ``sys.path``.
"""

from __future__ import annotations

import functools
import os
import sys
import types

# The fingerprint of code without readable source: untested unless a patch lists it.
NO_SOURCE = "no-source"


def _found_in(root: str, parts: tuple[str, ...]) -> bool:
    base = os.path.join(root, *parts)
    if any(os.path.isfile(base + end) for end in (".py", ".pyc", os.sep + "__init__.py", os.sep + "__init__.pyc")):
        return True
    return os.path.isdir(base) and os.path.isdir(os.path.join(base, "__pycache__"))


def _root_holding(parts: tuple[str, ...], search_path: tuple[str, ...]) -> str | None:
    return next((entry or os.getcwd() for entry in search_path if _found_in(entry or os.getcwd(), parts)), None)


@functools.lru_cache(maxsize=64)
def _package_root(package: str, search_path: tuple[str, ...]) -> str | None:
    # Cached: activation asks for every target.
    return _root_holding((package,), search_path)


def module_directory(module_name: str) -> str | None:
    """The sys.path entry holding `module_name` as source, bytecode or a package (no import)."""
    module = sys.modules.get(module_name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin:
        return os.path.dirname(os.path.dirname(origin) if origin.endswith("__init__.py") else origin)
    return _root_holding(tuple(module_name.split(".")), tuple(sys.path))


def module_is_locatable(module_name: str) -> bool:
    """Whether `module_name` exists on sys.path (no import), looked for beside its top-level package first."""
    if module_name in sys.modules:
        return True
    top, dot, _ = module_name.partition(".")
    root = module_directory(top) if top in sys.modules else _package_root(top, tuple(sys.path))
    if root is None or not dot:
        return root is not None
    # A namespace package may spread over several entries.
    return _found_in(root, tuple(module_name.split("."))) or module_directory(module_name) is not None


def module_source_text(module_name: str) -> str | None:
    """The source of `module_name` (imported or not), or None where it has no readable .py file."""
    module = sys.modules.get(module_name)
    if module is not None:
        path = getattr(module, "__file__", None) or ""
        candidates = [path] if path.endswith(".py") else []
    else:
        parts = module_name.split(".")
        candidates = [os.path.join(entry or os.getcwd(), *parts) + suffix
                      for entry in sys.path for suffix in (".py", os.sep + "__init__.py")]
    path = next((path for path in candidates if os.path.isfile(path)), None)
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
