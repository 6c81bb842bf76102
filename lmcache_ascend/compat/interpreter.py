"""The three places lmcache-ascend reads CPython's import machinery from the inside.

Each is documented only in CPython's code; `tests/framework/test_interpreter.py` checks each on
the running interpreter, so a Python release that changes one fails there first.  Where one is
absent, the answer falls back to the cautious one named below.

- A module whose body is still running: importlib marks its spec ``_initializing`` (absent:
  taken as finished).
- Waiting for another thread's import: importlib's per-module locks, ``_bootstrap._module_locks``
  and ``_lock_unlock_module`` (absent: no wait, the hook runs at the next import instead).
- ``python -m X`` while runpy still imports X's parents: ``__main__`` has no spec yet and runpy's
  frames hold the name in ``mod_name`` (absent: not seen).
"""

from __future__ import annotations

import sys
import types

def is_initializing(module: types.ModuleType) -> bool:
    """Whether `module`'s body is still running, as importlib marks it."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def wait_for_import_elsewhere(module_name: str) -> bool:
    """Block until another thread's import of `module_name` ends, as ``import`` does; False,
    at once, where this thread is the one running that import (or the locks are not there)."""
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
    to run it as ``__main__`` (``python -m``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "runpy" and frame.f_locals.get("mod_name") in module_names:
            return True
        frame = frame.f_back
    return False
