"""Host chunks through a device staging buffer, in waves whose copies run beside the next wave's kernels.

`staging_waves` sizes the waves; `StagedWaves` holds one staged call's chunks and
says what each wave copies where (neighbouring host chunks joined into one copy where
the staging buffer allows); `Stager` owns the buffer and drives the copy stream and
the events around the launches, which the mover (`transfer.ChunkMover`) hands it.

Pure logic: torch, numpy and lmcache_ascend only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.kernels import ChunkBuffers, align_up, chunk_buffers, pool_chunk_buffers
from lmcache_ascend.kv_worker.errors import KVCacheShapeError

__all__ = ["FIRST_WAVE_CHUNKS", "STAGING_ALIGNMENT", "STAGING_BYTES", "StagedWaves", "Stager", "staging_waves"]

# Host chunks reach a device's caches through a device staging buffer, in waves whose
# copies run beside the next wave's kernels. (Kernels reading CUDA pinned memory in
# place measured slower than staging on H100 in every case of docs/design-decisions.md,
# and staging serves every device.)
# Device staging for host chunks: at most this many bytes (at least one chunk).
STAGING_BYTES = 256 * 2**20
STAGING_ALIGNMENT = 256
# Chunks in the first staging wave; each later wave doubles, up to half the staging buffer.
# The copies are the bottleneck and the kernels take microseconds per chunk, so the first
# wave is not the smallest: a store's first copies wait for its launches whatever its size,
# and then outlast the host's issue of the next wave; a load's first two waves are queued
# at once and keep the copy engine busy while the host resolves the slots and launches the
# first wave (H100: with 2 chunks first, the copy engine waited for the host 150-500 us).
FIRST_WAVE_CHUNKS = 4


def staging_waves(chunks: int, capacity: int, first: int = FIRST_WAVE_CHUNKS) -> list[tuple[int, int]]:
    """[begin, end) chunk ranges of the staging waves: `first` chunks, then doubling, at most `capacity` each."""
    if capacity < 1 or first < 1:
        raise KVCacheShapeError(f"capacity={capacity} and first={first} must be >= 1")
    waves = []
    begin, size = 0, min(first, capacity)
    while begin < chunks:
        end = min(begin + size, chunks)
        waves.append((begin, end))
        begin, size = end, min(2 * size, capacity)
    return waves


@dataclass
class StagedWaves:
    """One staged call's host chunks, staging buffer and waves: what each wave copies where."""

    chunks: list[torch.Tensor]
    starts: list[int]
    total: int  # bytes of a full chunk
    stride: int  # bytes between chunks in the staging buffer
    store: bool
    staging: torch.Tensor
    staged_chunks: BoundedCache[ChunkBuffers]  # the stager's chunks of its buffer, by offsets
    halves: int  # wave k uses half k % halves
    half_bytes: int
    waves: list[tuple[int, int]]
    # The addresses of the host chunks [0, checked) (checked by `chunk_buffers`) and their
    # `_joined_neighbours`, as Python lists: a wave's bookkeeping is a few dozen integers, cheaper in
    # Python than in numpy calls, which cost several microseconds each on a host the bus transfer left cold.
    addresses: list[int] = field(default_factory=list)
    joined: list[bool] = field(default_factory=list)
    checked: int = 0

    def check(self, through: int) -> None:
        """Check the host chunks [0, through) unless they are: placement, layout and size (a full chunk)."""
        if through <= self.checked:
            return
        host = chunk_buffers(self.chunks[:through] if through < len(self.chunks) else self.chunks, mapped=False)
        if host.min_bytes < self.total:
            index = int(np.argmin(host.sizes))
            raise KVCacheShapeError(f"chunk {index} holds {host.min_bytes} bytes; a full chunk needs {self.total}")
        self.checked, self.addresses = through, host.addresses.tolist()
        self.joined = _joined_neighbours(self.addresses, host.sizes.tolist(), self.total, self.stride, self.store)

    def plan(self, index: int) -> tuple[list[tuple[int, int, int]], ChunkBuffers, list[int]]:
        """Wave `index`'s copies (spans), its chunks in the staging buffer and their starts."""
        begin, end = self.waves[index]
        if end > self.checked:
            raise AssertionError(f"wave {index} ends at chunk {end}, past the {self.checked} checked")
        spans, offsets = _staging_spans(self.addresses, self.joined, begin, end, self.total,
                                        (index % self.halves) * self.half_bytes)
        buffers = self.staged_chunks.get_or_build(
            offsets, lambda: pool_chunk_buffers(self.staging, np.array(offsets, dtype=np.int64), self.total))
        return spans, buffers, self.starts[begin:end]

    def copy(self, spans, *, to_staging: bool) -> None:
        _copy_spans(self.chunks, self.addresses, spans, self.total, self.staging, to_staging=to_staging)


