"""Hole-mode CacheBlend: pure logic (no vLLM / LMCache imports).

* `segments`: split a prompt into separator-delimited documents and look up
  every one of them (hit / miss runs over the whole prompt);
* `plan`: place each cached document at its new positions;
* `selection`: holes always recomputed, plus top-k cached tokens by K deviation;
* `rope`: re-rotate cached K from stored to new positions;
* `reference_model` / `evaluation`: a tiny torch transformer and RAG scenarios
  for measuring CacheBlend against full recomputation.

Submodules are imported explicitly; this package file imports nothing, so the
patch modules that name it stay cheap to import.
"""
