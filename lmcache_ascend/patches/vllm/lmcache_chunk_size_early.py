"""Refuse an LMCache chunk size that cannot fit vLLM's KV-cache blocks while vLLM builds its config.

The connector checks LMCache's ``chunk_size`` against every moved KV-cache group's
block size when it registers the KV caches (`lmcache_ascend.multigroup.connector_state`),
which is after the weights have loaded: minutes into a start, and then the error is
printed by every process it passes through. The wrapper runs the same rule at the end
of ``VllmConfig.__post_init__``, in the process that builds the config (the API server,
or the script calling ``vllm.LLM``), where vLLM's block size is already the one its
KV-cache groups will have:

- vLLM's CPU platform fixes the block size in ``check_and_update_config`` (called from
  ``__post_init__``), and a size the user set is kept by every platform;
- for a model of attention layers only, every full or sliding-window group then has
  that block size (or a multiple of it, where vLLM evens out page sizes), so a chunk
  that is no multiple of it is refused later too.

Elsewhere the facts are not known yet and nothing is checked here: another platform
picks its block size from the attention backend after the weights load, vLLM aligns a
state-space hybrid's block size to its state pages, and a compressed KV cache
(DeepSeek-V4's ``compress_ratios``) has groups of other block sizes. The chunk size is
read as LMCache's in-process connector reads it: LMCache's configuration, then a
``lmcache.chunk_size`` in the KV-transfer config's ``kv_connector_extra_config``.
"""

from __future__ import annotations

import copy

from lmcache_ascend.patches import Patch, PatchKind

# vLLM's connector name for LMCache in the engine's own processes (the MP connector's chunk
# size is its server's, checked there).
_IN_PROCESS_CONNECTORS = frozenset({"LMCacheConnectorV1"})


def _settled_block_size(vllm_config) -> int | None:
    """The block size every attention group will have, where it is known now; else None."""
    cache_config, model_config = vllm_config.cache_config, vllm_config.model_config
    if model_config is None or not isinstance(cache_config.block_size, int):
        return None
    if model_config.is_hybrid or model_config.is_attention_free:
        return None
    if getattr(cache_config, "kv_cache_dtype_skip_layers", None):
        return None  # vLLM aligns page sizes across KV dtypes after the load
    if getattr(model_config.hf_text_config, "compress_ratios", None):
        return None
    if not cache_config.user_specified_block_size:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
    return cache_config.block_size


def _lmcache_chunk_size(kv_transfer_config) -> int | None:
    try:
        from lmcache.integration.vllm.utils import lmcache_get_or_create_config
        from lmcache.v1.config_base import validate_and_set_config_value
    except ImportError:
        return None
    config = lmcache_get_or_create_config()
    extra = kv_transfer_config.kv_connector_extra_config or {}
    if "lmcache.chunk_size" in extra:
        config = copy.copy(config)  # LMCache's process-wide config stays as LMCache loaded it
        validate_and_set_config_value(config, "chunk_size", extra["lmcache.chunk_size"])
    return config.chunk_size


def post_init_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    kv_transfer_config = instance.kv_transfer_config
    if kv_transfer_config is None or kv_transfer_config.kv_connector not in _IN_PROCESS_CONNECTORS:
        return result
    block_size = _settled_block_size(instance)
    if block_size is None:
        return result
    chunk_size = _lmcache_chunk_size(kv_transfer_config)
    if chunk_size is not None:
        from lmcache_ascend.multigroup.connector_state import check_single_group_chunk_size

        check_single_group_chunk_size(block_size, chunk_size)
    return result


PATCH = Patch(
    name="vllm-lmcache-chunk-size-early",
    target="vllm.config.vllm",
    attributes=("VllmConfig.__post_init__",),
    kind=PatchKind.WRAP,
    requires={"vllm": ">=0.18.0"},
    wrappers={"VllmConfig.__post_init__": post_init_wrapper},
    summary="an LMCache chunk size that cannot fit vLLM's KV-cache blocks is refused when vLLM builds its config",
    why="the connector's own check runs after the weights load: minutes into a start, printed by every process",
    mirrors="vllm.platforms.cpu.CpuPlatform.check_and_update_config (the CPU block size) and "
    "Platform.update_block_size_for_backend (a user-set size kept for attention-only models)",
    tested_fingerprints={"VllmConfig.__post_init__": ("3ab96b166a51", "5cbe669f239f", "8a004fa11eac", "0eb19b3ea199")},
    delete_when="LMCache refuses a chunk size that does not fit vLLM's block size when vLLM builds its config",
)
