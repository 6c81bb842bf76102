"""Transfer kernels between vLLM's paged KV caches and LMCache's flat chunk buffers.

Contract (both backends implement exactly this; bytes are moved, never values):

* A `PagedGroup` is one layer group: `planes`, each a `PagedPlane` holding one
  paged tensor per layer (all planes have the same layer count L). A plane's
  tensor is `num_blocks` (dim 0) blocks of `block_size` rows of `row_bytes`
  bytes, rows contiguous inside a block, blocks `stride(0)` apart. Slot s is
  row `s % block_size` of block `s // block_size`. Any dtype (int8, uint8,
  fp8 e4m3/e5m2, fp16, bf16, fp32, ...); views into one shared blob are
  addressed through their own `data_ptr()`.
* Per chunk, each plane p gets a `PlaneSlots`: a dense int64 slot array, `start`
  and `count`: chunk row t (0 <= t < count) <-> paged slot `slots[start + t]`.
  With `rows_per_id` n > 1 the array holds block ids instead, each standing for
  n consecutive slots: row r of the array's rows has slot `ids[r // n] * n + r % n`
  (an id < 0 stands for n skipped rows); the kernel expands them itself.
* Chunk layout (`ChunkRegions`, bytes from `chunk_offset` into the chunk): per
  layer the planes one after another, plane p's region
  `align_up(row_bytes_p * region_rows_p, alignment)` bytes (alignment 32 by
  default; `region_rows` defaults to `count`); the layer stride is the sum of a
  layer's regions; layer l starts at `l * layer_stride`. A `strided_chunk_regions`
  instead gives each plane its own offset and row pitch (LMCache's K/V-major
  `[2, L, T, H]` buffers, token-major `[T, 2, H]` rows, planes of one token row).
* `store=True` copies paged -> chunk, `store=False` chunk -> paged.
* A slot < 0 (-1) or >= num_blocks * block_size is skipped in both
  directions: on store its chunk row keeps what it held (callers must not
  persist it), on load no paged byte is written. No other byte of the chunk
  or of any cache is written. If two valid slots of one plane are equal, a
  load writes one of the rows (which one is unspecified).
* Inputs are validated on the host before anything runs (`TransferError`,
  naming the input, its value and what is allowed): plane count 1..16, block
  sizes and row bytes > 0, row bytes vs dtype and shape, int64 contiguous slots
  with start + count inside them, one device for every tensor, the chunk large
  enough. Out-of-range slots are masked in the kernel; nothing reads or writes
  outside the given tensors.
* Backends: the torch reference (`reference.py`, any device) and one Triton
  kernel (`triton_transfer.py`, CUDA and Ascend via triton-ascend) that moves
  all planes of all layers of a group in ONE launch (many chunks: of every
  group of the call in one launch), each (layer, plane) with
  the widest of 16/4/2/1-byte elements dividing its row bytes, block stride and
  addresses. `select_backend`: Triton on CUDA/NPU, the reference on CPU;
  LMCACHE_ASCEND_TRANSFER_BACKEND=torch forces the reference.
"""

from lmcache_ascend.kernels.dispatch import (
    BACKENDS,
    LaunchCounter,
    launch_counter,
    select_backend,
    transfer_chunk_batches,
    transfer_group,
)
from lmcache_ascend.kernels.reference import reference_transfer
from lmcache_ascend.kernels.paged import (
    PagedGeometry,
    PagedGroup,
    PagedPlane,
)
from lmcache_ascend.kernels.resolve import (
    ChunkBuffers,
    ChunkRows,
    PlaneSlots,
    ResolvedChunkBatch,
    ResolvedTransfer,
    chunk_buffers,
    chunk_rows,
    pool_chunk_buffers,
    resolve_chunk_batch,
    resolve_chunk_batches,
    resolve_transfer,
)
from lmcache_ascend.kernels.spec import (
    DEFAULT_REGION_ALIGNMENT,
    ELEMENT_WIDTHS,
    MAX_PLANES,
    ChunkRegions,
    TransferError,
    align_up,
    chunk_regions,
    strided_chunk_regions,
    triton_interpreting,
    widest_element_width,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_REGION_ALIGNMENT",
    "ELEMENT_WIDTHS",
    "MAX_PLANES",
    "ChunkBuffers",
    "ChunkRegions",
    "ChunkRows",
    "LaunchCounter",
    "PagedGeometry",
    "PagedGroup",
    "PagedPlane",
    "PlaneSlots",
    "ResolvedChunkBatch",
    "ResolvedTransfer",
    "TransferError",
    "align_up",
    "chunk_buffers",
    "chunk_regions",
    "chunk_rows",
    "launch_counter",
    "pool_chunk_buffers",
    "reference_transfer",
    "resolve_chunk_batch",
    "resolve_chunk_batches",
    "resolve_transfer",
    "select_backend",
    "strided_chunk_regions",
    "triton_interpreting",
    "transfer_chunk_batches",
    "transfer_group",
    "widest_element_width",
]
