"""LMCache's op signatures over the project's transfer kernels: what `lmcache_ascend.ops` exposes.

`transfer_ops` takes LMCache's arguments (pointer tables or tensor lists, its
format enum, its page-buffer description), checks them where LMCache's torch
baseline would, and runs the moves on `lmcache_ascend.kernels`; `formats` holds
what each of LMCache's formats says about a paged cache. This layer reads the
lmcache-ascend flags (the transfer backend); the kernels below it read none.
Nothing here imports LMCache: LMCache imports `lmcache_ascend.ops`.
"""
