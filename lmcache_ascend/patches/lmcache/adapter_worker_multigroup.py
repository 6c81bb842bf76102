"""Worker side of multi-group KV caches in LMCache's in-process vLLM adapter.

What: in ``lmcache.integration.vllm.vllm_v1_adapter``,
``LMCacheConnectorV1Impl.register_kv_caches`` swaps lmcache-ascend's
``MultiGroupGPUConnector`` into the engine when the registered caches are
multi-group or multi-plane (or the device has no LMCache connector), and
``start_load_kv`` / ``wait_for_save`` hand that connector the per-group slot
mappings the scheduler attached to each ``ReqMeta`` (``ascend_group_slots``)
for the duration of the call; LMCache forwards ``req_id`` to the connector,
which picks the request's slots. ``wait_for_save`` never persists a chunk that
has a row to store on vLLM's null block (e.g. a sliding-window tail released
after a vLLM prefix hit): such a chunk would be loaded later as if it were KV. Single-group CUDA models keep upstream's
connector and path unchanged.
Why: upstream moves one homogeneous layer set with the slot mapping of group 0,
so every other group's KV (and every multi-plane layer) is lost or rejected.
Mirrors: LMCache-Ascend #246 (multi-group NPU connector and the adapter's
per-group ``wait_for_save`` / ``start_load_kv``).
Delete when: LMCache's in-process adapter and connector move every KV-cache
group with its own slot mapping.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard


def _build(ctx: PatchContext) -> dict[str, object]:
    from lmcache_ascend.connector.install import install_multigroup_connector
    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector
    from lmcache_ascend.multigroup.slots import group_slots_of

    original_register = ctx.original_function("LMCacheConnectorV1Impl.register_kv_caches")
    original_start_load = ctx.original_function("LMCacheConnectorV1Impl.start_load_kv")
    original_wait_for_save = ctx.original_function("LMCacheConnectorV1Impl.wait_for_save")

    def bound_connector(adapter):
        engine = adapter.lmcache_engine
        connector = getattr(engine, "gpu_connector", None) if engine is not None else None
        return connector if isinstance(connector, MultiGroupGPUConnector) else None

    def step_requests(adapter):
        return getattr(adapter._parent._get_connector_metadata(), "requests", ()) or ()

    def run_with_request_slots(adapter, original, requests, *args, **kwargs):
        connector = bound_connector(adapter)
        if connector is None:
            return original(adapter, *args, **kwargs)
        connector.hand_over_requests({request.req_id: group_slots_of(request) for request in requests})
        try:
            return original(adapter, *args, **kwargs)
        finally:
            connector.release_requests()

    @functools.wraps(original_register)
    def register_kv_caches(self, kv_caches):
        original_register(self, kv_caches)
        install_multigroup_connector(self)

    @functools.wraps(original_start_load)
    def start_load_kv(self, forward_context, **kwargs):
        return run_with_request_slots(self, original_start_load, step_requests(self), forward_context, **kwargs)

    def skip_unfillable_chunks(adapter, requests) -> None:
        """Raise each request's store start past its last chunk with a row on vLLM's null block."""
        producer = getattr(adapter, "kv_role", None) == "kv_producer"
        for request in requests:
            slots = group_slots_of(request)
            save_spec = getattr(request, "save_spec", None)
            # Upstream stores for a producer even when can_save is False.
            if slots is None or save_spec is None or not (save_spec.can_save or producer):
                continue
            first = slots.first_storable_token()
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

    @functools.wraps(original_wait_for_save)
    def wait_for_save(self):
        requests = step_requests(self)
        skip_unfillable_chunks(self, requests)
        return run_with_request_slots(self, original_wait_for_save, requests)

    return {
        "LMCacheConnectorV1Impl.register_kv_caches": register_kv_caches,
        "LMCacheConnectorV1Impl.start_load_kv": start_load_kv,
        "LMCacheConnectorV1Impl.wait_for_save": wait_for_save,
    }


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
    build=_build,
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
