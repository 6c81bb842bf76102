"""LMCache's in-process lookup reports no external tokens where reuse cannot be exact.

``LMCacheConnectorV1Impl.get_num_new_matched_tokens`` returns 0 without looking
anything up (the path upstream takes for a producer that does not reuse) when the
connector decided at start that it supplies no prefix
(`lmcache_ascend.multigroup.adapter_scheduler.connector_reuse_blocker`: a
KV-cache group whose state makes reuse impossible, or vLLM's own prefix caching
forced off for the model); the reason was logged once then. Elsewhere upstream's
lookup runs unchanged.
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchKind


def get_num_new_matched_tokens_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.multigroup.adapter_scheduler import connector_reuse_blocker

    if connector_reuse_blocker(instance) is not None:
        return 0
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="lmcache-reuse-guard",
    target="lmcache.integration.vllm.vllm_v1_adapter",
    attributes=("LMCacheConnectorV1Impl.get_num_new_matched_tokens",),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    flags=("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"),
    wrappers={"LMCacheConnectorV1Impl.get_num_new_matched_tokens": get_num_new_matched_tokens_wrapper},
    summary="LMCache's lookup reports 0 tokens for models whose reuse cannot be exact (state-space groups, vLLM's own reuse off)",
    why="a Mamba group's recurrent state is not per-token KV, and vLLM's CPU MLA path over a cached prefix gives "
    "other tokens: a supplied prefix would make the model continue from a state that never saw it",
    mirrors="vLLM's own prefix caching: off where its cached-prefix path is not supported (vllm.platforms.cpu for MLA)",
    delete_when="LMCache restores state-space state at chunk boundaries and vLLM's cached-prefix paths all work",
    tested_fingerprints={"LMCacheConnectorV1Impl.get_num_new_matched_tokens": ("df75fde2eecf", "8ebb1d73a767")},
)
