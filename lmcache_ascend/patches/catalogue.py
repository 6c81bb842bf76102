"""The patches lmcache-ascend knows, in the order they are declared, and what activation
needs of each before its target is imported (`CatalogueEntry`): activation imports no
declaration module, the post-import hook imports one with its target.

Generated from the declarations (each patch module's ``PATCH`` or ``PATCHES``), the one
place these facts are written by hand; a test checks that this file is what they
generate.  After changing a declaration's name, target, requires, flags, enabled_by or
after, or adding a patch module (appended here; move its entries to reorder), run::

    python -m lmcache_ascend.patches catalogue --write
"""

from lmcache_ascend.patches.model import CatalogueEntry

CATALOGUE: tuple[CatalogueEntry, ...] = (
    CatalogueEntry(
        name="vllm-free-queue-prepend",
        module="lmcache_ascend.patches.vllm.free_queue_prepend",
        target="vllm.v1.core.kv_cache_utils",
        requires={"vllm": ">=0.18.0"},
    ),
    CatalogueEntry(
        name="vllm-block-pool-free-prepend",
        module="lmcache_ascend.patches.vllm.block_pool_free_prepend",
        target="vllm.v1.core.block_pool",
        requires={"vllm": ">=0.18.0"},
        after=("vllm-free-queue-prepend",),
    ),
    CatalogueEntry(
        name="vllm-sliding-window-retention",
        module="lmcache_ascend.patches.vllm.sliding_window_retention",
        target="vllm.v1.core.single_type_kv_cache_manager",
        requires={"vllm": ">=0.18.0"},
        flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",),
        after=("vllm-block-pool-free-prepend",),
    ),
    CatalogueEntry(
        name="vllm-coordinator-scheduler-block-size",
        module="lmcache_ascend.patches.vllm.coordinator_scheduler_block_size",
        target="vllm.v1.core.kv_cache_coordinator",
        requires={"vllm": ">=0.18.0"},
        flags=("VLLM_PREFIX_CACHE_RETENTION_INTERVAL",),
        after=("vllm-sliding-window-retention",),
    ),
    CatalogueEntry(
        name="vllm-kv-cache-manager-scheduler-block-size",
        module="lmcache_ascend.patches.vllm.kv_cache_manager_scheduler_block_size",
        target="vllm.v1.core.kv_cache_manager",
        requires={"vllm": ">=0.18.0"},
        after=("vllm-coordinator-scheduler-block-size",),
    ),
    CatalogueEntry(
        name="vllm-scheduler-lcm-block-size",
        module="lmcache_ascend.patches.vllm.scheduler_block_size",
        target="vllm.v1.core.sched.scheduler",
        requires={"vllm": ">=0.18.0"},
        after=("vllm-kv-cache-manager-scheduler-block-size",),
    ),
    CatalogueEntry(
        name="vllm-ascend-dsv4-prefix-block-size",
        module="lmcache_ascend.patches.vllm_ascend.dsv4_prefix_block_size",
        target="vllm_ascend.patch.platform.patch_kv_cache_coordinator",
        requires={"vllm-ascend": ">=0.23.0rc1"},
    ),
    CatalogueEntry(
        name="vllm-ascend-dsv4-attention-block-size",
        module="lmcache_ascend.patches.vllm_ascend.dsv4_compressed_block_size_attention",
        target="vllm_ascend.models.layer.attention.layer",
        requires={"vllm-ascend": ">=0.23.0rc1"},
        flags=("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE",),
    ),
    CatalogueEntry(
        name="vllm-ascend-dsv4-indexer-block-size",
        module="lmcache_ascend.patches.vllm_ascend.dsv4_compressed_block_size_indexer",
        target="vllm_ascend.models.deepseek_v4",
        requires={"vllm-ascend": ">=0.23.0rc1"},
        flags=("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE",),
    ),
    CatalogueEntry(
        name="vllm-ascend-kv-cache-layer-names",
        module="lmcache_ascend.patches.vllm_ascend.kv_cache_layer_names",
        target="vllm_ascend.worker.v2.attn_utils",
        requires={"vllm-ascend": ">=0.23.0rc1"},
    ),
    CatalogueEntry(
        name="vllm-ascend-dsv4-aggregated-page-size",
        module="lmcache_ascend.patches.vllm_ascend.dsv4_aggregated_page_size",
        target="vllm_ascend.patch.platform.patch_kv_cache_utils",
        requires={"vllm-ascend": ">=0.23.0rc1"},
    ),
    CatalogueEntry(
        name="lmcache-config-flag-keys",
        module="lmcache_ascend.patches.lmcache.config_flag_keys",
        target="lmcache.v1.config",
        requires={"lmcache": ">=0.4.5,<0.6"},
    ),
    CatalogueEntry(
        name="lmcache-stable-token-hash",
        module="lmcache_ascend.patches.lmcache.stable_token_hash",
        target="lmcache.v1.token_database",
        requires={"lmcache": ">=0.4.5,<0.6"},
    ),
    CatalogueEntry(
        name="lmcache-adapter-multigroup",
        module="lmcache_ascend.patches.lmcache.adapter_multigroup",
        target="lmcache.integration.vllm.vllm_v1_adapter",
        requires={"lmcache": ">=0.4.5,<0.6"},
        flags=("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"),
    ),
    CatalogueEntry(
        name="lmcache-connector-supports-hma",
        module="lmcache_ascend.patches.lmcache.connector_supports_hma",
        target="lmcache.integration.vllm.lmcache_connector_v1",
        requires={"lmcache": ">=0.4.5,<0.6", "vllm": ">=0.18.0"},
    ),
    CatalogueEntry(
        name="vllm-lmcache-connector-supports-hma",
        module="lmcache_ascend.patches.vllm.lmcache_connector_supports_hma",
        target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
        requires={"vllm": ">=0.18.0"},
    ),
    CatalogueEntry(
        name="vllm-lmcache-mp-connector-multigroup",
        module="lmcache_ascend.patches.vllm.lmcache_mp_connector_multigroup",
        target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
        requires={"vllm": ">=0.18.0,<0.19"},
    ),
    CatalogueEntry(
        name="vllm-lmcache-mp-upstream-multigroup",
        module="lmcache_ascend.patches.vllm.lmcache_mp_connector_multigroup",
        target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
        requires={"vllm": ">=0.19"},
    ),
    CatalogueEntry(
        name="vllm-lmcache-mp-upstream-adapter-api",
        module="lmcache_ascend.patches.vllm.lmcache_mp_worker",
        target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
        requires={"vllm": ">=0.19", "lmcache": ">=0.5.6"},
    ),
    CatalogueEntry(
        name="vllm-lmcache-mp-device-events",
        module="lmcache_ascend.patches.vllm.lmcache_mp_worker",
        target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
        requires={"vllm": ">=0.18.0", "lmcache": ">=0.5"},
    ),
    CatalogueEntry(
        name="vllm-lmcache-mp-upstream-group-hints",
        module="lmcache_ascend.patches.vllm.lmcache_mp_worker",
        target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
        requires={"vllm": ">=0.19", "lmcache": ">=0.5.6"},
    ),
    CatalogueEntry(
        name="lmcache-metadata-chunk-bytes",
        module="lmcache_ascend.patches.lmcache.metadata_chunk_bytes",
        target="lmcache.v1.metadata",
        requires={"lmcache": ">=0.4.5,<0.6"},
    ),
    CatalogueEntry(
        name="lmcache-gpu-connector-npu",
        module="lmcache_ascend.patches.lmcache.gpu_connector_factory",
        target="lmcache.v1.gpu_connector",
        requires={"lmcache": ">=0.4.5,<0.6"},
    ),
    CatalogueEntry(
        name="lmcache-c-ops-npu",
        module="lmcache_ascend.patches.lmcache.c_ops_npu",
        target="lmcache.non_cuda_equivalents",
        requires={"lmcache": ">=0.4.5,<0.5"},
    ),
    CatalogueEntry(
        name="lmcache-adapter-worker-multigroup",
        module="lmcache_ascend.patches.lmcache.adapter_worker_multigroup",
        target="lmcache.integration.vllm.vllm_v1_adapter",
        requires={"lmcache": ">=0.4.5,<0.6"},
    ),
    CatalogueEntry(
        name="lmcache-blend-holes-engine",
        module="lmcache_ascend.patches.lmcache.blend_holes_engine",
        target="lmcache.v1.cache_engine",
        requires={"lmcache": ">=0.4.5,<0.6"},
        flags=("LMCACHE_ASCEND_BLEND_HOLES",),
        enabled_by="LMCACHE_ASCEND_BLEND_HOLES",
    ),
    CatalogueEntry(
        name="lmcache-blend-holes-blender",
        module="lmcache_ascend.patches.lmcache.blend_holes_blender",
        target="lmcache.v1.compute.blend.blender",
        requires={"lmcache": ">=0.4.5,<0.6"},
        flags=("LMCACHE_ASCEND_BLEND_HOLES",),
        enabled_by="LMCACHE_ASCEND_BLEND_HOLES",
    ),
    CatalogueEntry(
        name="vllm-lmcache-mp-register-group-hints",
        module="lmcache_ascend.patches.vllm.lmcache_mp_register_hints",
        target="vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector",
        requires={"vllm": ">=0.18.0,<0.19", "lmcache": ">=0.4.5,<0.5"},
    ),
    CatalogueEntry(
        name="lmcache-mp-client-wire-format",
        module="lmcache_ascend.patches.lmcache.mp_server_client",
        target="lmcache.integration.vllm.vllm_multi_process_adapter",
        requires={"lmcache": ">=0.4.5,<0.5"},
    ),
    CatalogueEntry(
        name="lmcache-mp-server-protocol",
        module="lmcache_ascend.patches.lmcache.mp_server_per_group",
        target="lmcache.v1.multiprocess.protocol",
        requires={"lmcache": ">=0.4.5,<0.5"},
    ),
    CatalogueEntry(
        name="lmcache-mp-server-layer-groups",
        module="lmcache_ascend.patches.lmcache.mp_server_per_group",
        target="lmcache.v1.kv_layer_groups",
        requires={"lmcache": ">=0.4.5,<0.5"},
    ),
    CatalogueEntry(
        name="lmcache-mp-server-per-group",
        module="lmcache_ascend.patches.lmcache.mp_server_per_group",
        target="lmcache.v1.multiprocess.server",
        requires={"lmcache": ">=0.4.5,<0.5", "cupy-cuda13x": ">=13"},
    ),
    CatalogueEntry(
        name="vllm-prefix-reuse-off-reason",
        module="lmcache_ascend.patches.vllm.prefix_reuse_off",
        target="vllm.platforms.cpu",
        requires={"vllm": ">=0.18.0"},
    ),
    CatalogueEntry(
        name="lmcache-reuse-guard",
        module="lmcache_ascend.patches.lmcache.reuse_guard",
        target="lmcache.integration.vllm.vllm_v1_adapter",
        requires={"lmcache": ">=0.4.5,<0.6"},
        flags=("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST"),
    ),
    CatalogueEntry(
        name="vllm-multigroup-load-failures",
        module="lmcache_ascend.patches.vllm.multigroup_load_failures",
        target="vllm.v1.core.sched.scheduler",
        requires={"vllm": ">=0.18.0"},
    ),
    CatalogueEntry(
        name="lmcache-remote-chunk-seal",
        module="lmcache_ascend.patches.lmcache.remote_chunk_seal",
        target="lmcache.v1.storage_backend.remote_backend",
        requires={"lmcache": ">=0.4.5,<0.6"},
        flags=("LMCACHE_ASCEND_CHUNK_SEAL",),
        enabled_by="LMCACHE_ASCEND_CHUNK_SEAL",
    ),
    CatalogueEntry(
        name="lmcache-disk-chunk-seal",
        module="lmcache_ascend.patches.lmcache.disk_chunk_seal",
        target="lmcache.v1.storage_backend.local_disk_backend",
        requires={"lmcache": ">=0.4.5,<0.6"},
        flags=("LMCACHE_ASCEND_CHUNK_SEAL",),
        enabled_by="LMCACHE_ASCEND_CHUNK_SEAL",
    ),
    CatalogueEntry(
        name="lmcache-redis-get-releases",
        module="lmcache_ascend.patches.lmcache.redis_get_releases",
        target="lmcache.v1.storage_backend.connector.redis_connector",
        requires={"lmcache": ">=0.4.5,<0.6", "redis": ">=4"},
    ),
    CatalogueEntry(
        name="vllm-lmcache-chunk-size-early",
        module="lmcache_ascend.patches.vllm.lmcache_chunk_size_early",
        target="vllm.config.vllm",
        requires={"vllm": ">=0.18.0"},
    ),
)

# The declaration modules, in order.
PATCH_MODULES: tuple[str, ...] = tuple(dict.fromkeys(entry.module for entry in CATALOGUE))
