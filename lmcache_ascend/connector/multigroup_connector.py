"""LMCache ``GPUConnectorInterface`` over every KV-cache group and plane.

LMCache's own connectors move one homogeneous set of layers with one slot
mapping.  This one moves chunks through the flat chunk buffer planned by
`lmcache_ascend.kv_worker` (all layer groups, planes and scheduler groups), with
the transfer ops of `lmcache_ascend.kernels` (Triton on CUDA / NPU, the torch
reference on CPU).

Memory objects are byte buffers: uint8 ``[1, 1, tokens, ceil(bytes / tokens)]``
(LMCache reads the token count from dim 2), sized by `ChunkPlanner.memory_shape`;
the ``lmcache-metadata-chunk-bytes`` patch makes LMCache allocate that shape.

Slot mappings: the ``slot_mappings_by_group`` keyword (sequence indexed by
scheduler group, or a mapping), else the request's block ids (``StepBlockIds``)
handed over by the worker adapter patch (`hand_over_requests`; found by the
``req_id`` LMCache forwards), resolved to slots on the device once per request,
direction and step (a step's storing requests at hand-over, in one upload:
`DeviceSlots.for_requests`; a load when first needed), else the single
``slot_mapping`` stands for group 0 (single-group models). Chunks only index
into the device slots.

Batched calls (``batched_from_gpu`` / ``batched_to_gpu``, LMCache's store and
retrieve) move all full chunks of every layer group with ONE launch (Triton) and synchronize
once. Host memory objects go through a device staging buffer, in waves of chunks
whose copies run on a copy stream beside the next wave's kernels.

Imports LMCache: only loaded from a patch's build step or from tests.
"""

from __future__ import annotations

import logging
from operator import attrgetter, methodcaller
from typing import Any, Mapping, Sequence

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

from lmcache_ascend.kv_worker import ChunkPlanner, ChunkMover, LayerPlanes, KVCacheShapeError
from lmcache_ascend.kv_worker.device_slots import DeviceSlots

__all__ = ["MultiGroupGPUConnector"]

logger = logging.getLogger(__name__)

_raw_tensor_of = attrgetter("raw_tensor")
_size_of = methodcaller("get_size")


def _as_group_mapping(slot_mappings: object) -> dict[int, Any]:
    if isinstance(slot_mappings, Mapping):
        return {int(group): slots for group, slots in slot_mappings.items() if slots is not None}
    if isinstance(slot_mappings, Sequence):
        return {group: slots for group, slots in enumerate(slot_mappings) if slots is not None}
    raise KVCacheShapeError(
        f"slot_mappings_by_group is a {type(slot_mappings).__name__}; "
        "allowed: a sequence indexed by scheduler group or a mapping group -> tensor"
    )


