"""Reference CacheBlend on a tiny model: ground truth for the tests and the benchmark.

* `model`: a tiny deterministic RoPE transformer whose ``blend_prefill`` runs
  CacheBlend the way LMCache's blender does;
* `scenarios`: RAG prompts with missing documents, run as standard CacheBlend,
  hole mode, plain reuse or with a random recompute set, and their errors;
* `plan`: where each cached document's KV goes in a new prompt;
* `rope`: RoPE and re-rotation of cached K to new positions;
* `documents`: split a prompt at separators and look every document up.

Used by ``tests/blend`` and ``scripts/bench_hole_blend.py``; nothing in
``lmcache_ascend`` imports it.
"""
