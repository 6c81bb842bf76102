"""Run a hook on a module right after it first executes, for the engine tests' sitecustomize folders.

A folder the harness puts on an engine's (or a server's) ``PYTHONPATH`` patches its own process
as each named module loads: vLLM's CPU workers are spawned, so every process does it for itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, hooks: dict[str, Callable]):
        self.hooks = hooks

    def find_spec(self, fullname, path, target=None):
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        plain_exec = spec.loader.exec_module

        def exec_module(module):
            plain_exec(module)
            hook(module)

        spec.loader.exec_module = exec_module
        return spec


def run_after_import(hooks: dict[str, Callable]) -> None:
    """Call ``hooks[name](module)`` once module `name` has executed (at once where it already has)."""
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(hooks))
