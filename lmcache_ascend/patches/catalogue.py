"""The patches lmcache-ascend knows, in order, and what activation needs of each before its target
is imported (`CatalogueEntry`): activation imports no declaration module.

Generated from the declarations (each patch module's ``PATCH`` or ``PATCHES``) and checked by a
test.  After changing a declaration's name, target, requires, flags, enabled_by or after, or
adding a patch module (appended here; move its entries to reorder), run::

    python scripts/patch_catalogue.py write
"""

from lmcache_ascend.patches.model import CatalogueEntry


def _entry(name: str, module: str, target: str, requires: dict[str, str], **optional: object) -> CatalogueEntry:
    """One row: the patch, its module under lmcache_ascend.patches, its target, requires, then the rest."""
    return CatalogueEntry(name, module="lmcache_ascend.patches." + module, target=target, requires=requires, **optional)


CATALOGUE: tuple[CatalogueEntry, ...] = (
    _entry("vllm-free-queue-prepend", "vllm.free_queue_prepend", "vllm.v1.core.kv_cache_utils", {"vllm": ">=0.18.0"}),
    _entry("vllm-block-pool-free-prepend", "vllm.block_pool_free_prepend", "vllm.v1.core.block_pool",
           {"vllm": ">=0.18.0"}, after=("vllm-free-queue-prepend",)),
    _entry("vllm-sliding-window-retention", "vllm.sliding_window_retention",
           "vllm.v1.core.single_type_kv_cache_manager", {"vllm": ">=0.18.0"},
           flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",), after=("vllm-block-pool-free-prepend",)),
    _entry("vllm-coordinator-scheduler-block-size", "vllm.coordinator_scheduler_block_size",
           "vllm.v1.core.kv_cache_coordinator", {"vllm": ">=0.18.0"}, flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",),
           after=("vllm-sliding-window-retention",)),
    _entry("vllm-kv-cache-manager-scheduler-block-size", "vllm.kv_cache_manager_scheduler_block_size",
           "vllm.v1.core.kv_cache_manager", {"vllm": ">=0.18.0"}, after=("vllm-coordinator-scheduler-block-size",)),
    _entry("vllm-scheduler-lcm-block-size", "vllm.scheduler_block_size", "vllm.v1.core.sched.scheduler",
           {"vllm": ">=0.18.0"}, after=("vllm-kv-cache-manager-scheduler-block-size",)),
    _entry("vllm-ascend-dsv4-prefix-block-size", "vllm_ascend.dsv4_prefix_block_size",
           "vllm_ascend.patch.platform.patch_kv_cache_coordinator", {"vllm-ascend": ">=0.23.0rc1"}),
    _entry("vllm-ascend-dsv4-attention-block-size", "vllm_ascend.dsv4_compressed_block_size_attention",
           "vllm_ascend.models.layer.attention.layer", {"vllm-ascend": ">=0.23.0rc1"},
           flags=("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE",)),
    _entry("vllm-ascend-dsv4-indexer-block-size", "vllm_ascend.dsv4_compressed_block_size_indexer",
           "vllm_ascend.models.deepseek_v4", {"vllm-ascend": ">=0.23.0rc1"},
           flags=("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE",)),
    _entry("vllm-ascend-kv-cache-layer-names", "vllm_ascend.kv_cache_layer_names", "vllm_ascend.worker.v2.attn_utils",
           {"vllm-ascend": ">=0.23.0rc1"}),
    _entry("vllm-ascend-dsv4-aggregated-page-size", "vllm_ascend.dsv4_aggregated_page_size",
           "vllm_ascend.patch.platform.patch_kv_cache_utils", {"vllm-ascend": ">=0.23.0rc1"}),
    _entry("lmcache-config-flag-keys", "lmcache.config_flag_keys", "lmcache.v1.config", {"lmcache": ">=0.4.5,<0.6"}),
    _entry("lmcache-stable-token-hash", "lmcache.stable_token_hash", "lmcache.v1.token_database",
           {"lmcache": ">=0.4.5,<0.6"}),
    _entry("lmcache-adapter-multigroup", "lmcache.adapter_multigroup", "lmcache.integration.vllm.vllm_v1_adapter",
           {"lmcache": ">=0.4.5,<0.6"},
           flags=("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST")),
    _entry("lmcache-connector-supports-hma", "lmcache.connector_supports_hma",
           "lmcache.integration.vllm.lmcache_connector_v1", {"lmcache": ">=0.4.5,<0.6", "vllm": ">=0.18.0"}),
    _entry("vllm-lmcache-connector-supports-hma", "vllm.lmcache_connector_supports_hma",
           "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector", {"vllm": ">=0.18.0"}),
    _entry("vllm-lmcache-mp-connector-multigroup", "vllm.lmcache_mp_connector_multigroup",
           "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector", {"vllm": ">=0.18.0,<0.19"}),
    _entry("vllm-lmcache-mp-upstream-multigroup", "vllm.lmcache_mp_connector_multigroup",
           "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector", {"vllm": ">=0.19"}),
    _entry("vllm-lmcache-mp-upstream-adapter-api", "vllm.lmcache_mp_worker",
           "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
           {"vllm": ">=0.19", "lmcache": ">=0.5.6"}),
    _entry("vllm-lmcache-mp-device-events", "vllm.lmcache_mp_worker",
           "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
           {"vllm": ">=0.18.0", "lmcache": ">=0.5"}),
    _entry("vllm-lmcache-mp-upstream-group-hints", "vllm.lmcache_mp_worker",
           "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
           {"vllm": ">=0.19", "lmcache": ">=0.5.6"}),
    _entry("lmcache-metadata-chunk-bytes", "lmcache.metadata_chunk_bytes", "lmcache.v1.metadata",
           {"lmcache": ">=0.4.5,<0.6"}),
    _entry("lmcache-gpu-connector-npu", "lmcache.gpu_connector_factory", "lmcache.v1.gpu_connector",
           {"lmcache": ">=0.4.5,<0.6"}),
    _entry("lmcache-c-ops-npu", "lmcache.c_ops_npu", "lmcache.non_cuda_equivalents", {"lmcache": ">=0.4.5,<0.5"}),
    _entry("lmcache-adapter-worker-multigroup", "lmcache.adapter_worker_multigroup",
           "lmcache.integration.vllm.vllm_v1_adapter", {"lmcache": ">=0.4.5,<0.6"}),
    _entry("lmcache-blend-holes-engine", "lmcache.blend_holes_engine", "lmcache.v1.cache_engine",
           {"lmcache": ">=0.4.5,<0.6"}, flags=("LMCACHE_ASCEND_BLEND_HOLES",), enabled_by="LMCACHE_ASCEND_BLEND_HOLES"),
    _entry("lmcache-blend-holes-blender", "lmcache.blend_holes_blender", "lmcache.v1.compute.blend.blender",
           {"lmcache": ">=0.4.5,<0.6"}, flags=("LMCACHE_ASCEND_BLEND_HOLES",), enabled_by="LMCACHE_ASCEND_BLEND_HOLES"),
    _entry("vllm-lmcache-mp-register-group-hints", "vllm.lmcache_mp_register_hints",
           "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
           {"vllm": ">=0.18.0,<0.19", "lmcache": ">=0.4.5,<0.5"}),
    _entry("lmcache-mp-client-wire-format", "lmcache.mp_server_client",
           "lmcache.integration.vllm.vllm_multi_process_adapter", {"lmcache": ">=0.4.5,<0.5"}),
    _entry("lmcache-mp-server-protocol", "lmcache.mp_server_per_group", "lmcache.v1.multiprocess.protocol",
           {"lmcache": ">=0.4.5,<0.5"}),
    _entry("lmcache-mp-server-layer-groups", "lmcache.mp_server_per_group", "lmcache.v1.kv_layer_groups",
           {"lmcache": ">=0.4.5,<0.5"}),
    _entry("lmcache-mp-server-per-group", "lmcache.mp_server_per_group", "lmcache.v1.multiprocess.server",
           {"lmcache": ">=0.4.5,<0.5", "cupy-cuda13x": ">=13"}),
    _entry("vllm-prefix-reuse-off-reason", "vllm.prefix_reuse_off", "vllm.platforms.cpu", {"vllm": ">=0.18.0"}),
    _entry("lmcache-reuse-guard", "lmcache.reuse_guard", "lmcache.integration.vllm.vllm_v1_adapter",
           {"lmcache": ">=0.4.5,<0.6"},
           flags=("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST")),
    _entry("vllm-multigroup-load-failures", "vllm.multigroup_load_failures", "vllm.v1.core.sched.scheduler",
           {"vllm": ">=0.18.0"}),
    _entry("lmcache-remote-chunk-seal", "lmcache.remote_chunk_seal", "lmcache.v1.storage_backend.remote_backend",
           {"lmcache": ">=0.4.5,<0.6"}, flags=("LMCACHE_ASCEND_CHUNK_SEAL",), enabled_by="LMCACHE_ASCEND_CHUNK_SEAL"),
    _entry("lmcache-disk-chunk-seal", "lmcache.disk_chunk_seal", "lmcache.v1.storage_backend.local_disk_backend",
           {"lmcache": ">=0.4.5,<0.6"}, flags=("LMCACHE_ASCEND_CHUNK_SEAL",), enabled_by="LMCACHE_ASCEND_CHUNK_SEAL"),
    _entry("lmcache-redis-get-releases", "lmcache.redis_get_releases",
           "lmcache.v1.storage_backend.connector.redis_connector", {"lmcache": ">=0.4.5,<0.6", "redis": ">=4"}),
    _entry("vllm-lmcache-chunk-size-early", "vllm.lmcache_chunk_size_early", "vllm.config.vllm", {"vllm": ">=0.18.0"}),
    _entry("lmcache-redis-reconnect", "lmcache.redis_reconnect", "lmcache.v1.storage_backend.connector.redis_connector",
           {"lmcache": ">=0.4.5,<0.6", "redis": ">=4.2"}),
    _entry("lmcache-job-queue-cancelled-jobs", "lmcache.job_queue_cancelled_jobs",
           "lmcache.v1.storage_backend.job_executor.pq_executor", {"lmcache": ">=0.4.5,<0.6"}),
    _entry("lmcache-cpu-shm-in-place", "lmcache.cpu_mp_strided_caches", "lmcache.v1.platform.devices.cpu.shm",
           {"lmcache": ">=0.5.6,<0.6"}),
    _entry("lmcache-cpu-paged-block-stride", "lmcache.cpu_mp_strided_caches",
           "lmcache.v1.platform.torch_ops.mp_mem_kernels", {"lmcache": ">=0.5.6,<0.6"}),
    _entry("lmcache-mp-align-state-stores", "lmcache.mp_align_state_stores",
           "lmcache.integration.vllm.lmcache_mp_connector", {"lmcache": ">=0.5.6,<0.6"}),
)

# The declaration modules, in order.
PATCH_MODULES: tuple[str, ...] = tuple(dict.fromkeys(entry.module for entry in CATALOGUE))
