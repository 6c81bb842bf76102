"""Host chunks through a device staging buffer, in waves whose copies run beside the next wave's kernels.

`staging_waves` sizes the waves; `StagedWaves` holds one staged call's chunks and
says what each wave copies where (neighbouring host chunks joined into one copy where
the staging buffer allows). `ChunkMover` (transfer.py) drives the streams and events.

Pure logic: torch, numpy and lmcache_ascend only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lmcache_ascend.bounded_cache import BoundedCache
from lmcache_ascend.kernels import ChunkBuffers, align_up, chunk_buffers, pool_chunk_buffers
from lmcache_ascend.kv_worker.formats import KVCacheShapeError

__all__ = ["FIRST_WAVE_CHUNKS", "STAGING_ALIGNMENT", "STAGING_BYTES", "StagedWaves", "staging_waves"]

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
    staged_chunks: BoundedCache[ChunkBuffers]  # the mover's `_staged_chunks`
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
