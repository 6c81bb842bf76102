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
    out = []
    for row, slot in enumerate(slots):
        tokens = range(row * compress_ratio, (row + 1) * compress_ratio)
        chunk_end = min((tokens[0] // chunk_size + 1) * chunk_size, num_tokens)
        in_window = any(chunk_end - sliding_window <= token for token in tokens)
        out.append(slot if in_window else -1)
    return out


def reference_load_slots(
    block_size: int, compress_ratio: int, block_ids: list[int], num_tokens: int, vllm_cached_tokens: int
) -> list[int]:
    slots = reference_raw_slots(block_size, compress_ratio, block_ids, num_tokens)
    return [
        -1 if (row + 1) * compress_ratio <= vllm_cached_tokens else slot for row, slot in enumerate(slots)
    ]
