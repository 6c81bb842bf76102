"""LMCache's op signatures over the project's transfer kernels: what `lmcache_ascend.ops` exposes.

The ops (`per_token`, `per_block`) take LMCache's arguments (pointer tables or
tensor lists, its format enum, its page-buffer description), check them where
LMCache's torch baseline would (`arguments`), and run the moves on
`lmcache_ascend.kernels` (`moves`); every op takes the same steps (`runner`), and
states only its own checks, planes and moves. `formats` looks LMCache's formats up
by code, as the layouts (`lmcache_ascend.layouts`) declare them. This layer reads the
lmcache-ascend flags (the transfer backend); the kernels below it read none.
Nothing here imports LMCache: LMCache imports `lmcache_ascend.ops`.
"""