def _joined_neighbours(addresses: list[int], sizes: list[int], total: int, stride: int, store: bool) -> list[bool]:
    """joined[i]: chunk i + 1 starts where one copy of chunk i's span can reach it ([chunks - 1]).

    Chunk i + 1 must begin at most `stride` bytes after chunk i (so a span fits the staging
    waves' byte budget) and not inside chunk i's `total` bytes. A store writes the whole span
    back, so there the bytes between must be chunk i's own (its tensor reaches them); a load
    only reads them into scratch staging. (`_copy_spans` copies a span at once only where it
    lies in one host allocation.)
    """
    return [
        total <= after - before <= stride and (not store or after - before <= size)
        for before, after, size in zip(addresses, addresses[1:], sizes)
    ]


def _staging_spans(addresses: list[int], joined: list[bool], begin: int, end: int, total: int,
                   base: int) -> tuple[list[tuple[int, int, int]], tuple[int, ...]]:
    """The copies of chunks [begin, end): spans (first chunk, last chunk + 1, staging offset) of chunks
    joined back to back, packed from `base` in the staging buffer, and each chunk's staging offset
    (a chunk keeps its distance from its span's first chunk)."""
    spans: list[tuple[int, int, int]] = []
    offsets: list[int] = []
    cursor, first = base, begin
    for stop in range(begin + 1, end + 1):
        if stop < end and joined[stop - 1]:
            continue
        anchor = addresses[first]
        offsets.extend(cursor + address - anchor for address in addresses[first:stop])
        spans.append((first, stop, cursor))
        cursor = align_up(cursor + addresses[stop - 1] - anchor + total, STAGING_ALIGNMENT)
        first = stop
    return spans, tuple(offsets)


def _copy_spans(chunks: list[torch.Tensor], addresses: list[int], spans, total: int, staging: torch.Tensor, *,
                to_staging: bool) -> None:
    """One copy per span between the host chunks (at `addresses`) and the staging buffer (on the current stream).

    A span is copied at once only where it lies inside its first chunk's allocation (one
    host pool); else chunk by chunk, each to its place in the span's staging range.
    """
    for first, stop, offset in spans:
        chunk = chunks[first]
        size = addresses[stop - 1] - addresses[first] + total
        pieces = None
        if stop - first > 1:
            storage = chunk.untyped_storage()
            if addresses[stop - 1] + total <= storage.data_ptr() + storage.nbytes():
                pieces = ((chunk.as_strided((size,), (1,)), offset, size),)
        if pieces is None:
            pieces = tuple(
                (chunks[index] if chunks[index].numel() == total else chunks[index][:total],
                 offset + addresses[index] - addresses[first], total)
                for index in range(first, stop)
            )
        for span, at, length in pieces:
            staged = staging[at : at + length]
            if to_staging:
                staged.copy_(span, non_blocking=True)
            else:
                span.copy_(staged, non_blocking=True)


