"""Key LMCache chunks with a hash that every process computes alike.

after ``lmcache.v1.token_database.TokenDatabase.__init__``, a token
database left on Python's salted ``hash()`` (LMCache's "builtin" algorithm,
which no vLLM release provides) with no fixed ``PYTHONHASHSEED`` hashes with
`lmcache_ascend.token_hash.stable_token_hash`, and its chain starts from
`CHAIN_START` instead of vLLM's per-process random ``NONE_HASH``.  A fixed
``PYTHONHASHSEED`` or a vLLM hash that LMCache did load is left alone.
LMCache's messages about that fallback (set ``PYTHONHASHSEED``; the per-process
``NONE_HASH``) are held back while its ``__init__`` runs and dropped when the
stable hash takes over (one line says which hash is in force instead), else
passed on as they were.
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def init_wrapper(wrapped, instance, args, kwargs):
    import logging
    import os

    from lmcache.v1 import token_database

    from lmcache_ascend.token_hash import (
        CHAIN_START,
        STABLE_HASH_NAME,
        HeldRecords,
        needs_process_stable_hash,
        stable_token_hash,
    )

    upstream_logger = getattr(token_database, "logger", None)
    held = HeldRecords(upstream_logger) if isinstance(upstream_logger, logging.Logger) else None
    stable = False
    try:
        wrapped(*args, **kwargs)
        stable = needs_process_stable_hash(getattr(instance, "hash_func", None), os.environ)
        if stable:
            instance.hash_func = stable_token_hash
            # LMCache reads the chain start from this module global (set by the
            # original __init__ from vLLM's per-process NONE_HASH).
            token_database.NONE_HASH = CHAIN_START
    finally:
        if held is not None:
            held.release(drop=stable)
    if stable and held is not None:
        upstream_logger.info(
            "lmcache-ascend: chunks are keyed by %s, the same in every process: PYTHONHASHSEED is not needed "
            "(LMCache's own hash would be Python's salted hash())",
            STABLE_HASH_NAME,
        )


PATCH = Patch(
    name="lmcache-stable-token-hash",
    target="lmcache.v1.token_database",
    attributes=("TokenDatabase.__init__",),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        unfixed_if_source_contains=("Using builtin hash",),
    ),
    wrappers={"TokenDatabase.__init__": init_wrapper},
    summary="LMCache chunk keys use a process-independent hash when it would fall back to the salted hash()",
    why="scheduler and worker processes hash differently without PYTHONHASHSEED: nothing stored is ever found",
    mirrors="LMCache's 'Using builtin hash without PYTHONHASHSEED set' warning",
    delete_when="LMCache's default chunk hash is the same in every process",
    tested_fingerprints={"TokenDatabase.__init__": ("e03c7652ee1b", "63c5e74d1a10")},
)
