"""Hole-mode CacheBlend, blender side: always recompute holes, top-k the rest.

What: ``LMCBlender.blend_layer`` passes the hole-aware engine
(`blend_holes_engine`) a sink through which the retrieval reports the
`SegmentLookup` it acted on; ``LMCBlender.process_qkv`` then, at the check
layer, selects hole tokens (everything not loaded) plus, per stretch of cached
documents, the top ``ratio`` of cached tokens by K deviation
(`lmcache_ascend.blend.selection`), and before the check layer writes the
freshly computed K/V of every token into the layerwise buffer, so holes (which
LMCache's buffer zeroes) never reach paged memory with zero or stale KV.
Without a reported lookup (engine side off, or a standard request) both run
the original.
Why: standard CacheBlend assumes a contiguous cached prefix; with holes the
unloaded tokens must be recomputed in every layer, whatever their deviation.
Mirrors: LMCache-Ascend PR #254 (``LMCBlenderHole``), rewritten as a thin
wrapper around LMCache's own blender.
Delete when: LMCache's blender handles non-contiguous cached segments.
"""

from __future__ import annotations

from lmcache_ascend.patches import Patch, PatchContext, PatchKind, UpstreamGuard
from lmcache_ascend.patches.lmcache.blend_holes_engine import BLENDER_PATCH_NAME, HOLE_SINK_KWARG

# Per-request state on the blender: (SegmentLookup, first buffer token) or None.
HOLE_STATE_ATTRIBUTE = "_ascend_blend_hole_state"


def _build(ctx: PatchContext) -> dict[str, object]:
    import torch

    from lmcache_ascend.blend.selection import select_recompute_tokens

    original_process_qkv = ctx.original_function("LMCBlender.process_qkv")
    original_blend_layer = ctx.original_function("LMCBlender.blend_layer")

    def blend_layer(self, tokens, mask=None, **kwargs):
        setattr(self, HOLE_STATE_ATTRIBUTE, None)  # never carry a lookup across requests
        engine_retrieve = getattr(type(self.cache_engine), "retrieve_layer", None)
        if getattr(engine_retrieve, "_ascend_accepts_hole_sink", False):

            def receive(lookup, buffer_start: int) -> None:
                setattr(self, HOLE_STATE_ATTRIBUTE, (lookup, buffer_start))

            kwargs[HOLE_SINK_KWARG] = receive
        yield from original_blend_layer(self, tokens, mask, **kwargs)

    def process_qkv(self, q, k, v, residual, layer_id, attn_output, attn_metadata):
        state = getattr(self, HOLE_STATE_ATTRIBUTE, None)
        if state is None:
            return original_process_qkv(self, q, k, v, residual, layer_id, attn_output, attn_metadata)
        lookup, buffer_start = state
        if self.metadata.imp_indices is None and lookup.num_tokens != q.shape[0]:
            raise ValueError(
                f"hole-mode blend: the retrieval covered {lookup.num_tokens} tokens but layer "
                f"{layer_id} computes {q.shape[0]}; the blender and engine disagree on the request"
            )
        old_k, old_v = self.gpu_connector.get_kv(layer_id)
        buffer_rows = slice(buffer_start, buffer_start + old_k.shape[0])
        if attn_output is None:
            attn_output = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        metadata = self.metadata
        if metadata.positions is None:
            metadata.positions = torch.arange(q.shape[0], device=q.device, dtype=torch.int64)
        rotary = self.layerwise_model.vllm_model.model.layers[layer_id].self_attn.rotary_emb
        q, k = rotary(metadata.positions, q, k)

        if metadata.imp_indices is None and layer_id not in self.common_metadata.check_layers:
            # Before the check layer every token is recomputed; its fresh KV is
            # exact, and holes have none in the buffer, so it goes there.
            old_k.copy_(k[buffer_rows])
            old_v.copy_(v[buffer_rows])
            return q, k, v, residual, attn_output, attn_metadata

        if metadata.imp_indices is None:  # the check layer: choose once
            cached_mask = torch.tensor(lookup.cached_token_mask(), dtype=torch.bool)
            cached_k = torch.zeros_like(k)
            cached_k[buffer_rows] = old_k
            assert self.common_metadata.recomp_ratios is not None, "blend_recompute_ratios is not set"
            selection = select_recompute_tokens(
                k,
                cached_k,
                cached_mask,
                self.common_metadata.recomp_ratios[0],
                lookup.cached_stretches(),
            )
            chosen = selection.indices.to(q.device)
            q, k, v, residual = q[chosen], k[chosen], v[chosen], residual[chosen]
            metadata.imp_indices = chosen
            metadata.positions = metadata.positions[chosen]
            attn_output = attn_output[: chosen.numel()]
            attn_metadata.update_from_top_indices(chosen)

        chosen = metadata.imp_indices
        inside = (chosen >= buffer_rows.start) & (chosen < buffer_rows.stop)
        old_k[chosen[inside] - buffer_start] = k[inside]
        old_v[chosen[inside] - buffer_start] = v[inside]
        if buffer_start:
            # Tokens before the buffer are holes (all chosen, first in order):
            # attention still needs their keys.
            return (
                q,
                torch.cat((k[:buffer_start], old_k)),
                torch.cat((v[:buffer_start], old_v)),
                residual,
                attn_output,
                attn_metadata,
            )
        return q, old_k, old_v, residual, attn_output, attn_metadata

    return {"LMCBlender.blend_layer": blend_layer, "LMCBlender.process_qkv": process_qkv}


PATCH = Patch(
    name=BLENDER_PATCH_NAME,
    target="lmcache.v1.compute.blend.blender",
    attributes=("LMCBlender.blend_layer", "LMCBlender.process_qkv"),
    kind=PatchKind.WRAP,
    requires={"lmcache": ">=0.4.5,<0.6"},
    guard=UpstreamGuard(
        fixed_if_source_contains=("hole_mode", "blend_holes"),
        unfixed_if_source_contains=("top_indices = torch.topk(diff_k, k=topk_num).indices",),
    ),
    flags=("LMCACHE_ASCEND_BLEND_HOLES",),
    enabled_by="LMCACHE_ASCEND_BLEND_HOLES",
    build=_build,
    summary="CacheBlend recomputes every hole token plus top-k deviating cached tokens (hole mode)",
    why="with non-contiguous cached documents the unloaded tokens must be recomputed in every layer",
    mirrors="LMCache-Ascend PR #254 LMCBlenderHole",
    delete_when="LMCache's blender handles non-contiguous cached segments",
    tested_fingerprints={
        "LMCBlender.blend_layer": ("c5badfc0c845",),  # same on stacks A and B
        "LMCBlender.process_qkv": ("445bef1d82ca", "2c13e195487b"),  # stack A, stack B (log format)
    },
)
