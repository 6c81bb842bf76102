"""Post-import hooks: call a function the moment a module has finished executing.

wrapt's mechanism in the standard library (importing wrapt costs more than the activation
budget): a meta-path finder in front of the others wraps the loader of a module with pending
hooks, which run right after its code; a module already imported gets them at once.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Callable

from lmcache_ascend.compat import interpreter

Hook = Callable[[types.ModuleType], None]

_lock = threading.RLock()
_pending: dict[str, list[Hook]] = {}
_bodies_done: set[str] = set()  # executed by our loader, hooks running: complete for the hooks
_deferred: dict[str, list[Hook]] = {}  # modules half imported by the registering thread
_finding: set[str] = set()  # names being looked up by us (no recursion into ourselves)
_every_execution: dict[str, list[Hook]] = {}  # also at each later run of the body


def register_post_import_hook(module_name: str, hook: Hook, *, every_execution: bool = False) -> None:
    """Run `hook(module)` once `module_name` is imported (now, if it already is; after the end of a
    body still running).  With `every_execution` (a hook that refuses an import must refuse the
    next attempt too), it also runs at each later execution of the body, so it must be idempotent.
    """
    if every_execution:
        _add(_every_execution, module_name, hook)
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _add(_pending, module_name, hook)
            return
    if is_initializing(module) and not interpreter.wait_for_import_elsewhere(module_name):
        _add(_deferred, module_name, hook)  # this thread is inside that import: at the next import after it
        return
    module = sys.modules.get(module_name)
    if module is None:  # that import failed: the next one runs the hook
        _add(_pending, module_name, hook)
        return
    hook(module)


def _add(hooks: dict[str, list[Hook]], module_name: str, hook: Hook) -> None:
    with _lock:
        hooks.setdefault(module_name, []).append(hook)
        _install_finder()


def is_initializing(module: types.ModuleType) -> bool:
    """Whether `module`'s body is still running (its hooks, run by our loader, count it as done)."""
    return interpreter.is_initializing(module) and getattr(module.__spec__, "name", None) not in _bodies_done


def run_deferred_hooks() -> None:
    """Run the hooks of modules this thread was importing when they were registered, now done."""
    with _lock:
        ready = [name for name in _deferred if name in sys.modules and not is_initializing(sys.modules[name])]
        batches = [(name, _deferred.pop(name)) for name in ready]
    for name, hooks in batches:
        for hook in hooks:
            hook(sys.modules[name])


def _run_hooks(module_name: str) -> None:
    with _lock:
        hooks = _pending.pop(module_name, [])
        hooks += [hook for hook in _every_execution.get(module_name, ()) if hook not in hooks]
    module = sys.modules.get(module_name)
    if module is None:
        return
    for hook in hooks:
        hook(module)


class _HookedLoader:
    """Delegates to the real loader and runs the hooks after the module executed."""

    def __init__(self, loader, module_name: str):
        self._loader = loader
        self._module_name = module_name

    def exec_module(self, module):
        _bodies_done.discard(self._module_name)
        self._loader.exec_module(module)
        _bodies_done.add(self._module_name)
        _run_hooks(self._module_name)

    def __getattr__(self, name):  # create_module, get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class _PostImportFinder:
    def find_spec(self, fullname, path=None, target=None):
        if _deferred:
            run_deferred_hooks()
        with _lock:
            if (fullname not in _pending and fullname not in _every_execution) or fullname in _finding:
                return None
            _finding.add(fullname)
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            with _lock:
                _finding.discard(fullname)
        if spec.loader is not None and not isinstance(spec.loader, _HookedLoader):
            spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def _install_finder() -> None:
    # Inserting (never removing) keeps any finder loop that is running right now intact.
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
