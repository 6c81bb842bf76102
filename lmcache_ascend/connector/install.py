"""Swap the multi-group connector into a registered LMCache engine (worker side).

Called by the worker adapter patch right after vLLM registered its KV caches:
decides whether LMCache's own connector can serve them, and if not plans the
chunk buffer, registers the caches with `MultiGroupGPUConnector` and makes the
engine use it (its metadata then allocates byte-format chunks), and folds a
digest of the chunk plan and of the model's files into the model name LMCache
puts in every chunk key (`name_keys_by_plan`).

Imports LMCache-facing modules lazily; the decisions are the pure functions of
`lmcache_ascend.kv_worker.registration`.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from lmcache_ascend.kv_worker import KVCacheShapeError
from lmcache_ascend.kv_worker.registration import (
    needs_multigroup_connector,
    plan_kv_caches,
    plane_groups_from_layer_names,
    transferred_kv_caches,
)
from lmcache_ascend.multigroup.attachments import CHUNK_PLANNER, CONNECTOR_GROUPS
from lmcache_ascend.multigroup.specs import KVGroupSpec

__all__ = ["install_multigroup_connector", "name_keys_by_plan", "plan_for_engine"]

logger = logging.getLogger(__name__)

def _adapter_kv_groups(adapter: Any, kv_cache_config: Any) -> Any:
    if CONNECTOR_GROUPS.is_set(adapter):  # set by the lmcache-adapter-multigroup patch
        return CONNECTOR_GROUPS.get(adapter)
    from lmcache_ascend.multigroup.connector_state import kv_groups_for_connector

    return kv_groups_for_connector(kv_cache_config, adapter._block_size, getattr(adapter, "config", None))


_started: list[bool] = []  # the start line is logged once per process


def _group_text(group: KVGroupSpec) -> str:
    text = f"{group.group_index} {group.spec_class_name} (block {group.block_size}"
    if group.mixed_ratios:
        text += f", compress ratios {', '.join(map(str, group.ratios))} by layer"
    elif group.compress_ratio > 1:
        text += f", compress ratio {group.compress_ratio}"
    if group.sliding_window is not None:
        text += f", window {group.sliding_window}"
    return text + ")"


def start_line(engine: Any, kv_groups: Any, vllm_block_size: int, ours: bool) -> str:
    """What the overlay does in this engine: its version, the chunk hash in force, the groups moved and skipped."""
    import os

    from lmcache_ascend import __version__
    from lmcache_ascend.token_hash import describe_chunk_hash

    database = getattr(engine, "token_database", None)
    chunk_hash = describe_chunk_hash(getattr(database, "hash_func", None), os.environ) if database else "unknown"
    if kv_groups is None:
        groups = f"one group (vLLM block size {vllm_block_size})"
    else:
        moved = [_group_text(group) for group in kv_groups.groups if group.transferred]
        skipped = [_group_text(group) for group in kv_groups.groups if not group.transferred]
        groups = f"{', '.join(moved)}; skipped: {', '.join(skipped) or 'none'}"
    mover = "lmcache-ascend's MultiGroupGPUConnector" if ours else "LMCache's own GPU connector"
    return (
        f"lmcache-ascend {__version__} active: chunk keys by {chunk_hash}; KV-cache groups moved: {groups}; "
        f"transfers by {mover}"
    )


def _log_start(adapter: Any, engine: Any, kv_groups: Any, ours: bool) -> None:
    if _started:
        return
    _started.append(True)
    # Through LMCache's adapter logger where LMCache set one up (our own logger has no handler in
    # an engine, and INFO would be lost); LMCACHE_LOG_LEVEL then governs it as it does LMCache's lines.
    adapter_logger = logging.getLogger(type(adapter).__module__)
    target = adapter_logger if adapter_logger.handlers else logger
    target.info("%s", start_line(engine, kv_groups, getattr(adapter, "_block_size", 0), ours))


def plan_for_engine(
    engine: Any,
    kv_caches: Mapping[str, object],
    plane_groups: Mapping[str, Sequence[int]],
    geometry_by_group: Mapping[int, KVGroupSpec],
    *,
    bundle_multi_spec: bool,
    backend: str | None = None,
    backend_dims: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    num_blocks: int | None = None,
):
    """Register `kv_caches` with a MultiGroupGPUConnector and make `engine` use it.

    `backend`: the transfer backend (LMCACHE_ASCEND_TRANSFER_BACKEND), for a connector
    built here and for one the engine already has (None: a connector built here reads
    the flag itself, one the engine has keeps its own).
    `backend_dims`: the attention backend's `BackendDims` of each layer
    registered as a single tensor (see `connector.attention_backends`). `model`: the
    model's identity (`kv_worker.chunk_identity.model_identity`), folded with the
    chunk plan into the model name of every chunk key (`name_keys_by_plan`).
    `num_blocks`: vLLM's block count, where `geometry_by_group` is vLLM's groups (checked
    against every moved plane's pages).
    """
    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector

    chunk_size = engine.config.chunk_size
    layers, planner = plan_kv_caches(
        kv_caches,
        plane_groups,
        geometry_by_group,
        chunk_size,
        bundle_multi_spec=bundle_multi_spec,
        backend_dims=backend_dims,
        num_blocks=num_blocks,
    )
    connector = engine.gpu_connector
    if not isinstance(connector, MultiGroupGPUConnector):
        connector = MultiGroupGPUConnector(chunk_size, backend=backend)
    elif backend is not None:
        # The connector LMCache's factory built: the mover `register` builds takes this backend.
        connector.backend = backend
    connector.register(layers, planner)
    engine.gpu_connector = connector
    CHUNK_PLANNER.set(engine.metadata, planner)  # read by the lmcache-metadata-chunk-bytes patch
    name_keys_by_plan(engine.metadata, planner, model)
    logger.info(
        "lmcache-ascend: %d layers in %d layer groups, %d bytes per %d-token chunk",
        len(layers),
        len(planner.layer_groups),
        planner.full_plan.total_bytes,
        chunk_size,
    )
    return connector


def name_keys_by_plan(metadata: Any, planner: Any, model: Mapping[str, Any] | None) -> str:
    """Fold the digest of the chunk plan and the model into LMCache's model name, which every key carries.

    LMCache's token database builds each key from this metadata object, on store,
    lookup and retrieve alike, so engines whose chunks hold other bytes (another
    plan, other weights) never find each other's chunks. Returns the new name.
    """
    from lmcache_ascend.kv_worker.chunk_identity import chunk_identity_digest, keyed_model_name, plan_description

    identity = dict(model) if model is not None else {"revision": None, "config": {}, "weights": None}
    digest = chunk_identity_digest(plan_description(planner), identity)
    before = metadata.model_name
    metadata.model_name = keyed_model_name(before, digest)
    weights = identity.get("weights")
    logger.info(
        "lmcache-ascend: chunk keys name model %r as %r (chunk plan of %d bytes, %s)",
        before,
        metadata.model_name,
        planner.full_plan.total_bytes,
        f"{len(weights)} weights files" if weights is not None else "no local weights files: config and name only",
    )
    return metadata.model_name


def _model_identity(adapter: Any) -> dict:
    from lmcache_ascend.kv_worker.chunk_identity import model_identity

    model_config = getattr(getattr(adapter, "_vllm_config", None), "model_config", None)
    if model_config is None:
        return model_identity("", None, None)
    hf_config = getattr(model_config, "hf_config", None)
    config = hf_config.to_diff_dict() if hasattr(hf_config, "to_diff_dict") else {}
    config.pop("transformers_version", None)
    return model_identity(str(model_config.model), config, getattr(model_config, "revision", None))


def install_multigroup_connector(adapter: Any):
    """After ``LMCacheConnectorV1Impl.register_kv_caches``: use our connector where needed.

    Returns the connector in use when it is ours, None when LMCache's own stays.
    """
    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector
    from lmcache_ascend.flags import flag_value

    engine = adapter.lmcache_engine
    if engine is None:  # LMCache runs degraded (recompute); nothing to move
        return None
    kv_caches = adapter.kv_caches
    kv_cache_config = getattr(getattr(adapter, "_parent", None), "_kv_cache_config", None)
    kv_groups = _adapter_kv_groups(adapter, kv_cache_config)
    if kv_cache_config is not None and getattr(kv_cache_config, "kv_cache_groups", None):
        plane_groups = plane_groups_from_layer_names(
            [group.layer_names for group in kv_cache_config.kv_cache_groups], kv_caches
        )
    else:
        plane_groups = {name: (0,) for name in kv_caches}
    if kv_groups is not None:
        geometry = kv_groups.groups_by_index()
    else:
        used = sorted({g for groups in plane_groups.values() for g in groups})
        if used != [0]:
            raise KVCacheShapeError(
                f"KV caches map to scheduler groups {used} but no multi-group layout is known; "
                "is the lmcache-adapter-multigroup patch applied?"
            )
        # One group of full attention: its block size never shapes a transfer.
        geometry = {0: KVGroupSpec(0, "single group", block_size=1)}
    from lmcache_ascend.connector.attention_backends import describe_kv_caches

    # Layers of groups that are not moved (e.g. mamba state registered as a raw buffer
    # under no attention layer) are not described.
    moved = transferred_kv_caches(kv_caches, plane_groups, geometry)
    backend_dims = describe_kv_caches(getattr(adapter, "_vllm_config", None), moved)
    ours = isinstance(engine.gpu_connector, MultiGroupGPUConnector)
    if not ours and not needs_multigroup_connector(kv_caches, plane_groups, backend_dims):
        _log_start(adapter, engine, kv_groups if kv_groups is not None and kv_groups.is_multi_group else None, False)
        return None
    if getattr(adapter, "use_layerwise", False):
        raise KVCacheShapeError(
            "LMCache use_layerwise=True cannot move multi-group / multi-plane KV caches (the layerwise "
            "connectors handle one homogeneous layer set); set use_layerwise: false"
        )
    config = getattr(adapter, "config", None)
    connector = plan_for_engine(
        engine,
        kv_caches,
        plane_groups,
        geometry,
        bundle_multi_spec=flag_value("LMCACHE_ASCEND_BUNDLE_MULTI_SPEC", lmcache_config=config),
        backend=flag_value("LMCACHE_ASCEND_TRANSFER_BACKEND", lmcache_config=config),
        backend_dims=backend_dims,
        model=_model_identity(adapter),
        num_blocks=getattr(kv_cache_config, "num_blocks", None) if kv_groups is not None else None,
    )
    _log_start(adapter, engine, kv_groups if kv_groups is not None and kv_groups.is_multi_group else None, True)
    return connector
