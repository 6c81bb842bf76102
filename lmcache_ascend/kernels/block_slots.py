"""Block ids -> slots on the device, in one launch for every group of every request of a hand-over.

A request's slots are its block ids expanded: row r of a group of n rows per block has slot
``ids[r // n] * n + r % n``, -1 where the id is the null block or the row lies in the cached
prefix (`cached` rows). On the host that is a few numpy operations per group over every row,
then a copy of every row's slot; here the host uploads only the ids and one plan entry per
group (a few hundred integers for a 16K-token request instead of its tens of thousands of
slots), and one launch writes the slots where the transfer kernels read them.

Plan entry, int64: first output row, rows, first id (in the uploaded ids), rows per block,
cached rows. The plan and the ids travel in one upload. One source for CUDA and Ascend
(triton-ascend): loads, stores and integer arithmetic only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from lmcache_ascend.kernels.launcher import launch as _launch
from lmcache_ascend.kernels.upload import to_device

__all__ = ["PLAN_FIELDS", "expand_on_device"]

PLAN_FIELDS = 5
ROWS_PER_PROGRAM = 1024  # rows of one tile (fewer where the largest block rounds up less evenly)


@triton.jit
def _expand_kernel(plan, ids, out, NULL_ID: tl.constexpr, BLOCKS: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr):
    # A program takes BLOCKS blocks of one plan entry: their ids in one contiguous load, then a
    # [BLOCKS, ROWS_PER_BLOCK] tile of slots stored row by row (a block's rows are contiguous in
    # the output, blocks `per_block` apart: on Ascend strided DMA, not element-wise moves).
    # ROWS_PER_BLOCK is the plan's largest rows per block rounded up to a power of two.
    entry = plan + tl.program_id(1).to(tl.int64) * 5
    first_row = tl.load(entry)
    rows = tl.load(entry + 1)
    first_id = tl.load(entry + 2)
    per_block = tl.load(entry + 3)
    cached = tl.load(entry + 4)
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_plan = block < (rows + per_block - 1) // per_block
    block_ids = tl.load(ids + first_id + block, mask=in_plan, other=NULL_ID)
    in_block = tl.arange(0, ROWS_PER_BLOCK)
    row = block[:, None] * per_block + in_block[None, :]
    inside = in_plan[:, None] & (in_block < per_block)[None, :] & (row < rows)
    slots = tl.where((block_ids[:, None] == NULL_ID) | (row < cached), -1,
                     block_ids[:, None] * per_block + in_block[None, :])
    tl.store(out + first_row + row, slots, mask=inside)


def expand_on_device(plan: Sequence[tuple[int, int, int, int, int]], ids: Sequence[np.ndarray], total_rows: int,
                     device: torch.device, *, null_id: int, fill: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The slots of every plan entry (PLAN_FIELDS integers each) from `ids` (int64 arrays, taken as one
    run of ids in order) in one int64 tensor of `total_rows` on `device` (`out` where given); `fill`:
    rows no entry covers are -1 (else left unwritten, for a caller whose entries cover every row).
    The plan is a few entries: its maxima are taken in Python (a numpy call costs more per entry)."""
    entries = len(plan)
    upload = np.concatenate((np.array(plan, dtype=np.int64).reshape(-1), *ids)) if entries else np.empty(0, np.int64)
    on_device = to_device(upload, device)
    size = max(total_rows, 1)  # one entry at least: an empty tensor may have no address to anchor on
    if out is None:
        out = torch.empty(size, dtype=torch.int64, device=device)
    if fill:
        out.fill_(-1)
    most_blocks = max((-(-rows // per_block) for _, rows, _, per_block, _ in plan), default=0)
    if most_blocks == 0:
        return out
    rows_per_block = 1 << (max(entry[3] for entry in plan) - 1).bit_length()
    blocks = max(ROWS_PER_PROGRAM // rows_per_block, 4)  # triton-ascend lowers no 1-row tile
    grid = (-(-most_blocks // blocks), entries, 1)
    # the ids follow the plan in the same upload: two views of it
    plan_view, ids_view = on_device[: entries * PLAN_FIELDS], on_device[entries * PLAN_FIELDS:]
    plan_address, ids_address, out_address = plan_view.data_ptr(), ids_view.data_ptr(), out.data_ptr()
    signature = ("block slots", plan_address % 16 == 0, ids_address % 16 == 0, out_address % 16 == 0)
    _launch(_expand_kernel, grid, (plan_view, ids_view, out), {0: plan_address, 1: ids_address, 2: out_address},
            signature, (("NULL_ID", null_id), ("BLOCKS", blocks), ("ROWS_PER_BLOCK", rows_per_block)), 4, device)
    return out
