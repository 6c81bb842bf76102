"""Hole-mode CacheBlend: pure logic (no vLLM / LMCache imports).

* `segments`: a prompt's document segments and their lookup over the whole
  prompt (hit / miss runs, the stretches of cached documents);
* `selection`: holes always recomputed, plus top-k cached tokens by K deviation.

The tiny reference transformer, RAG scenarios, retrieval plan and RoPE
re-rotation that measure CacheBlend against full recomputation are test and
benchmark code: they live in ``tests/blend/reference/``.

Submodules are imported explicitly; this package file imports nothing, so the
patch modules that name it stay cheap to import.
"""
