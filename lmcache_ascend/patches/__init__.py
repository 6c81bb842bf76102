"""The patch framework: declarations (`model.Patch`), the registry and the listing CLI."""

from lmcache_ascend.patches.model import MISSING, Patch, PatchContext, PatchKind, State, adds_keywords

__all__ = ["MISSING", "Patch", "PatchContext", "PatchKind", "State", "UpstreamGuard", "Verdict", "adds_keywords"]


def __getattr__(name: str) -> object:
    # Loaded on first use: activation needs neither.
    if name in ("UpstreamGuard", "Verdict"):
        from lmcache_ascend.patches import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
