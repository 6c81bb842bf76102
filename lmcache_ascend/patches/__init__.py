"""The patch framework: declarations, the registry and the listing CLI.

Patch authors need only ``from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard,
adds_keywords``, module-level wrappers ``wrapper(wrapped, instance, args, kwargs)`` and a
regenerated `lmcache_ascend.patches.catalogue`.  See `model.Patch`.
"""

from lmcache_ascend.patches.model import MISSING, Patch, PatchContext, PatchKind, State, adds_keywords

__all__ = ["MISSING", "Patch", "PatchContext", "PatchKind", "State", "UpstreamGuard", "Verdict", "adds_keywords"]


def __getattr__(name: str) -> object:
    # UpstreamGuard and Verdict: model loads them on first use (activation needs neither).
    if name in ("UpstreamGuard", "Verdict"):
        from lmcache_ascend.patches import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