class MultiGroupGPUConnector(GPUConnectorInterface):
    """Stores and loads LMCache chunks of multi-group / multi-plane KV caches."""

    def __init__(self, chunk_size: int, backend: str | None = None):
        """`backend`: the transfer backend (auto, triton or torch); None reads the user's
        LMCACHE_ASCEND_TRANSFER_BACKEND (the environment, else LMCache's configuration file),
        so that no path building this connector leaves the user's choice out."""
        if chunk_size <= 0:
            raise KVCacheShapeError(f"chunk_size={chunk_size} must be a positive int")
        if backend is None:
            from lmcache_ascend.flags import flag_value

            backend = flag_value("LMCACHE_ASCEND_TRANSFER_BACKEND")
        self.chunk_size = chunk_size
        self.backend = backend
        self.layers: tuple[LayerPlanes, ...] = ()
        self.planner: ChunkPlanner | None = None
        self.mover: ChunkMover | None = None
        self.kvcaches = None
        # req_id -> StepBlockIds of the step being served (handed over by the adapter patch),
        # and (req_id, store[, cached tokens]) -> its DeviceSlots (stores resolved at hand-over).
        self._request_slots: dict[str, Any] = {}
        self._device_slots_by_request: dict[tuple[str, bool], DeviceSlots] = {}
        self.launches = 0  # kernel launches so far (Triton: one per call and staging wave; reference: per layer group)
        self.synchronizations = 0  # device synchronizations so far (one per LMCache call)
        # Tokens of the chunks moved so far, per direction (what the engine asked for).
        self.tokens_stored = 0
        self.tokens_loaded = 0

    # ---- registration -------------------------------------------------------------
    def register(self, layers: Sequence[LayerPlanes], planner: ChunkPlanner) -> None:
        """Adopt a planned set of KV caches (see `lmcache_ascend.kv_worker.plan_kv_caches`)."""
        if planner.chunk_size != self.chunk_size:
            raise KVCacheShapeError(
                f"the layout was planned for chunk_size={planner.chunk_size} but the connector moves "
                f"chunks of {self.chunk_size} tokens"
            )
        self.layers = tuple(layers)
        self.planner = planner
        self.mover = ChunkMover(planner, self.backend)
        self._device_slots_by_request = {}

    def _require_registered(self) -> ChunkMover:
        if self.mover is None or self.planner is None:
            raise KVCacheShapeError("MultiGroupGPUConnector used before KV caches were registered")
        return self.mover

    # ---- LMCache interface ----------------------------------------------------------
    def get_shape(self, num_tokens: int) -> torch.Size:
        if self.planner is None:
            raise KVCacheShapeError("MultiGroupGPUConnector.get_shape called before KV caches were registered")
        return torch.Size(self.planner.memory_shape(num_tokens))

    def hand_over_requests(self, block_ids_by_request: Mapping[str, Any], stores: Sequence[str] = ()) -> None:
        """This step's requests (`StepBlockIds` by req_id), until `release_requests`.

        The slots of the requests in `stores` are resolved on the device now, in one
        upload (`DeviceSlots.for_requests`); a load resolves its request's slots when
        first needed (a staged load queues its first copies before). LMCache's engine
        forwards ``req_id`` to the connector, which then only indexes into them (when
        no ``slot_mappings_by_group`` keyword is given).
        """
        mover = self._require_registered()
        self._request_slots = {req_id: blocks for req_id, blocks in block_ids_by_request.items() if blocks is not None}
        storing = {(req_id, True): (self._request_slots[req_id], 0) for req_id in stores if req_id in self._request_slots}
        self._device_slots_by_request = (
            DeviceSlots.for_requests(storing, mover.planner, mover.device, mover.block_counts, mover.backend)
            if storing
            else {}
        )

    def release_requests(self) -> None:
        self._request_slots = {}
        self._device_slots_by_request = {}

    def _device_slots(self, kwargs: dict[str, Any], store: bool) -> DeviceSlots:
        mover = self._require_registered()
        cached_tokens = 0 if store else int(kwargs.get("vllm_cached_tokens", 0) or 0)
        if kwargs.get("slot_mappings_by_group") is not None:
            return mover.upload(_as_group_mapping(kwargs["slot_mappings_by_group"]), cached_tokens, kwargs.get("req_id"))
        key = (kwargs.get("req_id"), store)
        request_blocks = self._request_slots.get(key[0])
        if request_blocks is not None:
            if not store and cached_tokens > request_blocks.vllm_cached_tokens:
                key = (*key, cached_tokens)  # LMCache names a longer cached prefix than the scheduler did
            elif not store:
                cached_tokens = request_blocks.vllm_cached_tokens
            resolved = self._device_slots_by_request.get(key)
            if resolved is None:  # a load, or a store not named at hand-over: resolved here, once
                resolved = DeviceSlots.from_block_ids(
                    request_blocks, mover.planner, mover.device, cached_tokens, mover.block_counts, key[0], mover.backend,
                )
                self._device_slots_by_request[key] = resolved
            return resolved
        if kwargs.get("slot_mapping") is not None:
            in_use = self.planner.scheduler_groups_in_use()
            if in_use != (0,):
                raise KVCacheShapeError(
                    f"only 'slot_mapping' was given but the registered caches use scheduler groups {in_use}; "
                    "pass 'slot_mappings_by_group'"
                )
            return mover.upload({0: kwargs["slot_mapping"]}, cached_tokens, kwargs.get("req_id"))
        raise KVCacheShapeError("neither 'slot_mappings_by_group' nor 'slot_mapping' was given")

    def _memory_bytes(self, memory_obj: Any, start: int, end: int, total: int) -> torch.Tensor:
        """The memory object's bytes as a flat uint8 tensor holding at least `total` bytes.

        LMCache's tensor memory objects keep their bytes in a flat uint8 ``raw_tensor``: taken as
        is (their ``tensor`` builds three views per call, and a request has tens of objects),
        bounded by the object's logical size; other objects through ``tensor``.
        """
        raw = getattr(memory_obj, "raw_tensor", None)
        if isinstance(raw, torch.Tensor) and raw.dtype is torch.uint8 and raw.dim() == 1 and raw.is_contiguous():
            chunk = raw
            size = raw.numel()
            get_size = getattr(memory_obj, "get_size", None)
            if get_size is not None:
                size = min(size, int(get_size()))
        else:
            tensor = memory_obj.tensor
            if tensor is None:
                raise KVCacheShapeError("the memory object has no tensor")
            if not tensor.is_contiguous():
                raise KVCacheShapeError(f"memory object tensor of shape {tuple(tensor.shape)} is not contiguous")
            chunk = tensor.reshape(-1).view(torch.uint8)
            size = chunk.numel()
        if size < total:
            raise KVCacheShapeError(
                f"memory object of {size} bytes cannot hold tokens [{start}, {end}) "
                f"({total} bytes); was it allocated by the lmcache-metadata-chunk-bytes shape?"
            )
        return chunk

    def _full_chunks(self, memory_objs: list, starts: list[int], total: int) -> list[torch.Tensor]:
        """`_memory_bytes` of the full chunks of a call, LMCache's tensor memory objects read in one
        pass (a request has tens of them, each otherwise a dozen reads): their raw tensors where the
        first is a flat uint8 one, every logical size checked at once. Anything else, or a size that
        fails, takes `_memory_bytes` object by object (which names the object). That every raw tensor
        is flat uint8 like the first, on one device and holding its chunk, is the mover's check
        (`chunk_buffers`, one C++ call for alike buffers; `resolve_chunk_batches`), made once."""
        try:
            raws = list(map(_raw_tensor_of, memory_objs))
            first = raws[0] if raws else None
            # (the logical size bounds the bytes used; the raw tensor may be the larger allocation)
            if (type(first) is torch.Tensor and first.dtype is torch.uint8 and first.stride() == (1,)
                    and first.numel() >= total and min(map(_size_of, memory_objs)) >= total):
                return raws
        except (AttributeError, TypeError, ValueError):
            pass
        chunk_size = self.chunk_size
        return [self._memory_bytes(memory_obj, start, start + chunk_size, total)
                for memory_obj, start in zip(memory_objs, starts)]

    def _count_tokens(self, starts: Sequence[int], ends: Sequence[int], store: bool) -> None:
        moved = sum(end - start for start, end in zip(starts, ends))
        if store:
            self.tokens_stored += moved
        else:
            self.tokens_loaded += moved

    def _move_one(self, memory_obj: Any, start: int, end: int, slots: DeviceSlots, *, store: bool) -> None:
        mover = self._require_registered()
        total = self.planner.plan(end - start).total_bytes
        chunk = self._memory_bytes(memory_obj, start, end, total)
        if mover.device.type == "cpu" or chunk.device == mover.device:
            self.launches += mover.move(chunk, start, end, slots, store=store)
            return
        staged = mover.staging_buffer(1)[0][:total]
        if store:
            self.launches += mover.move(staged, start, end, slots, store=True)
            chunk[:total].copy_(staged, non_blocking=True)
        else:
            staged.copy_(chunk[:total], non_blocking=True)
            self.launches += mover.move(staged, start, end, slots, store=False)

    def _move_many(self, memory_objs: Any, starts: Sequence[int], ends: Sequence[int], kwargs: dict[str, Any],
                   *, store: bool) -> None:
        """Every memory object's size checked before any byte moves (their placement by the mover: through
        staging, the first wave's before the others, see `staging.Stager.move`); then the full chunks
        in one batched move (one launch), a partial one on its own; one synchronization.

        The slots are resolved when first needed: a staged load queues its first copies before."""
        mover = self._require_registered()
        starts, ends = list(starts), list(ends)
        if not (len(starts) == len(ends) == len(memory_objs)):
            raise KVCacheShapeError(
                f"{len(memory_objs)} memory objects, {len(starts)} starts and {len(ends)} ends; they must match"
            )
        resolved: list[DeviceSlots] = []

        def slots() -> DeviceSlots:
            if not resolved:
                resolved.append(self._device_slots(kwargs, store))
            return resolved[0]

        chunk_size = self.chunk_size
        full_total = self.planner.full_plan.total_bytes
        full_objs, full_starts, partial = [], [], []
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            if end - start == chunk_size:
                full_objs.append(memory_obj)
                full_starts.append(start)
            else:  # a partial chunk has a plan of its own (and is checked there, before anything moves)
                partial.append((memory_obj, start, end))
        full_chunks = self._full_chunks(full_objs, full_starts, full_total) if full_objs else []
        for memory_obj, start, end in partial:
            self._memory_bytes(memory_obj, start, end, self.planner.plan(end - start).total_bytes)
        self._count_tokens(starts, ends, store)
        # (Full chunks first: their staged copies may start before the slots are resolved. The
        # batched move leaves the staging buffer to the current stream, so a partial chunk's use of
        # it comes after.)
        if full_chunks:
            self.launches += mover.move_chunks(full_chunks, full_starts, slots, store=store)
        for memory_obj, start, end in partial:
            self._move_one(memory_obj, start, end, slots(), store=store)
        self._synchronize()

    def _synchronize(self) -> None:
        device = self._require_registered().device
        if device.type == "cpu":
            return
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize(device)
            self.synchronizations += 1

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._move_many([memory_obj], [start], [end], kwargs, store=True)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self._move_many([memory_obj], [start], [end], kwargs, store=False)

    def batched_from_gpu(self, memory_objs: Any, starts: Sequence[int], ends: Sequence[int], **kwargs: Any) -> None:
        self._move_many(list(memory_objs), starts, ends, kwargs, store=True)

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Sequence[int] | None = None, ends: Sequence[int] | None = None, **kwargs: Any
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise KVCacheShapeError("MultiGroupGPUConnector.batched_to_gpu needs memory_objs, starts and ends")
        self._move_many(list(memory_objs), starts, ends, kwargs, store=False)
