"""The patch framework: declarations, the registry and the listing CLI.

Patch authors need only::

    from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard, adds_keywords

module-level wrappers ``wrapper(wrapped, instance, args, kwargs)`` and a line in
`lmcache_ascend.patches.catalogue`.  See `model.Patch`.
"""

from lmcache_ascend.patches.model import (
    MISSING,
    Patch,
    PatchContext,
    PatchKind,
    State,
    UpstreamGuard,
    Verdict,
    adds_keywords,
)

__all__ = ["MISSING", "Patch", "PatchContext", "PatchKind", "State", "UpstreamGuard", "Verdict", "adds_keywords"]