def _device_module(device: torch.device):
    """torch.cuda / torch.npu for a device with streams and events; None for the CPU."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "Stream") else None


# A staged call's wave launches: (the wave's chunks in the staging buffer, their starts, slots,
# store=) -> the launches made.
MoveBatch = Callable[..., int]


class Stager:
    """The device staging buffer of one set of caches and the copy stream that fills and empties it."""

    def __init__(self, device: torch.device, chunk_bytes: int, cache_bound: int):
        self.device = device
        self.chunk_bytes = chunk_bytes  # bytes of a full chunk
        self._buffer: torch.Tensor | None = None
        # Per (chunks, STAGING_BYTES) of a staged call: (buffer, chunk stride, halves, half bytes, waves);
        # emptied with the buffer.
        self._shapes: BoundedCache[tuple] = BoundedCache(cache_bound)
        # The buffer's chunks at a wave's offsets (`pool_chunk_buffers`), by offsets: requests of one
        # shape whose host chunks lie alike (one allocation) use the same few; emptied with the buffer.
        self._chunks: BoundedCache[ChunkBuffers] = BoundedCache(cache_bound)
        self._module = _device_module(device)
        self._copy_stream = None
        self._released = None  # an event after the last staged call's work on the buffer

    def buffer(self, chunks: int) -> tuple[torch.Tensor, int]:
        """(device staging buffer, bytes per chunk in it) for up to `chunks` full chunks (fewer where
        `STAGING_BYTES` is reached; one at least). Allocated once, grown on demand."""
        stride = align_up(self.chunk_bytes, STAGING_ALIGNMENT)
        wanted = stride * max(1, min(chunks, STAGING_BYTES // stride))
        if self._buffer is None or self._buffer.numel() < wanted:
            self._buffer = None  # the old buffer goes first: both may not fit
            self._chunks.clear()
            self._shapes.clear()
            self._buffer = torch.empty(wanted, dtype=torch.uint8, device=self.device)
        return self._buffer, stride

    def _shape(self, chunks: int) -> tuple:
        """(buffer, chunk stride, halves, half bytes, waves) of a staged call of `chunks` full chunks."""
        staging, stride = self.buffer(chunks)
        halves = 2 if self._module is not None and staging.numel() >= 2 * stride else 1
        half_bytes = (staging.numel() // halves) // STAGING_ALIGNMENT * STAGING_ALIGNMENT
        return staging, stride, halves, half_bytes, staging_waves(chunks, max(1, half_bytes // stride))

    def move(self, chunks: list[torch.Tensor], starts: list[int], resolve_slots: Callable[[], object],
             move_batch: MoveBatch, *, store: bool) -> int:
        """Host chunks through the staging buffer in waves (`staging_waves`: a small first wave, then
        doubling), alternating between the buffer's halves, copies on a copy stream. A store's copies of
        wave k follow its kernels, which run beside wave k - 1's copies; a load's copies run one wave
        ahead: wave k + 1's copies are queued before wave k's launches (and the first waves' before the
        slots are resolved), so the copy engine does not wait for the host. Chunks lying back to back
        in one host allocation are copied as one span (on a store only where every byte of the span is
        the chunks' own).

        The first wave's host chunks are checked on their own and its work issued before the other
        chunks are checked (`StagedWaves.check`): the copy engine starts that much earlier. A later
        chunk that fails its check raises with the first wave's copies queued; only checked chunks
        are ever written, and a failed store is not kept by LMCache.
        """
        module = self._module
        staging, stride, halves, half_bytes, waves = self._shapes.get_or_build(
            (len(chunks), STAGING_BYTES), lambda: self._shape(len(chunks)))
        staged = StagedWaves(chunks, starts, self.chunk_bytes, stride, store, staging, self._chunks, halves,
                             half_bytes, waves)
        if module is None:
            return _move_in_order(staged, resolve_slots, move_batch)
        staged.check(staged.waves[0][1])
        if self._copy_stream is None:
            self._copy_stream = module.Stream(device=self.device)
        compute = module.current_stream(self.device)
        copy = self._copy_stream
        if self._released is not None:
            copy.wait_event(self._released)  # the last staged call's kernels are done with the buffer
        try:
            if store:
                return _staged_store(staged, resolve_slots(), move_batch, module, compute, copy)
            return _staged_load(staged, resolve_slots, move_batch, module, compute, copy)
        finally:  # (also after a failed check: what was queued is ordered before the buffer's next use)
            compute.wait_stream(copy)
            self._released = module.Event()
            self._released.record(compute)


def _move_in_order(staged: StagedWaves, resolve_slots: Callable[[], object], move_batch: MoveBatch) -> int:
    """No streams: every wave's copies and launches in order on the host."""
    staged.check(len(staged.chunks))
    slots = resolve_slots()
    launches = 0
    for index in range(len(staged.waves)):
        spans, buffers, wave_starts = staged.plan(index)
        if not staged.store:
            staged.copy(spans, to_staging=True)
        launches += move_batch(buffers, wave_starts, slots, store=staged.store)
        if staged.store:
            staged.copy(spans, to_staging=False)
    return launches


def _staged_store(staged: StagedWaves, slots: object, move_batch: MoveBatch, module, compute, copy) -> int:
    """Each wave's launches, then its copies out once its kernels are done; a half is rewritten
    only after its last copies out."""
    released: list = [None] * staged.halves  # per half: the event after which it may be rewritten
    launches = 0
    for index in range(len(staged.waves)):
        spans, buffers, wave_starts = staged.plan(index)
        part = index % staged.halves
        if released[part] is not None:
            compute.wait_event(released[part])
        launches += move_batch(buffers, wave_starts, slots, store=True)
        written = module.Event()
        written.record(compute)
        copy.wait_event(written)
        with module.stream(copy):
            staged.copy(spans, to_staging=False)
        released[part] = module.Event()
        released[part].record(copy)
        staged.check(len(staged.chunks))  # (after the first wave's copies: a no-op from then on)
    return launches


def _staged_load(staged: StagedWaves, resolve_slots: Callable[[], object], move_batch: MoveBatch, module, compute,
                 copy) -> int:
    """One wave per half copied in before the slots are resolved; then each wave's launches once its
    copies are in, followed by the copies of the wave that reuses its half once its kernels are done."""
    plans: dict[int, tuple] = {}
    loaded: dict[int, object] = {}
    released: list = [None] * staged.halves  # per half: the event after which it may be rewritten

    def queue_copies(index: int) -> None:
        plans[index] = plan = staged.plan(index)
        part = index % staged.halves
        if released[part] is not None:
            copy.wait_event(released[part])
        with module.stream(copy):
            staged.copy(plan[0], to_staging=True)
        loaded[index] = module.Event()
        loaded[index].record(copy)

    for index in range(min(staged.halves, len(staged.waves))):
        queue_copies(index)
        staged.check(len(staged.chunks))  # (after the first wave's copies: a no-op from then on)
    slots = resolve_slots()
    launches = 0
    for index in range(len(staged.waves)):
        _, buffers, wave_starts = plans.pop(index)
        compute.wait_event(loaded.pop(index))
        launches += move_batch(buffers, wave_starts, slots, store=False)
        released[index % staged.halves] = module.Event()
        released[index % staged.halves].record(compute)
        if index + staged.halves < len(staged.waves):
            queue_copies(index + staged.halves)
    return launches
