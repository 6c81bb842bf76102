"""Direct, row-at-a-time reference of the slot-mapping rules (for comparisons)."""

from __future__ import annotations


def reference_slot(block_size: int, compress_ratio: int, block_ids: list[int], row: int) -> int:
    rows_per_block = block_size // compress_ratio
    block_id = block_ids[row // rows_per_block]
    if block_id == 0:
        return -1
    return block_id * rows_per_block + row % rows_per_block


def reference_raw_slots(block_size: int, compress_ratio: int, block_ids: list[int], num_tokens: int) -> list[int]:
    num_rows = (num_tokens + compress_ratio - 1) // compress_ratio
    return [reference_slot(block_size, compress_ratio, block_ids, row) for row in range(num_rows)]


def reference_store_slots(
    block_size: int, compress_ratio: int, sliding_window: int | None, block_ids: list[int], num_tokens: int, chunk_size: int
) -> list[int]:
    slots = reference_raw_slots(block_size, compress_ratio, block_ids, num_tokens)
    if sliding_window is None:
        return slots
    # A row is stored when a row of the chunk's last window sits in the same paged block.
    chunk_rows = chunk_size // compress_ratio
    rows_per_block = block_size // compress_ratio
    window_rows = -(-sliding_window // compress_ratio)
    out = []
    for row, slot in enumerate(slots):
        chunk_first = row - row % chunk_rows
        chunk_end = min(chunk_first + chunk_rows, len(slots))
        window = range(max(chunk_first, chunk_end - window_rows), chunk_end)
        shares_a_block = any(other // rows_per_block == row // rows_per_block for other in window)
        out.append(slot if shares_a_block else -1)
    return out


def reference_load_slots(
    block_size: int, compress_ratio: int, block_ids: list[int], num_tokens: int, vllm_cached_tokens: int
) -> list[int]:
    slots = reference_raw_slots(block_size, compress_ratio, block_ids, num_tokens)
    return [
        -1 if (row + 1) * compress_ratio <= vllm_cached_tokens else slot for row, slot in enumerate(slots)
    ]
