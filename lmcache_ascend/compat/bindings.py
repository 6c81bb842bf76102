"""Other modules' names for an object a patch replaces.

``from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator`` copies the function
into the importer: activated after such an import (vLLM's plugin entry point, an explicit
`activate()`), the registry re-binds those names too, and puts them back on revert.
"""

from __future__ import annotations

import sys
import types

# Values that equal-by-identity can't tell apart from an unrelated constant.
_SHARED_BY_ACCIDENT = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset)


def is_defined_in(value: object, module: types.ModuleType) -> bool:
    """Whether `module` is the home of `value` (its ``__module__``; data lives where it is found)."""
    if isinstance(value, (types.ModuleType,) + _SHARED_BY_ACCIDENT):
        return False
    home = getattr(value, "__module__", None)
    return home is None or not isinstance(home, str) or home == module.__name__


def rebind_aliases(home: types.ModuleType, replaced: list[tuple[object, object]], exclude_prefix: str) -> tuple:
    """Rebind the loaded modules' names (but `home`'s and `exclude_prefix`'s) for the originals defined in
    `home` to ours; returns each (module, name, ours, original) it rebound."""
    wanted = {id(original): (original, ours) for original, ours in replaced if is_defined_in(original, home)}
    if not wanted:
        return ()
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module is home or module_name.split(".", 1)[0] == exclude_prefix:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, bound in list(namespace.items()):
            original, ours = wanted.get(id(bound), (None, None))
            if original is not None and bound is original:
                setattr(module, key, ours)
                rebound.append((module, key, ours, original))
    return tuple(rebound)
