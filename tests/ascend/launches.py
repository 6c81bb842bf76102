"""The kernel launches the package makes, recorded from its own launch code on CPU tensors.

`triton_transfer._launch` (`kernels.launcher.launch`) is the one seam every launch goes through; it is replaced by a
recorder while the public launch functions run for representative layouts, so the kernels
are compiled with exactly the arguments and constexprs the package would launch them with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Launch:
    name: str
    kernel: object
    arguments: tuple
    constexprs: tuple
    num_warps: int
    grid: tuple
    data_params: tuple = ("data_anchor",)  # the pointer parameters the kernel moves data through


def record_launches() -> list[Launch]:
    from lmcache_ascend.kernels import (
        PagedGroup,
        PagedPlane,
        PlaneSlots,
        chunk_rows,
        pool_chunk_buffers,
        resolve_chunk_batch,
        resolve_transfer,
    )
    from lmcache_ascend.kernels import block_slots
    from lmcache_ascend.kernels import triton_transfer as tt

    recorded: list[tuple] = []

    def recorder(kernel, grid, arguments, pointers, signature, constexprs, num_warps, device):
        recorded.append((kernel, grid, arguments, constexprs, num_warps))

    launches: list[Launch] = []

    def take(name: str) -> None:
        assert len(recorded) == 1, f"{name}: {len(recorded)} launches recorded, 1 expected"
        kernel, grid, arguments, constexprs, num_warps = recorded.pop()
        launches.append(Launch(name, kernel, arguments, constexprs, num_warps, grid))

    saved, saved_expansion = tt._launch, block_slots._launch
    tt._launch = block_slots._launch = recorder
    try:
        # One plane, two layers, bf16 rows of 256 bytes (LMCache's per-layer ops).
        one = PagedGroup((PagedPlane(tuple(torch.zeros((8, 16, 128), dtype=torch.bfloat16) for _ in range(2)), 16,
                                     256, name="layers"),))
        slots = torch.arange(40, dtype=torch.int64)
        for store in (True, False):
            chunk = torch.zeros(one.chunk_regions([40]).total_bytes, dtype=torch.uint8)
            tt.triton_transfer(resolve_transfer(one, (PlaneSlots(slots, 0, 40),), chunk, store=store))
            take(f"one plane {'store' if store else 'load'}")
            # LMCache's block op: block ids of 4 rows, which the kernel expands.
            tt.triton_transfer(resolve_transfer(one, (PlaneSlots(torch.arange(10), 0, 40, rows_per_id=4),), chunk,
                                                store=store))
            take(f"one plane, block ids {'store' if store else 'load'}")

        # A DeepSeek-V4-like bundle: int8 indexer rows of 132 bytes and fp16 scales, dtype views of
        # one int8 blob, beside bf16 latent rows of 192 bytes.
        blob = torch.zeros((3, 5, 4 * 132 + 4 * 2 + 8), dtype=torch.int8)
        layers = [(blob[i, :, : 4 * 132].view(5, 4, 132),
                   blob[i, :, 4 * 132 : 4 * 132 + 8].view(torch.float16).view(5, 4, 1),
                   torch.zeros((7, 2, 96), dtype=torch.bfloat16)) for i in range(3)]
        bundle = PagedGroup((PagedPlane(tuple(layer[0] for layer in layers), 4, 132, name="indexer"),
                             PagedPlane(tuple(layer[1] for layer in layers), 4, 2, name="scale"),
                             PagedPlane(tuple(layer[2] for layer in layers), 2, 192, name="latent")))
        bundle_slots = tuple(PlaneSlots(torch.arange(count, dtype=torch.int64)) for count in (6, 6, 3))
        for store in (True, False):
            chunk = torch.zeros(bundle.chunk_regions([s.region_rows for s in bundle_slots]).total_bytes,
                                dtype=torch.uint8)
            tt.triton_transfer(resolve_transfer(bundle, bundle_slots, chunk, store=store))
            take(f"DSv4-like bundle {'store' if store else 'load'}")

        # Many chunks in one launch: chunks of one staging pool, and separate chunk tensors.
        group = PagedGroup((PagedPlane(tuple(torch.zeros((9, 2, 16), dtype=torch.float16) for _ in range(3)), 2, 32,
                                       name="a"),
                            PagedPlane(tuple(torch.zeros((7, 4, 12), dtype=torch.int8) for _ in range(3)), 4, 12,
                                       name="b")))
        group_slots = torch.arange(48, dtype=torch.int64)
        starts = np.array([[4 * c, 20 + 3 * c] for c in range(5)], dtype=np.int64)
        counts = np.array([[4, 3], [4, 0], [2, 3], [4, 3], [0, 1]], dtype=np.int64)
        regions = group.chunk_regions([4, 3])
        rows = chunk_rows(group, regions, starts, counts)
        for store in (True, False):
            stride = regions.total_bytes + 64
            pool = torch.zeros(5 * stride + 64, dtype=torch.uint8)
            offsets = np.arange(5, dtype=np.int64) * stride + 64
            tt.triton_transfer_chunk_batches([resolve_chunk_batch(
                group_slots, pool_chunk_buffers(pool, offsets, regions.total_bytes), rows, store=store)])
            take(f"pool chunks {'store' if store else 'load'}")
        for store in (True, False):
            separate = [torch.zeros(regions.total_bytes, dtype=torch.uint8) for _ in range(5)]
            tt.triton_transfer_chunk_batches([resolve_chunk_batch(group_slots, separate, rows, store=store)],
                                             shape=tt.DEFAULT_LAUNCH_SHAPE)
            take(f"separate chunks {'store' if store else 'load'}")
            tt.triton_transfer_chunk_batches([resolve_chunk_batch(torch.arange(12), separate, rows, store=store,
                                                                  rows_per_id=4)], shape=tt.DEFAULT_LAUNCH_SHAPE)
            take(f"separate chunks, block ids {'store' if store else 'load'}")
        # A hand-over's block ids expanded to slots: a compressed group (4 rows a block) and a
        # full one (16), the second with a cached prefix.
        plan = [(0, 30, 0, 4, 0), (30, 64, 8, 16, 20)]
        block_slots.expand_on_device(plan, [np.arange(1, 13, dtype=np.int64)], 94, torch.device("cpu"), null_id=0,
                                     fill=False)
        take("block ids to slots")
        kernel, arguments, constexprs, num_warps, grid = (launches[-1].kernel, launches[-1].arguments,
                                                          launches[-1].constexprs, launches[-1].num_warps,
                                                          launches[-1].grid)
        launches[-1] = Launch("block ids to slots", kernel, arguments, constexprs, num_warps, grid, ("ids", "out"))
    finally:
        tt._launch, block_slots._launch = saved, saved_expansion
    return launches
