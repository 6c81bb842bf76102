"""Hole-mode CacheBlend, blender side: always recompute holes, top-k the rest.

``LMCBlender.blend_layer`` passes the hole-aware engine (`blend_holes_engine`) a
sink through which the retrieval reports the `SegmentLookup` it acted on;
``LMCBlender.process_qkv`` then, at the check layer, selects hole tokens
(everything not loaded) plus, per stretch of cached documents, the top ``ratio``
of cached tokens by K deviation (`lmcache_ascend.blend.selection`), and before
the check layer writes the freshly computed K/V of every token into the
layerwise buffer, so holes (which LMCache's buffer zeroes) never reach paged
memory with zero or stale KV.  Without a reported lookup (engine side off, or a
standard request) both run the original.
"""

from __future__ import annotations

from lmcache_ascend.blend.holes import BLENDER_PATCH_NAME, ENGINE_PATCH_NAME, HOLE_SINK_KWARG, HOLE_STATE_ATTRIBUTE
from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard


def blend_layer_wrapper(wrapped, instance, args, kwargs):
    from lmcache_ascend.compat.markers import patch_names_on

    setattr(instance, HOLE_STATE_ATTRIBUTE, None)  # never carry a lookup across requests
    engine_retrieve = getattr(type(instance.cache_engine), "retrieve_layer", None)
    if ENGINE_PATCH_NAME in patch_names_on(engine_retrieve):

        def receive(lookup, buffer_start: int) -> None:
            setattr(instance, HOLE_STATE_ATTRIBUTE, (lookup, buffer_start))

        kwargs = {**kwargs, HOLE_SINK_KWARG: receive}
    return wrapped(*args, **kwargs)


def process_qkv_wrapper(wrapped, instance, args, kwargs):
    state = getattr(instance, HOLE_STATE_ATTRIBUTE, None)
    if state is None:
        return wrapped(*args, **kwargs)
    import torch

    call = call_arguments(wrapped, args, kwargs).arguments
    q, k, v, layer_id = call["q"], call["k"], call["v"], call["layer_id"]
    lookup, buffer_start = state
    metadata = instance.metadata
    if metadata.imp_indices is None and lookup.num_tokens != q.shape[0]:
        raise ValueError(
            f"hole-mode blend: the retrieval covered {lookup.num_tokens} tokens but layer "
            f"{layer_id} computes {q.shape[0]}; the blender and engine disagree on the request"
        )
    old_k, old_v = instance.gpu_connector.get_kv(layer_id)
    buffer_rows = slice(buffer_start, buffer_start + old_k.shape[0])
    attn_output = call["attn_output"]
    if attn_output is None:
        attn_output = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if metadata.positions is None:
        metadata.positions = torch.arange(q.shape[0], device=q.device, dtype=torch.int64)
    rotary = instance.layerwise_model.vllm_model.model.layers[layer_id].self_attn.rotary_emb
    q, k = rotary(metadata.positions, q, k)
    residual, attn_metadata = call["residual"], call["attn_metadata"]
    if metadata.imp_indices is None and layer_id not in instance.common_metadata.check_layers:
        # Before the check layer every token is recomputed; its fresh KV is
        # exact, and holes have none in the buffer, so it goes there.
        old_k.copy_(k[buffer_rows])
        old_v.copy_(v[buffer_rows])
        return q, k, v, residual, attn_output, attn_metadata
    if metadata.imp_indices is None:  # the check layer: choose once
        chosen = _choose_recomputed_tokens(instance, lookup, k, old_k, buffer_rows)
        q, k, v, residual = q[chosen], k[chosen], v[chosen], residual[chosen]
        metadata.imp_indices = chosen
        metadata.positions = metadata.positions[chosen]
        attn_output = attn_output[: chosen.numel()]
        attn_metadata.update_from_top_indices(chosen)
    k, v = _write_chosen_kv(metadata.imp_indices, k, v, old_k, old_v, buffer_rows)
    return q, k, v, residual, attn_output, attn_metadata


def _choose_recomputed_tokens(blender, lookup, k, old_k, buffer_rows):
    """Every hole token plus the top deviating cached tokens of each stretch, on k's device."""
    import torch

    from lmcache_ascend.blend.selection import select_recompute_tokens

    cached_mask = torch.tensor(lookup.cached_token_mask(), dtype=torch.bool)
    cached_k = torch.zeros_like(k)
    cached_k[buffer_rows] = old_k
    assert blender.common_metadata.recomp_ratios is not None, "blend_recompute_ratios is not set"
    selection = select_recompute_tokens(
        k, cached_k, cached_mask, blender.common_metadata.recomp_ratios[0], lookup.cached_stretches()
    )
    return selection.indices.to(k.device)


def _write_chosen_kv(chosen, k, v, old_k, old_v, buffer_rows):
    """Write the recomputed tokens' K/V into the buffer; the K/V attention then uses."""
    import torch

    buffer_start = buffer_rows.start
    inside = (chosen >= buffer_start) & (chosen < buffer_rows.stop)
    old_k[chosen[inside] - buffer_start] = k[inside]
    old_v[chosen[inside] - buffer_start] = v[inside]
    if buffer_start:
        # Tokens before the buffer are holes (all chosen, first in order):
        # attention still needs their keys.
        return torch.cat((k[:buffer_start], old_k)), torch.cat((v[:buffer_start], old_v))
    return old_k, old_v


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
    wrappers={"LMCBlender.blend_layer": blend_layer_wrapper, "LMCBlender.process_qkv": process_qkv_wrapper},
    summary="CacheBlend recomputes every hole token plus top-k deviating cached tokens (hole mode)",
    why="with non-contiguous cached documents the unloaded tokens must be recomputed in every layer",
    mirrors="LMCache-Ascend PR #254 LMCBlenderHole",
    delete_when="LMCache's blender handles non-contiguous cached segments",
    tested_fingerprints={
        "LMCBlender.blend_layer": ("c5badfc0c845",),  # same on LMCache 0.4.5 and 0.5.6
        "LMCBlender.process_qkv": ("445bef1d82ca", "2c13e195487b"),  # LMCache 0.4.5, LMCache 0.5.6 (log format)
    },
)
