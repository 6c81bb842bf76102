"""A build shared by the patches of LMCache's and vLLM's connector classes (which may not import
each other): the ``__bases__`` that make an in-process LMCache connector a ``SupportsHMA``."""

from __future__ import annotations


def supports_hma_bases(class_name: str):
    """A build giving `class_name` the ``SupportsHMA`` mixin as last base (the registry clears the
    ABC caches when it sets or restores ``__bases__``)."""

    def build(ctx) -> dict[str, object]:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

        from lmcache_ascend.multigroup.hma import hma_mixin

        connector_class = getattr(ctx.module, class_name)
        return {f"{class_name}.__bases__": connector_class.__bases__ + (hma_mixin(SupportsHMA),)}

    return build
