"""Worker side of multi-group KV caches in LMCache's in-process vLLM adapter.

in ``lmcache.integration.vllm.vllm_v1_adapter``,
``LMCacheConnectorV1Impl.register_kv_caches`` swaps lmcache-ascend's
``MultiGroupGPUConnector`` into the engine when the registered caches are
multi-group or multi-plane (or the device has no LMCache connector), and
``start_load_kv`` / ``wait_for_save`` hand that connector the per-group block
ids the scheduler attached to each ``ReqMeta`` (``ascend_step_block_ids``) for
the duration of the call. ``wait_for_save`` has the slots of every storing
request resolved on the device at hand-over, in one upload; a load resolves its
request's slots inside the call, once its first staged copies are queued (the
copy engine starts while the host resolves them). LMCache forwards ``req_id`` to
the connector, which then only indexes into the slots.
``wait_for_save`` never persists a chunk that has a row to store on vLLM's null
block (e.g. a sliding-window tail released after a vLLM prefix hit): such a
chunk would be loaded later as if it were KV. Single-group CUDA models keep
upstream's connector and path unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def _bound_connector(adapter):
    """The engine's connector when it is lmcache-ascend's multi-group one, else None."""
    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector

    engine = adapter.lmcache_engine
    connector = getattr(engine, "gpu_connector", None) if engine is not None else None
    return connector if isinstance(connector, MultiGroupGPUConnector) else None


def _step_requests(adapter):
    """The requests of this step's connector metadata, fetched once per call."""
    return getattr(adapter._parent._get_connector_metadata(), "requests", ()) or ()


def _run_with_request_slots(adapter, requests, wrapped, args, kwargs, *, stores=()):
    """Call `wrapped` with the multi-group connector holding each scheduled request's block ids;
    the slots of the requests in `stores` resolved on the device first, in one upload."""
    from lmcache_ascend.multigroup.attachments import STEP_BLOCK_IDS

    connector = _bound_connector(adapter)
    if connector is None:
        return wrapped(*args, **kwargs)
    connector.hand_over_requests({request.req_id: STEP_BLOCK_IDS.get(request) for request in requests}, stores=stores)
    try:
        return wrapped(*args, **kwargs)
    finally:
        connector.release_requests()


def _stores(adapter, request) -> bool:
    # Upstream stores for a producer even when can_save is False.
    save_spec = getattr(request, "save_spec", None)
    return save_spec is not None and bool(save_spec.can_save or getattr(adapter, "kv_role", None) == "kv_producer")


def register_kv_caches_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.connector.install import install_multigroup_connector

    wrapped(*args, **kwargs)
    install_multigroup_connector(instance)


def start_load_kv_wrapper(wrapped, instance, args, kwargs):
    # A load's slots are resolved inside its call, once its first staged copies are queued.
    return _run_with_request_slots(instance, _step_requests(instance), wrapped, args, kwargs)


def wait_for_save_wrapper(wrapped, instance, args, kwargs):
    requests = _step_requests(instance)
    storing = [request for request in requests if _stores(instance, request)]
    _skip_unfillable_chunks(instance, storing, _worker_groups(instance))
    return _run_with_request_slots(instance, requests, wrapped, args, kwargs,
                                   stores=[request.req_id for request in storing])


def _worker_groups(adapter):
    """This worker's KV-cache groups, against which the scheduler's block ids are read: the bound
    multi-group connector's chunk planner, else the adapter's KV-cache groups (None: one group)."""
    from lmcache_ascend.multigroup.attachments import CONNECTOR_GROUPS

    connector = _bound_connector(adapter)
    if connector is not None and connector.planner is not None:
        return connector.planner
    return CONNECTOR_GROUPS.get(adapter)


def _skip_unfillable_chunks(adapter, storing, groups) -> None:
    """Raise each storing request's store start past its last chunk with a row on vLLM's null block
    (`groups`: this worker's KV-cache groups, `_worker_groups`)."""
    from lmcache_ascend.multigroup.attachments import STEP_BLOCK_IDS

    producer = getattr(adapter, "kv_role", None) == "kv_producer"
    for request in storing:
        blocks = STEP_BLOCK_IDS.get(request)
        if blocks is None:
            continue
        if groups is None:
            raise ValueError(
                f"request {request.req_id}: the scheduler shipped per-group block ids but this worker knows no "
                "multi-group layout (is the lmcache-adapter-multigroup patch applied on the worker?)"
            )
        save_spec = request.save_spec
        first = blocks.first_storable_token(groups)
        # A producer starts at min(skip_leading_tokens, disagg_spec.num_transferred_tokens):
        # both must be raised, or upstream lowers the start below the holes again.
        disagg_spec = getattr(request, "disagg_spec", None) if producer else None
        starts = [save_spec.skip_leading_tokens]
        if disagg_spec is not None:
            starts.append(disagg_spec.num_transferred_tokens)
        if first <= min(starts):
            continue
        _log_skipped_store(request.req_id, min(starts), first)
        request.save_spec = dataclasses.replace(save_spec, skip_leading_tokens=max(first, starts[0]))
        if disagg_spec is not None and disagg_spec.num_transferred_tokens < first:
            # Upstream sets it to the stored length after the store; nothing else reads it.
            disagg_spec.num_transferred_tokens = first


def _log_skipped_store(request_id: str, requested_start: int, start: int) -> None:
    import logging

    logging.getLogger("lmcache_ascend").warning(
        "request %s: not storing tokens %d..%d: a group's rows there are on vLLM's null block (nothing to copy)",
        request_id, requested_start, start,
    )


def _upstream_moves_groups(module) -> bool | None:
    """Upstream has it when its save path hands the engine per-group slot mappings."""
    try:
        source = inspect.getsource(module.LMCacheConnectorV1Impl.wait_for_save)
    except (OSError, TypeError):
        return None
    return "by_group" in source


PATCH = Patch(
    name="lmcache-adapter-worker-multigroup",
    target="lmcache.integration.vllm.vllm_v1_adapter",
    attributes=(
        "LMCacheConnectorV1Impl.register_kv_caches",
        "LMCacheConnectorV1Impl.start_load_kv",
        "LMCacheConnectorV1Impl.wait_for_save",
    ),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        probe=_upstream_moves_groups,
        fixed_if_source_contains=("slot_mappings_by_group",),
        unfixed_if_source_contains=("slot_mapping=slot_mapping,",),
    ),
    wrappers={
        "LMCacheConnectorV1Impl.register_kv_caches": register_kv_caches_wrapper,
        "LMCacheConnectorV1Impl.start_load_kv": start_load_kv_wrapper,
        "LMCacheConnectorV1Impl.wait_for_save": wait_for_save_wrapper,
    },
    summary="worker moves every KV-cache group: multi-group connector swapped in, per-group slots fed per request",
    why="upstream moves only group 0 with one homogeneous connector; other groups and multi-plane layers are lost",
    mirrors="LMCache-Ascend #246 (multi-group NPU connector, per-group wait_for_save / start_load_kv)",
    delete_when="LMCache's in-process adapter moves every KV-cache group with its own slot mapping",
    tested_fingerprints={
        "LMCacheConnectorV1Impl.register_kv_caches": ("3eee7627bac0",),
        "LMCacheConnectorV1Impl.start_load_kv": ("8cbe83622c92", "2e407dc6c655"),
        "LMCacheConnectorV1Impl.wait_for_save": ("9758f7129ea7", "a35cb49ca491"),
    },
)
