"""LMCache ``GPUConnectorInterface`` over every KV-cache group and plane.

LMCache's own connectors move one homogeneous set of layers with one slot
mapping.  This one moves each chunk through the flat chunk buffer planned by
`lmcache_ascend.kv_layout` (all layer groups, planes and scheduler groups, one
kernel launch per layer group), with the transfer ops of
`lmcache_ascend.kernels` (Triton on CUDA / NPU, the torch reference on CPU).

Memory objects are byte buffers: uint8 ``[1, 1, tokens, ceil(bytes / tokens)]``
(LMCache reads the token count from dim 2), sized by `ChunkLayout.memory_shape`;
the ``lmcache-metadata-chunk-bytes`` patch makes LMCache allocate that shape.

Per-group slot mappings come from the ``slot_mappings_by_group`` keyword
(sequence indexed by scheduler group, or a mapping), else from the request's
``GroupSlotMappings`` bound by the worker adapter patch (found by the
``req_id`` LMCache forwards), else the single ``slot_mapping`` stands for
group 0 (single-group models).

Imports LMCache: only loaded from a patch's build step or from tests.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

from lmcache_ascend.kv_layout import ChunkLayout, ChunkMover, LayerLayout, LayoutError

__all__ = ["MultiGroupGPUConnector"]

logger = logging.getLogger(__name__)


def _as_group_mapping(slot_mappings: object) -> dict[int, torch.Tensor]:
    if isinstance(slot_mappings, Mapping):
        return {int(group): slots for group, slots in slot_mappings.items() if slots is not None}
    if isinstance(slot_mappings, Sequence):
        return {group: slots for group, slots in enumerate(slot_mappings) if slots is not None}
    raise LayoutError(
        f"slot_mappings_by_group is a {type(slot_mappings).__name__}; "
        "allowed: a sequence indexed by scheduler group or a mapping group -> tensor"
    )


class MultiGroupGPUConnector(GPUConnectorInterface):
    """Stores and loads LMCache chunks of multi-group / multi-plane KV caches."""

    def __init__(self, chunk_size: int, backend: str | None = None):
        if chunk_size <= 0:
            raise LayoutError(f"chunk_size={chunk_size} must be a positive int")
        self.chunk_size = chunk_size
        self.backend = backend
        self.layers: tuple[LayerLayout, ...] = ()
        self.layout: ChunkLayout | None = None
        self.mover: ChunkMover | None = None
        self.kvcaches = None
        self._staging: torch.Tensor | None = None
        # req_id -> GroupSlotMappings of the step being served (bound by the adapter patch).
        self._request_slots: dict[str, Any] = {}
        self.launches = 0  # kernel launches so far (one per layer group per chunk)
        # Tokens of the chunks moved so far, per direction (what the engine asked for).
        self.tokens_stored = 0
        self.tokens_loaded = 0

    # ---- registration -------------------------------------------------------------
    def register(self, layers: Sequence[LayerLayout], layout: ChunkLayout) -> None:
        """Adopt a planned set of KV caches (see `lmcache_ascend.kv_layout.plan_kv_caches`)."""
        if layout.chunk_size != self.chunk_size:
            raise LayoutError(
                f"the layout was planned for chunk_size={layout.chunk_size} but the connector moves "
                f"chunks of {self.chunk_size} tokens"
            )
        self.layers = tuple(layers)
        self.layout = layout
        self.mover = ChunkMover(layout, self.backend)
        device = self.mover.device
        # Kernels need the chunk on the caches' device; host memory objects go through
        # one device staging buffer of a full chunk (allocated once).
        self._staging = (
            None
            if device.type == "cpu"
            else torch.empty(layout.full_plan.total_bytes, dtype=torch.uint8, device=device)
        )

    def _require_registered(self) -> ChunkMover:
        if self.mover is None or self.layout is None:
            raise LayoutError("MultiGroupGPUConnector used before KV caches were registered")
        return self.mover

    # ---- LMCache interface ----------------------------------------------------------
    def get_shape(self, num_tokens: int) -> torch.Size:
        if self.layout is None:
            raise LayoutError("MultiGroupGPUConnector.get_shape called before KV caches were registered")
        return torch.Size(self.layout.memory_shape(num_tokens))

    def bind_request_slots(self, group_slots_by_request: Mapping[str, Any]) -> None:
        """Per-group slots of this step's requests (`lmcache_ascend.multigroup.slots.GroupSlotMappings`).

        LMCache's engine forwards ``req_id`` to the connector; the slots of that
        request are used when no ``slot_mappings_by_group`` keyword is given.
        """
        self._request_slots = {req_id: slots for req_id, slots in group_slots_by_request.items() if slots is not None}

    def unbind_request_slots(self) -> None:
        self._request_slots = {}

    def _slot_mappings(self, kwargs: dict[str, Any], store: bool) -> dict[int, torch.Tensor]:
        device = self._require_registered().device
        request_slots = self._request_slots.get(kwargs.get("req_id"))
        if kwargs.get("slot_mappings_by_group") is not None:
            mappings = _as_group_mapping(kwargs["slot_mappings_by_group"])
        elif request_slots is not None:
            pick = request_slots.store_slot_mapping if store else request_slots.load_slot_mapping
            mappings = {group: pick(group) for group in request_slots.transferred_groups}
        elif kwargs.get("slot_mapping") is not None:
            in_use = self.layout.scheduler_groups_in_use()
            if in_use != (0,):
                raise LayoutError(
                    f"only 'slot_mapping' was given but the registered caches use scheduler groups {in_use}; "
                    "pass 'slot_mappings_by_group'"
                )
            mappings = {0: kwargs["slot_mapping"]}
        else:
            raise LayoutError("neither 'slot_mappings_by_group' nor 'slot_mapping' was given")
        return {
            group: (slots if isinstance(slots, torch.Tensor) else torch.as_tensor(slots))
            .to(device=device, dtype=torch.int64)
            .contiguous()
            for group, slots in mappings.items()
        }

    def _memory_bytes(self, memory_obj: Any) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None:
            raise LayoutError("the memory object has no tensor")
        if not tensor.is_contiguous():
            raise LayoutError(f"memory object tensor of shape {tuple(tensor.shape)} is not contiguous")
        return tensor.reshape(-1).view(torch.uint8)

    def _move(self, memory_obj: Any, start: int, end: int, kwargs: dict[str, Any], *, store: bool) -> None:
        mover = self._require_registered()
        slot_mappings = self._slot_mappings(kwargs, store)
        chunk = self._memory_bytes(memory_obj)
        total = self.layout.plan(end - start).total_bytes
        if chunk.numel() < total:
            raise LayoutError(
                f"memory object of {chunk.numel()} bytes cannot hold tokens [{start}, {end}) "
                f"({total} bytes); was it allocated by the lmcache-metadata-chunk-bytes shape?"
            )
        skip = 0 if store else int(kwargs.get("vllm_cached_tokens", 0) or 0)
        if store:
            self.tokens_stored += end - start
        else:
            self.tokens_loaded += end - start
        if self._staging is None or chunk.device == self._staging.device:
            self.launches += mover.move(chunk, start, end, slot_mappings, store=store, skip_tokens_before=skip)
            return
        staging = self._staging[:total]
        if store:
            self.launches += mover.move(staging, start, end, slot_mappings, store=True)
            chunk[:total].copy_(staging, non_blocking=True)
        else:
            staging.copy_(chunk[:total], non_blocking=True)
            self.launches += mover.move(staging, start, end, slot_mappings, store=False, skip_tokens_before=skip)

    def _synchronize(self) -> None:
        device = self._require_registered().device
        if device.type == "cpu":
            return
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize(device)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._move(memory_obj, start, end, kwargs, store=True)
        self._synchronize()

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._move(memory_obj, start, end, kwargs, store=False)
        self._synchronize()

    def batched_from_gpu(self, memory_objs: Any, starts: Sequence[int], ends: Sequence[int], **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self._move(memory_obj, start, end, kwargs, store=True)
        self._synchronize()

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Sequence[int] | None = None, ends: Sequence[int] | None = None, **kwargs: Any
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise LayoutError("MultiGroupGPUConnector.batched_to_gpu needs memory_objs, starts and ends")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self._move(memory_obj, start, end, kwargs, store=False)
        self._synchronize()
