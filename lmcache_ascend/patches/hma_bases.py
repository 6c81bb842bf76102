"""The ``__bases__`` that make an in-process LMCache connector class a ``SupportsHMA``.

A patch build shared by the patches of LMCache's and vLLM's in-process connector classes
(which may not import each other): vLLM's own ``SupportsHMA`` around
`lmcache_ascend.multigroup.hma.hma_mixin`.
"""

from __future__ import annotations

__all__ = ["supports_hma_bases"]


def supports_hma_bases(class_name: str):
    """A patch build giving the target's `class_name` the ``SupportsHMA`` mixin as last base
    (the registry clears the ABC caches of ``SupportsHMA`` when it sets or restores ``__bases__``)."""

    def build(ctx) -> dict[str, object]:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

        from lmcache_ascend.multigroup.hma import hma_mixin

        connector_class = getattr(ctx.module, class_name)
        return {f"{class_name}.__bases__": connector_class.__bases__ + (hma_mixin(SupportsHMA),)}

    return build
