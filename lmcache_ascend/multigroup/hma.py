"""The ``SupportsHMA`` side of LMCache's in-process connectors (import-free).

vLLM only lets a connector run with the hybrid KV cache manager when it is a
``SupportsHMA`` (an ABC checked with isinstance/issubclass) and then calls
``request_finished_all_groups(request, block_ids_per_group)`` instead of
``request_finished(request, block_ids[0])``. The LMCache adapter's
``request_finished`` only uses the request (cleanup, abort, params), so the
all-groups call forwards to it; the per-group blocks are freed by vLLM as
usual (the in-process connector never holds blocks after finish).

`hma_mixin` builds, around vLLM's own ``SupportsHMA`` class (passed in, so
this module imports nothing), the base class a connector gains.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hma_mixin"]

_MIXINS: dict[type, type] = {}


def hma_mixin(supports_hma: type) -> type:
    """A subclass of `supports_hma` implementing ``request_finished_all_groups``."""
    mixin = _MIXINS.get(supports_hma)
    if mixin is not None:
        return mixin

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        engine = self._lmcache_engine
        all_groups = getattr(engine, "request_finished_all_groups", None)
        if all_groups is not None:
            return all_groups(request, block_ids)
        first_group = list(block_ids[0]) if block_ids else []
        return engine.request_finished(request, first_group)

    mixin = type(
        "LMCacheAscendSupportsHMA",
        (supports_hma,),
        {
            "__module__": __name__,
            "__doc__": "Adds SupportsHMA to an LMCache in-process connector (lmcache-ascend).",
            "request_finished_all_groups": request_finished_all_groups,
        },
    )
    _MIXINS[supports_hma] = mixin
    return mixin
