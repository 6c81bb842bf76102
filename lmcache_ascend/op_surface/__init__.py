"""LMCache's op signatures over the project's transfer kernels: what `lmcache_ascend.ops` exposes.

`transfer_ops` is the surface: its ops (`token_ops`, `block_ops`) take LMCache's
arguments (pointer tables or tensor lists, its format enum, its page-buffer
description), check them where LMCache's torch baseline would (`arguments`), and
run the moves on `lmcache_ascend.kernels` (`moves`); `formats` holds
what each of LMCache's formats says about a paged cache. This layer reads the
lmcache-ascend flags (the transfer backend); the kernels below it read none.
Nothing here imports LMCache: LMCache imports `lmcache_ascend.ops`.
"""
