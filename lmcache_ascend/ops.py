"""The kernel surface LMCache's own platform layer loads on an Ascend host.

LMCache 0.5.x resolves `NpuDeviceOps` there, whose `ensure_native()` imports this
module and binds every public callable and type of it over LMCache's torch
baseline (`DeviceOps.bind_native`). So this module exposes exactly the ops that
run on the project's transfer kernel (Triton: CUDA, Ascend via triton-ascend;
the torch reference elsewhere or with LMCACHE_ASCEND_TRANSFER_BACKEND=torch),
with LMCache's signatures and semantics, and the one type they take. Nothing
else is public here: never a re-export of LMCache's fallbacks, which would
replace LMCache's own defaults with themselves at best. Importing it is cheap
(torch and the project's kernel descriptions; Triton is imported on first use)
and needs no NPU; it imports nothing from LMCache, which imports it.

Each op (LMCache 0.4.x's `c_ops`, 0.5.x's `DeviceOps`) takes LMCache's own arguments, checks them on the host (a TransferError
naming the argument, its value and what is allowed), and describes the move as
one `PagedGroup` (the paged planes of every layer) plus one strided chunk layout
(where each (layer, plane) row lies in LMCache's buffer), which `transfer_group`
runs in one launch (Triton on CUDA/NPU, the torch reference elsewhere, or as
LMCACHE_ASCEND_TRANSFER_BACKEND says). Semantics are those of LMCache 0.5.6's
torch baseline (`lmcache/v1/platform/torch_ops/mem_kernels.py`,
`mp_mem_kernels.py`), byte for byte, with these deliberate differences:

* slots < 0 are skipped by every op; the baseline's `load_and_reshape_flash`
  and `reshape_and_cache_back_flash` wrap them (Python indexing: slot -1 reads
  or overwrites the cache's last row);
* a slot or block id past the cache raises (checked on the host when the slot
  tensor is on the CPU, as the baseline's indexing raises); on a device the
  kernel skips it instead of syncing to check;
* MLA plane tuples move whatever the object row's length and plane order; the
  baseline fails on a one-token slice when the row length or a plane's offset in
  it is no multiple of that plane's element size;
* a `block_size` (`shape_desc.bs`) that the paged tensors' blocks do not have
  raises wherever the slot arithmetic uses it, and `key_value` must hold every
  layer of the paged list; the baseline raises on most of these (an index out of
  bounds) but moves rows at shifted offsets, or only the first layers, on others;
* bytes are moved, never values: the chunk and the caches must have one dtype
  (the baseline's `copy_` would convert); non-tight block strides
  (`block_stride_elems`) are honoured where the baseline refuses them.

Where each part lives (`lmcache_ascend.op_surface`): the arguments' checks and the caches'
description kept between calls (`arguments`), one move and a call's repeat (`moves`), the
steps every op takes (`runner`), the per-token ops (`per_token`), the block op (`per_block`),
the formats by LMCache's code (`formats`, from `lmcache_ascend.layouts`).
"""

from lmcache_ascend.op_surface.arguments import PageBufferShapeDesc
from lmcache_ascend.op_surface.per_block import multi_layer_block_kv_transfer
from lmcache_ascend.op_surface.per_token import (
    load_and_reshape_flash,
    multi_layer_kv_transfer,
    multi_layer_kv_transfer_unilateral,
    reshape_and_cache_back_flash,
    single_layer_kv_transfer,
)

__all__ = [
    "PageBufferShapeDesc",
    "load_and_reshape_flash",
    "multi_layer_block_kv_transfer",
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "reshape_and_cache_back_flash",
    "single_layer_kv_transfer",
]
