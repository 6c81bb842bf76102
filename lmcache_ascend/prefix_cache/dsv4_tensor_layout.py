"""KV-cache tensor layout for DeepSeek-V4's many KV-cache groups (vllm-ascend).

All groups share one block id space: block ``i`` of every layer lives at row
``i`` of that layer's tensor, and layers of different groups at the same slot
share one tensor. vllm-ascend plans the tensors from the page sizes of the
FIRST group only, so a layer whose page size the first group lacks (a
compressed group at block size 32 or 64) gets no tensor, and a slot no group
fills still gets an empty tensor that eats memory. Here the page sizes are
aggregated across every group, empty slots are skipped, and one block costs
exactly the sum of the page sizes of the tensors that are planned.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from lmcache_ascend.prefix_cache.block_sizes import aggregated_page_size_bytes


@dataclasses.dataclass(frozen=True)
class LayerPage:
    """One layer of a KV-cache group and the bytes one block of it takes."""

    layer_name: str
    page_size_bytes: int


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One KV-cache tensor: ``page_size_bytes`` per block, shared by these layers."""

    page_size_bytes: int
    shared_by: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Dsv4TensorPlan:
    tensors: tuple[PlannedTensor, ...]
    bytes_per_block: int

    def num_blocks_for(self, available_memory: int) -> int:
        if available_memory < 0:
            raise ValueError(f"available_memory={available_memory} must be >= 0 bytes")
        return available_memory // self.bytes_per_block


def _is_mtp_layer(layer_name: str) -> bool:
    # vllm-ascend's rule: multi-token-prediction layers get a tensor of their own.
    return "mtp" in layer_name


def plan_dsv4_kv_tensors(
    layer_pages_by_group: Sequence[Sequence[LayerPage]],
    is_own_tensor_layer: Callable[[str], bool] = _is_mtp_layer,
) -> Dsv4TensorPlan:
    """Tensors for every layer of every group, page sizes aggregated across groups.

    Within a group, layers are bucketed by page size in registration order; the
    ``k``-th layer of each group's bucket for page size ``p`` shares the ``k``-th
    tensor of size ``p`` (vllm-ascend's slot order: slot outer, page size
    inner). Layers matched by ``is_own_tensor_layer`` (MTP) come last, one
    tensor each. Every layer is in exactly one tensor; no tensor is empty.
    """
    if not layer_pages_by_group:
        raise ValueError("layer_pages_by_group is empty; DeepSeek-V4 needs at least one KV-cache group")
    seen: set[str] = set()
    buckets_by_group: list[dict[int, list[str]]] = []
    own_tensor_layers: list[LayerPage] = []
    for group_index, layer_pages in enumerate(layer_pages_by_group):
        buckets: dict[int, list[str]] = {}
        for page in layer_pages:
            if page.page_size_bytes <= 0:
                raise ValueError(
                    f"layer {page.layer_name!r} of group {group_index} has page_size_bytes="
                    f"{page.page_size_bytes}; allowed: > 0"
                )
            if page.layer_name in seen:
                raise ValueError(f"layer {page.layer_name!r} appears in more than one group (again in group {group_index})")
            seen.add(page.layer_name)
            if is_own_tensor_layer(page.layer_name):
                own_tensor_layers.append(page)
            else:
                buckets.setdefault(page.page_size_bytes, []).append(page.layer_name)
        buckets_by_group.append(buckets)

    page_sizes = sorted({size for buckets in buckets_by_group for size in buckets})
    num_slots = max((len(layers) for buckets in buckets_by_group for layers in buckets.values()), default=0)
    tensors: list[PlannedTensor] = []
    for slot in range(num_slots):
        for page_size in page_sizes:
            shared_by = tuple(
                buckets[page_size][slot]
                for buckets in buckets_by_group
                if slot < len(buckets.get(page_size, ()))
            )
            if shared_by:  # a slot no group fills would only waste memory
                tensors.append(PlannedTensor(page_size, shared_by))
    tensors.extend(PlannedTensor(page.page_size_bytes, (page.layer_name,)) for page in own_tensor_layers)
    if not tensors:
        raise ValueError("no layers in any KV-cache group; nothing to allocate")
    return Dsv4TensorPlan(tuple(tensors), aggregated_page_size_bytes(t.page_size_bytes for t in tensors))
