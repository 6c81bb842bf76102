"""Hole-mode CacheBlend, engine side: look up and retrieve past missing documents.

With blending on (LMCache's ``SegmentTokenDatabase``, layerwise), and only while
the blender side (`blend_holes_blender`) is active, ``LMCacheEngine.lookup`` asks
about EVERY document of the prompt and reports the end of the last cached one
(`SegmentLookup.loadable_hit_tokens`) instead of stopping at the first miss;
``LMCacheEngine.retrieve_layer``, when the hole-aware blender calls it, loads
every cached document (misses become gaps of LMCache's layerwise buffer, which it
already zeroes) and hands the blender the lookup it acted on, so the blender
recomputes exactly the tokens that were not loaded.  Every other call runs the
original unchanged.  Both hole paths are upstream's bodies continuing past a
miss: copies, each in one function with the fingerprint of what it copies.
"""

from __future__ import annotations

from lmcache_ascend.blend.holes import BLENDER_PATCH_NAME, ENGINE_PATCH_NAME, HOLE_SINK_KWARG
from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

# What the hole paths below copy: LMCache 0.4.5 / 0.5.6 (the same source on both).
LOOKUP_FINGERPRINT = "8cc9bcc92559"
RETRIEVE_LAYER_FINGERPRINT = "de803d3bae6d"


def _holes_apply(engine, tokens) -> bool:
    from lmcache.v1.token_database import SegmentTokenDatabase

    return tokens is not None and engine.use_layerwise and isinstance(engine.token_database, SegmentTokenDatabase)


def _blender_side_active() -> bool:
    """Hole-mode lookups only make sense if the blender will fill the holes."""
    from lmcache_ascend.patches import State, registry

    return registry.process_registry().state(BLENDER_PATCH_NAME) in (State.APPLIED, State.PENDING)


def lookup_wrapper(wrapped, instance, args, kwargs):
    call = call_arguments(wrapped, args, kwargs).arguments
    if not _holes_apply(instance, call["tokens"]) or not _blender_side_active() or not instance.is_healthy():
        return wrapped(*args, **kwargs)
    return lookup_past_misses(instance, **call)


def lookup_past_misses(self, tokens, hashes, offsets, search_range, lookup_id, pin, request_configs):
    """``LMCacheEngine.lookup`` (fingerprint LOOKUP_FINGERPRINT) asking about every document:
    the hit length is the end of the last cached one, not the first miss."""
    from lmcache_ascend.blend.segments import lookup_from_ranges

    if pin and lookup_id is None:
        raise ValueError("LMCacheEngine.lookup: lookup_id=None with pin=True; a pinned lookup needs an id")
    if search_range is None:
        search_range = self.retrieve_locations
    stats = self.stats_monitor.on_lookup_request(len(tokens))
    found = 0
    try:
        ranges = []
        for start, end, key in self.token_database.process_tokens(tokens=tokens, request_configs=request_configs):
            key_all_layers = key.split_layers(self.num_layers)
            hit_layers, block_mapping = self.storage_manager.batched_contains(key_all_layers, search_range, pin)
            # As upstream: a document counts only if every layer is in one place.
            hit = hit_layers == self.num_layers and len(block_mapping) == 1
            if hit and pin:
                location = next(iter(block_mapping))
                self.lookup_pins[lookup_id][location].extend(key_all_layers)
            ranges.append((start, end, hit))
        found = lookup_from_ranges(len(tokens), ranges).loadable_hit_tokens
        return found
    finally:
        self.stats_monitor.on_lookup_finished(stats, found)
        if pin:
            self.storage_manager.touch_cache()


def retrieve_layer_wrapper(wrapped, instance, args, kwargs):
    sink = kwargs.pop(HOLE_SINK_KWARG, None)
    call = call_arguments(wrapped, args, kwargs)
    if sink is None or not _holes_apply(instance, call.arguments["tokens"]):
        return wrapped(*args, **kwargs)
    return retrieve_layer_past_misses(instance, call.arguments["tokens"], call.arguments["mask"], sink, call.kwargs)


def _cached_documents(engine, tokens, mask, request_configs):
    """The documents to load, in order: (their ranges with hit flags, starts, ends, keys, location)."""
    ranges, starts, ends, keys = [], [], [], []
    location = None
    if not engine.is_healthy():
        return ranges, starts, ends, keys, location
    for start, end, key in engine.token_database.process_tokens(tokens=tokens, mask=mask, request_configs=request_configs):
        keys_multi_layer = key.split_layers(engine.num_layers)
        found_at = engine.storage_manager.contains(keys_multi_layer[0], engine.retrieve_locations)
        # One location per retrieval (upstream asserts it); a document
        # elsewhere is treated as a hole and recomputed.
        hit = bool(found_at) and (location is None or found_at == location)
        ranges.append((start, end, hit))
        if hit:
            location = found_at
            starts.append(start)
            ends.append(end)
            keys.append(keys_multi_layer)
    return ranges, starts, ends, keys, location


