"""Hole-mode CacheBlend, engine side: look up and retrieve past missing documents.

What: with blending on (LMCache's ``SegmentTokenDatabase``, layerwise), and
only while the blender side (`blend_holes_blender`) is active,
``LMCacheEngine.lookup`` asks about EVERY document of the prompt and reports
the end of the last cached one (`SegmentLookup.loadable_hit_tokens`) instead
of stopping at the first miss; ``LMCacheEngine.retrieve_layer``, when the
hole-aware blender calls it, loads every cached document (misses become gaps
of LMCache's layerwise buffer, which it already zeroes) and hands the blender
the lookup it acted on, so the blender recomputes exactly the tokens that
were not loaded.  Every other call runs the original unchanged.
Why: RAG prompts put documents in varying order; one missing document early
in the prompt made LMCache recompute every cached document after it.  Also
avoids upstream's ``UnboundLocalError`` when nothing at all is retrieved.
Mirrors: LMCache-Ascend PR #254 ("hole-aware lookup client and server"),
rewritten on the in-process engine so both the lookup server and the bypass
lookup client get it.
Delete when: LMCache's blending lookup and retrieval handle non-contiguous
hits (not the case in 0.4.5 / 0.5.6).
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard

PATCH_NAME = "lmcache-blend-holes-engine"
BLENDER_PATCH_NAME = "lmcache-blend-holes-blender"
# Keyword the hole-aware blender passes to retrieve_layer: a callable that
# receives the `SegmentLookup` the retrieval acted on (and the buffer offset).
HOLE_SINK_KWARG = "ascend_blend_hole_sink"


def _blender_side_active() -> bool:
    """Hole-mode lookups only make sense if the blender will fill the holes."""
    from lmcache_ascend.patches import State, registry

    return registry.state(BLENDER_PATCH_NAME) in (State.APPLIED, State.PENDING)


def _build(ctx: PatchContext) -> dict[str, object]:
    import logging

    import torch
    from lmcache.v1.token_database import SegmentTokenDatabase

    from lmcache_ascend.blend.segments import lookup_from_ranges

    logger = logging.getLogger("lmcache_ascend.blend")
    original_lookup = ctx.original_function("LMCacheEngine.lookup")
    original_retrieve_layer = ctx.original_function("LMCacheEngine.retrieve_layer")

    def holes_apply(engine, tokens) -> bool:
        return (
            tokens is not None
            and engine.use_layerwise
            and isinstance(engine.token_database, SegmentTokenDatabase)
        )

    def lookup(
        self,
        tokens=None,
        hashes=None,
        offsets=None,
        search_range=None,
        lookup_id=None,
        pin=False,
        request_configs=None,
    ):
        arguments = dict(
            tokens=tokens,
            hashes=hashes,
            offsets=offsets,
            search_range=search_range,
            lookup_id=lookup_id,
            pin=pin,
            request_configs=request_configs,
        )
        if not holes_apply(self, tokens) or not _blender_side_active() or not self.is_healthy():
            return original_lookup(self, **arguments)
        if pin and lookup_id is None:
            raise ValueError("LMCacheEngine.lookup: lookup_id=None with pin=True; a pinned lookup needs an id")
        if search_range is None:
            search_range = self.retrieve_locations
        stats = self.stats_monitor.on_lookup_request(len(tokens))
        found = 0
        try:
            ranges = []
            for start, end, key in self.token_database.process_tokens(
                tokens=tokens, request_configs=request_configs
            ):
                key_all_layers = key.split_layers(self.num_layers)
                hit_layers, block_mapping = self.storage_manager.batched_contains(
                    key_all_layers, search_range, pin
                )
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

    def retrieve_layer(self, tokens, mask=None, **kwargs):
        sink = kwargs.pop(HOLE_SINK_KWARG, None)
        if sink is None or not holes_apply(self, tokens):
            return original_retrieve_layer(self, tokens, mask, **kwargs)
        return _retrieve_layer_with_holes(self, tokens, mask, sink, kwargs)

    def _retrieve_layer_with_holes(engine, tokens, mask, sink, kwargs):
        """Upstream's layerwise retrieval, continuing past misses.

        Yields as upstream does (num_layers + 2 times): the retrieved token
        count, then None per layer, then the retrieved-token mask.
        """
        num_tokens = len(tokens)
        retrieved = torch.zeros(num_tokens, dtype=torch.bool, device="cpu")
        ranges, starts, ends, keys = [], [], [], []
        location = None
        if engine.is_healthy():
            for start, end, key in engine.token_database.process_tokens(
                tokens=tokens, mask=mask, request_configs=kwargs.get("request_configs")
            ):
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
            logger.debug("hole-mode retrieval: nothing cached among %d tokens", num_tokens)
            yield torch.sum(retrieved)
            for _ in range(engine.num_layers):
                yield None
            yield retrieved
            return

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
        logger.debug(
            "hole-mode retrieval: %d of %d tokens from %d documents",
            int(retrieved.sum()),
            num_tokens,
            len(keys),
        )
        yield retrieved

    retrieve_layer._ascend_accepts_hole_sink = True  # noqa: SLF001 (read by the blender patch)
    return {"LMCacheEngine.lookup": lookup, "LMCacheEngine.retrieve_layer": retrieve_layer}


PATCH = Patch(
    name=PATCH_NAME,
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
    build=_build,
    summary="CacheBlend lookup/retrieval continue past missing documents (hole mode)",
    why="one missing RAG document made LMCache recompute every cached document after it",
    mirrors="LMCache-Ascend PR #254 hole-aware lookup client/server and NPU buffer connector",
    delete_when="LMCache's blending lookup and layerwise retrieval handle non-contiguous hits",
    # stack A (lmcache 0.4.5) and stack B (0.5.6) have the same source here
    tested_fingerprints={
        "LMCacheEngine.lookup": ("8cc9bcc92559",),
        "LMCacheEngine.retrieve_layer": ("de803d3bae6d",),
    },
)
