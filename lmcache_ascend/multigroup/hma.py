"""The ``SupportsHMA`` side of LMCache's in-process connectors (import-free).

vLLM only lets a connector run with the hybrid KV cache manager when it is a
``SupportsHMA`` (an ABC checked with isinstance/issubclass) and then calls
``request_finished_all_groups(request, block_ids_per_group)`` instead of
``request_finished(request, block_ids[0])``. The LMCache adapter's
``request_finished`` only uses the request (cleanup, abort, params), so the
all-groups call forwards to it; the per-group blocks are freed by vLLM as
usual (the in-process connector never holds blocks after finish).

LMCache's MP connectors keep no adapter engine: their own ``request_finished``
(tracker cleanup, session end) is what the all-groups call forwards to
(``forward_to_self=True``).

`hma_mixin` builds, around vLLM's own ``SupportsHMA`` class (passed in, so
this module imports nothing), the base class a connector gains.
"""

from __future__ import annotations

from typing import Any

__all__ = ["declares_supports_hma", "hma_mixin"]

_MIXINS: dict[tuple[type, bool], type] = {}


def hma_mixin(supports_hma: type, forward_to_self: bool = False) -> type:
    """A subclass of `supports_hma` implementing ``request_finished_all_groups``."""
    mixin = _MIXINS.get((supports_hma, forward_to_self))
    if mixin is not None:
        return mixin

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        if forward_to_self:
            return self.request_finished(request, list(block_ids[0]) if block_ids else [])
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
    _MIXINS[(supports_hma, forward_to_self)] = mixin
    return mixin


def declares_supports_hma(module: Any, class_name: str) -> bool | None:
    """Whether upstream's `class_name` in `module` is a ``SupportsHMA`` (None: absent, or ours)."""
    connector = getattr(module, class_name, None)
    if connector is None:
        return None
    names = {base.__name__ for base in connector.__mro__}
    if "LMCacheAscendSupportsHMA" in names:
        return None  # ours: says nothing about upstream
    return "SupportsHMA" in names
