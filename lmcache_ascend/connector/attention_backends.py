"""Ask the installed vLLM what each registered KV-cache tensor is (worker side).

Glue for `lmcache_ascend.kv_worker.backend_dims`: per layer registered as a
single tensor, find its attention backend (`layer.get_attn_backend()` of the
layers `vllm.config.get_layers_from_vllm_config` returns, as vLLM's own
`kv_connector.utils.get_current_attn_backends` does) and build its
`BackendDims` from the backend's own description:

- vLLM <= 0.23 (and vllm-ascend): `get_kv_cache_shape` called with the
  distinct sizes of a `ShapeProbe` tells the role of each dim, and
  `get_kv_cache_stride_order` the physical order the runner allocated;
- vLLM >= 0.32: every layer view is logical [blocks, heads, tokens,
  cell] (`create_kv_cache_views`) in the resolved `KVCacheLayout`, which the
  backend must list in `supported_kv_cache_layouts`; what a head slot is and
  whether a cell packs K and V come from the layer's KV-cache spec as the backend
  customized it (`num_head_slots`, `head_size_v`).

Layers of KV-cache groups that are not transferred are not described: callers
pass only the layers they move (`registration.transferred_kv_caches`).

vLLM is imported lazily; a layer vLLM does not know, or a backend whose layout
cannot be read, stops registration with an error naming the layer.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmcache_ascend.kv_worker.backend_dims import BackendDims, ShapeProbe, cell_dims, dims_from_probe
from lmcache_ascend.kv_worker.errors import KVCacheShapeError

__all__ = ["backend_dims_of", "describe_kv_caches"]


def _attention_layers(vllm_config: Any, names: list[str]) -> dict[str, Any]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)


def _stride_order(backend: type, vllm_config: Any) -> tuple[int, ...] | None:
    # Some backends read the connector's cache layout from the current vLLM config.
    import contextlib

    from vllm.config import set_current_vllm_config

    scope = set_current_vllm_config(vllm_config) if vllm_config is not None else contextlib.nullcontext()
    with scope:
        try:
            return tuple(backend.get_kv_cache_stride_order())
        except (AttributeError, NotImplementedError):
            return None


def _refuse_aiter_shuffle(backend: type) -> None:
    # rocm_aiter_fa.py (vLLM 0.23 and later): with VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT its
    # kernels write each block's K and V as shuffled head_size x block_size tiles, a
    # run-time switch that get_kv_cache_shape does not show.
    if not backend.__module__.endswith(".rocm_aiter_fa"):
        return
    from vllm._aiter_ops import rocm_aiter_ops

    if rocm_aiter_ops.is_shuffle_kv_cache_enabled():
        raise KVCacheShapeError(
            f"backend {backend.get_name()!r} ({backend.__module__}) is refused: the AITER shuffle KV-cache layout "
            "stores each block's K and V as shuffled head_size x block_size tiles, so a token's bytes are not its "
            "cells; turn VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT off"
        )


def backend_dims_of(backend: type, vllm_config: Any = None, kv_cache_spec: Any = None) -> BackendDims:
    """The layout `backend` (an AttentionBackend class) documents for its registered tensors."""
    name = backend.get_name()
    _refuse_aiter_shuffle(backend)
    cache_config = getattr(vllm_config, "cache_config", None)
    if hasattr(cache_config, "get_resolved_kv_cache_layout"):  # vLLM >= 0.32
        resolved = cache_config.get_resolved_kv_cache_layout()
        supported = backend.supported_kv_cache_layouts()
        if supported is not None and resolved not in supported:
            raise KVCacheShapeError(
                f"backend {name!r}: the resolved KV-cache layout {resolved.name} is not among the ones it "
                f"supports {[layout.name for layout in supported]}"
            )
        return cell_dims(
            name,
            packs_kv=bool(getattr(kv_cache_spec, "head_size_v", 0)),
            head_slots=getattr(kv_cache_spec, "num_head_slots", None),
        )
    probe = ShapeProbe()
    shape = backend.get_kv_cache_shape(
        num_blocks=probe.num_blocks,
        block_size=probe.block_size,
        num_kv_heads=probe.num_kv_heads,
        head_size=probe.head_size,
    )
    # FLASH_ATTN_DIFFKV declares its V head size as a class attribute (set_head_size_v).
    head_size_v = getattr(backend, "head_size_v", None)
    head_size_v = head_size_v if isinstance(head_size_v, int) else None
    return dims_from_probe(name, tuple(shape), probe, _stride_order(backend, vllm_config), head_size_v)


def describe_kv_caches(vllm_config: Any, kv_caches: Mapping[str, object]) -> dict[str, BackendDims]:
    """`BackendDims` of every layer registered as one tensor (tuples follow vllm-ascend's form)."""
    names = [name for name, cache in kv_caches.items() if isinstance(cache, torch.Tensor)]
    if not names:
        return {}
    if vllm_config is None:
        raise KVCacheShapeError(
            f"layers {names[:4]} registered single KV tensors but no vLLM config is at hand to ask their "
            "attention backends for the layout"
        )
    layers = _attention_layers(vllm_config, names)
    dims_by_layer = {}
    for name in names:
        layer = layers.get(name)
        if layer is None:
            tensor = kv_caches[name]
            raise KVCacheShapeError(
                f"layer {name!r} (shape {tuple(tensor.shape)}, dtype {tensor.dtype}): vLLM lists no attention "
                "layer of that name, so its backend's layout is unknown"
            )
        spec = None
        if hasattr(getattr(vllm_config, "cache_config", None), "get_resolved_kv_cache_layout"):
            spec = layer.get_kv_cache_spec(vllm_config)  # as the backend's customize_spec left it
        try:
            dims_by_layer[name] = backend_dims_of(layer.get_attn_backend(), vllm_config, spec)
        except KVCacheShapeError as error:
            tensor = kv_caches[name]
            raise KVCacheShapeError(f"layer {name!r} (shape {tuple(tensor.shape)}, dtype {tensor.dtype}): {error}") from None
    return dims_by_layer