def retrieve_layer_past_misses(engine, tokens, mask, sink, kwargs):
    """``LMCacheEngine.retrieve_layer`` (fingerprint RETRIEVE_LAYER_FINGERPRINT) continuing past misses.

    Yields as upstream does (num_layers + 2 times): the retrieved token
    count, then None per layer, then the retrieved-token mask.
    """
    import torch

    from lmcache_ascend.blend.segments import lookup_from_ranges

    num_tokens = len(tokens)
    ranges, starts, ends, keys, location = _cached_documents(engine, tokens, mask, kwargs.get("request_configs"))
    retrieved = torch.zeros(num_tokens, dtype=torch.bool, device="cpu")
    for start, end in zip(starts, ends):
        retrieved[start:end] = True
    lookup = lookup_from_ranges(num_tokens, ranges)
    if keys and (starts[0] != lookup.segments[0].start or ends[-1] != num_tokens):
        # The lookup promised the first and last document; without them
        # the layerwise buffer would not cover the recomputed tokens.
        raise RuntimeError(
            f"hole-mode retrieval of {num_tokens} tokens found cached documents only in "
            f"[{starts[0]}, {ends[-1]}) but the first document starts at "
            f"{lookup.segments[0].start}: a pinned cache entry was lost after lookup"
        )
    sink(lookup, starts[0] if starts else 0)
    if not keys:
        # Nothing cached: no transfer; the blender recomputes every token.
        yield torch.sum(retrieved)
        for _ in range(engine.num_layers):
            yield None
        yield retrieved
        return
    yield from _load_layers(engine, keys, location, starts, ends, retrieved, kwargs)
    yield retrieved


def _load_layers(engine, keys, location, starts, ends, retrieved, kwargs):
    """Upstream's layer loop: one storage get and one device transfer per layer."""
    import torch

    keys_layer_major = [list(row) for row in zip(*keys)]
    get_generator = engine.storage_manager.layerwise_batched_get(keys_layer_major, location=location)
    mem_obj_consumer = engine.gpu_connector.batched_to_gpu(starts, ends, **kwargs)
    next(mem_obj_consumer)
    to_count_down = []
    for layer_id in range(engine.num_layers):
        task = next(get_generator)
        yield torch.sum(retrieved) if layer_id == 0 else None
        mem_objs_layer = task.result()
        mem_obj_consumer.send(mem_objs_layer)
        to_count_down.extend(mem_objs_layer)
    for mem_obj in to_count_down:
        mem_obj.ref_count_down()
    yield None
    next(mem_obj_consumer)  # the last layer reaches paged memory
    for mem_obj in to_count_down:
        if mem_obj.is_pinned:
            mem_obj.unpin()


PATCH = Patch(
    name=ENGINE_PATCH_NAME,
    target="lmcache.v1.cache_engine",
    attributes=("LMCacheEngine.lookup", "LMCacheEngine.retrieve_layer"),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        # Upstream's blending lookup and layerwise retrieval both stop at the first miss.
        fixed_if_source_contains=("hole_mode", "blend_holes"),
        unfixed_if_source_contains=("# hit chunks by prefix matching",),
    ),
    flags=("LMCACHE_ASCEND_BLEND_HOLES",),
    enabled_by="LMCACHE_ASCEND_BLEND_HOLES",
    wrappers={"LMCacheEngine.lookup": lookup_wrapper, "LMCacheEngine.retrieve_layer": retrieve_layer_wrapper},
    summary="CacheBlend lookup/retrieval continue past missing documents (hole mode)",
    why="one missing RAG document made LMCache recompute every cached document after it",
    mirrors="LMCache-Ascend PR #254 hole-aware lookup client/server and NPU buffer connector",
    delete_when="LMCache's blending lookup and layerwise retrieval handle non-contiguous hits",
    # LMCache 0.4.5 and 0.5.6 have the same source here
    tested_fingerprints={
        "LMCacheEngine.lookup": (LOOKUP_FINGERPRINT,),
        "LMCacheEngine.retrieve_layer": (RETRIEVE_LAYER_FINGERPRINT,),
    },
)
