"""LMCache's MP server shares and moves a CPU worker's KV caches that are strided views of vLLM's pages.

vLLM's CPU worker gives each layer of a model with several KV-cache groups (DeepSeek-V4's
compressed, indexer and window caches) a strided view of pages it shares with other
layers: blocks first, each block's rows tight, one page (several layers' blocks) between
blocks.  LMCache's MP transfer on a CPU worker fails on them twice:

* registration (``lmcache.v1.platform.devices.cpu.shm.migrate_to_shm_and_wrap``) refuses a
  view that is not contiguous, and the engine stops at start.  Even past that check, its
  way of sharing (copy the storage into a new segment, re-point the tensors handed over)
  cannot serve these models: LMCache's connector registers reshaped views of its own, so
  the model's own views stay on the old memory, where the server never reads or writes.
  The wrapper shares the pages where they lie instead
  (`lmcache_ascend.kv_worker.shared_pages`), so every view, the model's included, and the
  server address one memory, and describes each cache with upstream's descriptor as a
  view of that segment (LMCache's wire decoder checks that it lies inside).
* the server's torch transfer (``lmcache.v1.platform.torch_ops.mp_mem_kernels``) rebuilds
  each layer from its pointer with tight blocks and refuses a pool whose block stride is
  larger (every store fails, nothing is reused).  The wrapper rebuilds a blocks-first
  layer with the pool's block stride and tight rows, as LMCache's CUDA and MUSA kernels
  address it; every other input goes to upstream untouched.
"""

from __future__ import annotations

import math

from lmcache_ascend.compat.signatures import call_arguments
from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

_SHM_REFUSAL = "migrate_to_shm_and_wrap requires a contiguous tensor"
_STRIDE_REFUSAL = "Non-tight per-block strides"


def migrate_to_shm_and_wrap(wrapped, instance, args, kwargs):
    """Share the pages under a KV cache where they lie, and describe the cache as a view of that segment."""
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

    from lmcache_ascend.kv_worker.shared_pages import share_in_place

    tensor = call_arguments(wrapped, args, kwargs).arguments["tensor"]
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return wrapped(*args, **kwargs)
    pages = share_in_place(tensor, CpuShmTensorWrapper.SHM_NAME_PREFIX)
    if pages.storage_offset_bytes % tensor.element_size():
        raise ValueError(f"KV cache of {tensor.dtype} starts {pages.storage_offset_bytes} bytes into its shared "
                         f"pages, not a whole number of elements; LMCache's server cannot view it")
    described = object.__new__(CpuShmTensorWrapper)  # upstream's own descriptor, as its from_wire builds one
    described.shm_name, described.nbytes, described.handle, described.device_uuid = pages.name, pages.nbytes, None, "cpu"
    described.dtype, described.shape, described.stride = tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())
    described.storage_offset = pages.storage_offset_bytes // tensor.element_size() + tensor.storage_offset()
    return described


SHM_IN_PLACE = Patch(
    name="lmcache-cpu-shm-in-place",
    target="lmcache.v1.platform.devices.cpu.shm",
    attributes=("migrate_to_shm_and_wrap",),
    kind=PatchKind.WRAP,
    wrappers={"migrate_to_shm_and_wrap": migrate_to_shm_and_wrap},
    requires={"lmcache": ">=0.5.6,<0.6"},
    guard=UpstreamGuard(unfixed_if_source_contains=(_SHM_REFUSAL,)),
    summary="LMCache's MP transfer on a CPU worker shares KV caches in place (every view of the pages, the model's "
    "included), strided views of pages shared by several layers too",
    why=f"'{_SHM_REFUSAL}' stopped DeepSeek-V4's engine at start; and upstream's copy into a new segment re-points "
    "only the tensors its connector registers (reshaped views), so the model would keep its KV where the server "
    "never reads",
    mirrors="LMCache 0.5.6's CUDA IPC sharing, where the server addresses the engine's own memory",
    delete_when="LMCache shares a CPU worker's KV caches without moving them (every view stays on the shared memory)",
    tested_fingerprints={"migrate_to_shm_and_wrap": ("70522fd9381e",)},  # LMCache 0.5.6
)


def normalize_paged_layers(wrapped, instance, args, kwargs):
    """Rebuild blocks-first layers of a pool with a block stride larger than a block; the rest to upstream."""
    import torch

    bound = call_arguments(wrapped, args, kwargs).arguments
    pointers, spec, desc = bound["paged_buffer_ptrs_tensor"], bound["format_spec"], bound.get("shape_desc")
    if desc is None or not isinstance(pointers, torch.Tensor) or pointers.dtype not in (torch.int64, torch.uint64):
        return wrapped(*args, **kwargs)
    if not spec.is_layer_list or spec.is_kv_second_tuple or spec.is_pbs_fused or spec.is_two_major:
        return wrapped(*args, **kwargs)
    blocks, block_size, heads, head_size = (int(desc.nb), int(desc.bs), int(desc.nh), int(desc.hs))
    block_stride = int(getattr(desc, "block_stride_elems", 0) or 0)
    shape = spec.paged_layer_shape(blocks, block_size, heads, head_size)
    block_elements = math.prod(shape[1:])
    if not block_stride or block_stride == block_size * heads * head_size or shape[0] != blocks:
        return wrapped(*args, **kwargs)
    from lmcache.v1.platform.torch_ops._tensor_from_ptr import _tensor_from_ptr

    inner_strides = [math.prod(shape[index + 1:]) for index in range(1, len(shape))]
    span = (blocks - 1) * block_stride + block_elements
    return [torch.as_strided(_tensor_from_ptr(int(pointer), (span,), bound["dtype"], bound["device"]), shape,
                             (block_stride, *inner_strides))
            for pointer in pointers.tolist()]


BLOCK_STRIDE = Patch(
    name="lmcache-cpu-paged-block-stride",
    target="lmcache.v1.platform.torch_ops.mp_mem_kernels",
    attributes=("_normalize_paged_layers",),
    kind=PatchKind.WRAP,
    wrappers={"_normalize_paged_layers": normalize_paged_layers},
    requires={"lmcache": ">=0.5.6,<0.6"},
    guard=UpstreamGuard(unfixed_if_source_contains=(_STRIDE_REFUSAL,)),
    summary="LMCache's MP server on a CPU moves paged layers whose blocks lie a page apart (pools shared by layers)",
    why=f"'{_STRIDE_REFUSAL} ... are not supported': every store of DeepSeek-V4's caches through LMCache's MP "
    "server on a CPU failed, and nothing was reused",
    mirrors="LMCache 0.5.6's MUSA device ops (_paged_shape_and_stride: the block stride of shape_desc, tight rows)",
    delete_when="LMCache's torch transfer rebuilds layers with shape_desc.block_stride_elems",
    tested_fingerprints={"_normalize_paged_layers": ("be02b8d9a87b",)},  # LMCache 0.5.6
)

PATCHES = (SHM_IN_PLACE, BLOCK_STRIDE)
