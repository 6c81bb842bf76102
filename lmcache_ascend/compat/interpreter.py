"""The three places lmcache-ascend reads CPython's import machinery from the inside, each
documented only in CPython's code and checked on the running interpreter by
`tests/framework/test_interpreter.py`; where one is absent, the cautious answer is given.
"""

from __future__ import annotations

import sys
import types


def is_initializing(module: types.ModuleType) -> bool:
    """Whether `module`'s body is still running (absent mark: finished)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def wait_for_import_elsewhere(module_name: str) -> bool:
    """Block until another thread's import of `module_name` ends, as ``import`` does; False, at once,
    where this thread runs that import or importlib's per-module locks are not there (the hook
    then runs at the next import).  ``importlib.import_module`` would wait too, but import the
    module itself where the other thread's import failed, and raise on a deadlock."""
    import _thread
    from importlib import _bootstrap

    locks = getattr(_bootstrap, "_module_locks", None)
    unlock = getattr(_bootstrap, "_lock_unlock_module", None)
    if locks is None or unlock is None:
        return False
    lock_ref = locks.get(module_name)
    lock = lock_ref() if lock_ref is not None else None
    if lock is not None and getattr(lock, "owner", None) == _thread.get_ident():
        return False
    unlock(module_name)
    return True


def runpy_is_starting(module_names: frozenset[str]) -> bool:
    """Whether runpy, on the caller's stack, is importing the parents of one of `module_names`
    to run it as ``__main__`` (``python -m``: its frames hold the name in ``mod_name``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "runpy" and frame.f_locals.get("mod_name") in module_names:
            return True
        frame = frame.f_back
    return False
