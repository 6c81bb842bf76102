"""Key LMCache chunks with a hash that every process computes alike.

What: after ``lmcache.v1.token_database.TokenDatabase.__init__``, a token
database left on Python's salted ``hash()`` (LMCache's "builtin" algorithm,
which no vLLM release provides) with no fixed ``PYTHONHASHSEED`` hashes with
`lmcache_ascend.token_hash.stable_token_hash`, and its chain starts from
`CHAIN_START` instead of vLLM's per-process random ``NONE_HASH``.  A fixed
``PYTHONHASHSEED`` or a vLLM hash that LMCache did load is left alone.
Why: vLLM's scheduler and worker processes otherwise key the same tokens
differently: LMCache stores chunks that no lookup ever finds.
Mirrors: LMCache's own warning ("Using builtin hash without PYTHONHASHSEED
set"), which asks every user to export PYTHONHASHSEED.
Delete when: LMCache's default hash is the same in every process.
"""

from __future__ import annotations

import functools

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard


def _build(ctx: PatchContext) -> dict[str, object]:
    import os

    from lmcache_ascend.token_hash import CHAIN_START, needs_process_stable_hash, stable_token_hash

    original_init = ctx.original_function("TokenDatabase.__init__")
    module = ctx.module

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if needs_process_stable_hash(getattr(self, "hash_func", None), os.environ):
            self.hash_func = stable_token_hash
            # LMCache reads the chain start from this module global (set by the
            # original __init__ from vLLM's per-process NONE_HASH).
            module.NONE_HASH = CHAIN_START

    return {"TokenDatabase.__init__": __init__}


PATCH = Patch(
    name="lmcache-stable-token-hash",
    target="lmcache.v1.token_database",
    attributes=("TokenDatabase.__init__",),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        unfixed_if_source_contains=("Using builtin hash",),
    ),
    build=_build,
    summary="LMCache chunk keys use a process-independent hash when it would fall back to the salted hash()",
    why="scheduler and worker processes hash differently without PYTHONHASHSEED: nothing stored is ever found",
    mirrors="LMCache's 'Using builtin hash without PYTHONHASHSEED set' warning",
    delete_when="LMCache's default chunk hash is the same in every process",
    tested_fingerprints={"TokenDatabase.__init__": ("e03c7652ee1b", "63c5e74d1a10")},
)
