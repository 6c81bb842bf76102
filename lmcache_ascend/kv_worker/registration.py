"""From vLLM's registered KV caches and scheduler groups to a chunk layout.

`plan_kv_caches` runs once at registration: it detects every layer's format,
groups layers, and computes the chunk-buffer plan, so every layout error is
raised there, naming the layer.  `needs_multigroup_connector` tells whether
LMCache's own connector can serve the caches (one scheduler group, plain
formats, CUDA) or ours must.

Pure logic: torch and lmcache_ascend only.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch

from lmcache_ascend.kv_worker.backend_dims import BackendDims
from lmcache_ascend.kv_worker.chunk_plan import ChunkPlanner
from lmcache_ascend.kv_worker.layer_planes import KVFormat, LayerPlanes, KVCacheShapeError, detect_layer_planes
from lmcache_ascend.kv_worker.groups import build_layer_groups
from lmcache_ascend.multigroup.specs import KVGroupSpec

__all__ = [
    "check_page_geometry",
    "needs_multigroup_connector",
    "plan_kv_caches",
    "plane_groups_from_layer_names",
    "transferred_kv_caches",
]


def plane_groups_from_layer_names(
    layer_names_by_group: Sequence[Sequence[str]], kv_caches: Mapping[str, object]
) -> dict[str, tuple[int, ...]]:
    """Scheduler group of each registered plane, from vLLM's per-group layer names.

    A layer listed by one group maps all its planes there.  A layer listed by k
    groups must register k planes; plane i belongs to the i-th of those groups
    (vLLM's group order).  An unlisted layer sharing a listed layer's cache (vLLM
    KV sharing) takes that layer's groups; its bytes then move once.
    """
    listed: dict[str, list[int]] = {}
    for group, names in enumerate(layer_names_by_group):
        for name in names:
            listed.setdefault(name, []).append(group)
    def first_address(cache: object) -> int | None:
        first = cache[0] if isinstance(cache, (tuple, list)) and cache else cache
        return first.data_ptr() if isinstance(first, torch.Tensor) else None

    # vLLM KV sharing registers a layer that reuses another layer's cache without
    # listing it in any group: it follows the layer whose tensor it shares.
    groups_by_address = {
        first_address(cache): tuple(listed[name]) for name, cache in kv_caches.items() if name in listed
    }
    plane_groups: dict[str, tuple[int, ...]] = {}
    for name, cache in kv_caches.items():
        groups = listed.get(name) or groups_by_address.get(first_address(cache))
        if not groups:
            raise KVCacheShapeError(
                f"layer {name!r} has a registered KV cache but no scheduler KV-cache group lists it "
                "(nor does it share the cache of a listed layer)"
            )
        count = len(cache) if isinstance(cache, (tuple, list)) else 1
        if len(groups) > 1 and len(groups) != count:
            raise KVCacheShapeError(
                f"layer {name!r} is listed by scheduler groups {groups} but registers {count} planes; "
                "a layer in k groups needs k planes"
            )
        plane_groups[name] = tuple(groups)
    return plane_groups


def transferred_kv_caches(
    kv_caches: Mapping[str, object],
    plane_groups: Mapping[str, Sequence[int]],
    geometry_by_group: Mapping[int, KVGroupSpec],
) -> dict[str, object]:
    """`kv_caches` less the layers whose every plane belongs to a group that is not
    transferred (state groups under the state-skip policy): those are never moved,
    so neither their backend nor their layout is asked for.  A layer with no group,
    or with a group not in `geometry_by_group`, stays for `plan_kv_caches` to refuse."""
    kept = {}
    for name, cache in kv_caches.items():
        groups = plane_groups.get(name)
        skipped = groups and all(
            group in geometry_by_group and not geometry_by_group[group].transferred for group in groups
        )
        if not skipped:
            kept[name] = cache
    return kept


def plan_kv_caches(
    kv_caches: Mapping[str, object],
    plane_groups: Mapping[str, Sequence[int]],
    geometry_by_group: Mapping[int, KVGroupSpec],
    chunk_size: int,
    *,
    bundle_multi_spec: bool = True,
    backend_dims: Mapping[str, BackendDims] | None = None,
    num_blocks: int | None = None,
) -> tuple[tuple[LayerPlanes, ...], ChunkPlanner]:
    """Detect, group and plan; every layout error surfaces here.

    `backend_dims` describes each layer registered as a single tensor (its
    attention backend's layout); layers registered as tuples of planes follow
    vllm-ascend's documented form and need none. `num_blocks` (vLLM's
    `KVCacheConfig.num_blocks`, where the groups' geometry is vLLM's) makes every
    moved plane prove it pages its group's blocks (`check_page_geometry`).
    """
    if not kv_caches:
        raise KVCacheShapeError("no KV caches were registered")
    kv_caches = transferred_kv_caches(kv_caches, plane_groups, geometry_by_group)
    layers = []
    for name, cache in kv_caches.items():
        groups = plane_groups.get(name)
        if groups is None:
            raise KVCacheShapeError(f"layer {name!r}: no scheduler group given for its planes")
        layers.append(
            detect_layer_planes(
                name,
                cache,
                groups,
                backend_dims=(backend_dims or {}).get(name),
            )
        )
    layers = [_with_layer_ratios(layer, geometry_by_group) for layer in layers]
    if num_blocks is not None:
        check_page_geometry(layers, geometry_by_group, num_blocks)
    layer_groups = build_layer_groups(layers, geometry_by_group, bundle_multi_spec=bundle_multi_spec)
    return tuple(layers), ChunkPlanner(layer_groups, geometry_by_group, chunk_size)


def _with_layer_ratios(layer: LayerPlanes, geometry_by_group: Mapping[int, KVGroupSpec]) -> LayerPlanes:
    """`layer` with its compress ratio on each plane of a group whose layers compress at several ratios
    (from the layer's own KV-cache spec, `KVGroupSpec.ratio_of`); other planes keep their group's one ratio."""
    planes = []
    for plane in layer.planes:
        group = geometry_by_group.get(plane.scheduler_group)
        if group is not None and group.transferred and group.mixed_ratios:
            try:
                ratio = group.ratio_of(layer.layer_name)
            except ValueError as error:
                raise KVCacheShapeError(str(error)) from None
            plane = dataclasses.replace(plane, compress_ratio=ratio)
        planes.append(plane)
    return dataclasses.replace(layer, planes=tuple(planes))


def check_page_geometry(
    layers: Sequence[LayerPlanes], geometry_by_group: Mapping[int, KVGroupSpec], num_blocks: int
) -> None:
    """Every moved plane's pages are its group's blocks: as many rows per block as the group's
    block holds (block_size // compress_ratio, its own layer's ratio where the group's layers
    compress at several) and at least vLLM's `num_blocks` of them.

    A tensor whose page is something else (a state-space layer's state page read as token
    rows, a backend that pages differently from its spec) would make every slot address
    other bytes; it is refused here, naming layer, tensor and group.
    """
    for layer in layers:
        for plane in layer.planes:
            group = geometry_by_group.get(plane.scheduler_group)
            if group is None or not group.transferred:
                continue
            ratio = plane.compress_ratio or group.single_ratio("a plane's rows per block")
            rows_per_block = group.block_size // ratio
            if plane.block_size != rows_per_block or plane.num_blocks < num_blocks:
                raise KVCacheShapeError(
                    f"layer {layer.layer_name!r} plane {plane.plane_index} ({layer.format.name}, {plane.dtype}, "
                    f"{plane.num_blocks} blocks of {plane.block_size} rows of {plane.row_bytes} bytes) does not page "
                    f"KV-cache group {group.group_index} ({group.spec_class_name}: {num_blocks} blocks of "
                    f"{group.block_size} tokens, compress_ratio {ratio}, so {rows_per_block} rows "
                    "per block); its slots would address other bytes"
                )


def needs_multigroup_connector(
    kv_caches: Mapping[str, object],
    plane_groups: Mapping[str, Sequence[int]],
    backend_dims: Mapping[str, BackendDims] | None = None,
) -> bool:
    """True unless LMCache's own connector serves the caches: one scheduler group,
    merged / separate / single-tensor MLA layers of one dtype and shape, on CUDA."""
    groups = {group for planes in plane_groups.values() for group in planes}
    if len(groups) > 1:
        return True
    shapes = set()
    for name, cache in kv_caches.items():
        layer = detect_layer_planes(
            name,
            cache,
            plane_groups.get(name, (0,)),
            backend_dims=(backend_dims or {}).get(name),
        )
        tensors = [cache] if isinstance(cache, torch.Tensor) else list(cache)
        single_latent = layer.format is KVFormat.MLA and len(tensors) == 1
        if layer.format not in (KVFormat.MERGED, KVFormat.SEPARATE) and not single_latent:
            return True
        if any(tensor.device.type != "cuda" for tensor in tensors):
            return True
        shapes.add(tuple((tuple(t.shape), t.dtype) for t in tensors))
    return len(shapes) > 1
