"""The patch modules lmcache-ascend knows, in the order they are declared.

Each module named here defines ``PATCH`` (one `Patch`) or ``PATCHES`` (a tuple).
Patch modules import only the standard library and ``lmcache_ascend`` at module
level: upstream imports belong inside their ``build`` function, so that listing
and activating stay cheap.
"""

PATCH_MODULES: tuple[str, ...] = (
    "lmcache_ascend.patches.vllm.free_queue_prepend",
    "lmcache_ascend.patches.vllm.block_pool_free_prepend",
    "lmcache_ascend.patches.vllm.sliding_window_retention",
    "lmcache_ascend.patches.vllm.coordinator_scheduler_block_size",
    "lmcache_ascend.patches.vllm.kv_cache_manager_scheduler_block_size",
    "lmcache_ascend.patches.vllm.scheduler_block_size",
    "lmcache_ascend.patches.vllm_ascend.dsv4_prefix_block_size",
    "lmcache_ascend.patches.vllm_ascend.dsv4_compressed_block_size_attention",
    "lmcache_ascend.patches.vllm_ascend.dsv4_compressed_block_size_indexer",
    "lmcache_ascend.patches.vllm_ascend.kv_cache_layer_names",
    "lmcache_ascend.patches.vllm_ascend.dsv4_aggregated_page_size",
    "lmcache_ascend.patches.lmcache.config_flag_keys",
    "lmcache_ascend.patches.lmcache.stable_token_hash",
    "lmcache_ascend.patches.lmcache.adapter_multigroup",
    "lmcache_ascend.patches.lmcache.connector_supports_hma",
    "lmcache_ascend.patches.vllm.lmcache_connector_supports_hma",
    "lmcache_ascend.patches.vllm.lmcache_mp_connector_multigroup",
    "lmcache_ascend.patches.vllm.lmcache_mp_worker",
    "lmcache_ascend.patches.vllm.lmcache_mp_register_hints",
    "lmcache_ascend.patches.lmcache.mp_server_per_group",
    "lmcache_ascend.patches.lmcache.mp_server_client",
    "lmcache_ascend.patches.lmcache.metadata_chunk_bytes",
    "lmcache_ascend.patches.lmcache.gpu_connector_factory",
    "lmcache_ascend.patches.lmcache.c_ops_npu",
    "lmcache_ascend.patches.lmcache.adapter_worker_multigroup",
    "lmcache_ascend.patches.lmcache.blend_holes_engine",
    "lmcache_ascend.patches.lmcache.blend_holes_blender",
)
