"""Prefix-cache retention logic (pure: no vLLM, no vllm-ascend imports).

The vLLM core backports (``patches/vllm/``) and the vllm-ascend DeepSeek-V4
fixes (``patches/vllm_ascend/``) are thin adapters around these functions:

- `retention`: the ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` value, its
  validation, and which sliding-window blocks stay in the prefix cache;
- `block_sizes`: scheduler block size (LCM of the groups), DeepSeek-V4
  compressed block size and prefix block size;
- `free_order`: which freed blocks are reused first;
- `layer_names`: the structured error for kv-cache tensors vs specs.
"""
