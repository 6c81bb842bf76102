"""Marks on the objects lmcache-ascend installs, so that nothing is applied twice: found through
``__wrapped__`` chains too, so a wrapper someone else put around ours still reads as patched.
"""

from __future__ import annotations

from lmcache_ascend.compat.source import function_behind

MARKER_ATTRIBUTE = "__lmcache_ascend_patch__"


def _carriers(value: object) -> list[object]:
    """`value` and the function behind a classmethod or staticmethod; a property's getter."""
    return [value, value.__func__] if isinstance(value, (classmethod, staticmethod)) else [function_behind(value)]


def mark(value: object, patch_name: str) -> None:
    """Record on `value` that `patch_name` installed it (where it can carry attributes)."""
    for carrier in _carriers(value):
        names = tuple(getattr(carrier, MARKER_ATTRIBUTE, ()))
        if patch_name in names:
            continue
        try:
            setattr(carrier, MARKER_ATTRIBUTE, names + (patch_name,))
        except (AttributeError, TypeError):
            pass  # builtins and tuples can't carry attributes


def patch_names_on(value: object, max_depth: int = 32) -> set[str]:
    """Every patch name marked on `value` or on anything it wraps."""
    found: set[str] = set()
    pending = _carriers(value)
    seen: set[int] = set()
    while pending and len(seen) < max_depth:
        carrier = pending.pop()
        if carrier is None or id(carrier) in seen:
            continue
        seen.add(id(carrier))
        # Only the object's own mark counts: a class inherits attributes from its bases.
        own = vars(carrier).get(MARKER_ATTRIBUTE, ()) if hasattr(carrier, "__dict__") else ()
        found.update(own)
        pending.extend(_carriers(getattr(carrier, "__wrapped__", None)))
    return found
