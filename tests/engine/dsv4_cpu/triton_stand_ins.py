"""Torch stand-ins for the Triton kernels that vLLM's CPU DeepSeek-V4 runs while building attention metadata.

vLLM's CPU build wants triton-cpu on x86 for these; no package registry has it,
and without it vLLM leaves each kernel a placeholder that cannot launch. The
kernels only compute index metadata (which request a token belongs to, which
paged slots its sliding window reads, how many tokens a prefill gathers); the
attention, compressor and indexer themselves run in vLLM's own CPU kernels.
Each stand-in computes what its kernel's source says, for every element the
kernel writes, in plain torch, and replaces the module-level name vLLM
calls (`PATCHED_MODULES`, applied by tests/engine/dsv4_cpu/sitecustomize.py as each module loads);
test code only.
"""

from __future__ import annotations

import torch

__all__ = ["PATCHED_MODULES"]


def compute_token_to_req_indices(query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int,
                                  num_tokens: int) -> torch.Tensor:
    """vllm.v1.attention.ops.metadata: token t -> the request whose query holds it (0 past num_mapped_tokens)."""
    num_reqs = query_start_loc.shape[0] - 1
    token = torch.arange(num_tokens, dtype=torch.int64)
    ends = query_start_loc[1:].to(torch.int64)
    # The kernel's binary search: the first request whose query ends after the token.
    request = torch.searchsorted(ends, token, right=True).clamp_(max=max(num_reqs - 1, 0))
    request = torch.where(token < num_mapped_tokens, request, torch.zeros_like(request))
    out[:num_tokens] = request.to(out.dtype)
    return out[:num_tokens]


def compute_swa_indices_and_lens(swa_indices, swa_lens, window_size, index_width, left_visible, right_visible,
                                 query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
                                 block_size, replay_start, *, num_tokens, token_offset, has_image=False):
    """sparse_swa._compute_swa_indices_and_lens_kernel: per token, its window's paged slots (-1 past its length)."""
    if num_tokens == 0:
        return
    token = torch.arange(num_tokens, dtype=torch.int64) + token_offset
    valid = is_valid_token[token].to(torch.bool)
    request = token_to_req_indices[token].to(torch.int64)
    query_start = query_start_loc[request].to(torch.int64)
    query_len = query_start_loc[request + 1].to(torch.int64) - query_start
    prefix_len = seq_lens[request].to(torch.int64) - query_len
    pos = prefix_len + token - query_start
    if has_image:
        left = left_visible[token].to(torch.int64)
        right = right_visible[token].to(torch.int64)
    else:
        left = torch.zeros_like(pos)
        right = torch.zeros_like(pos)
    left_add = (left - (window_size - 1)).clamp(min=0)
    start = (pos - (window_size - 1) - left_add).clamp(min=0)
    start = torch.maximum(start, replay_start[request].to(torch.int64))
    end = pos + right + 1
    length = end - start
    offset = torch.arange(index_width, dtype=torch.int64)
    position = start[:, None] + offset[None, :]
    inside = offset[None, :] < length[:, None]
    block_index = torch.where(inside, position // block_size, torch.zeros_like(position))
    block_number = block_table.to(torch.int64)[request[:, None], block_index]
    slots = torch.where(inside, block_number * block_size + position % block_size, torch.full_like(position, -1))
    slots = torch.where(valid[:, None], slots, torch.full_like(slots, -1))
    rows = swa_indices.reshape(swa_indices.shape[0], -1)
    rows[:num_tokens, :index_width] = slots.to(rows.dtype)
    swa_lens[:num_tokens] = torch.where(valid, length, torch.zeros_like(length)).to(swa_lens.dtype)


def compute_prefill_metadata(prefill_gather_lens, seq_lens, query_start_loc, replay_start, num_prefills, num_decodes,
                             window_size):
    """sparse_swa.ComputePrefillMetadataKernel: per prefill, its query length plus the visible window before it."""
    index = torch.arange(num_prefills, dtype=torch.int64) + num_decodes
    query_len = query_start_loc[index + 1].to(torch.int64) - query_start_loc[index].to(torch.int64)
    prefix_len = seq_lens[index].to(torch.int64) - query_len
    visible = (prefix_len - replay_start[index].to(torch.int64)).clamp(min=0)
    prefill_gather_lens[:num_prefills] = (query_len + visible.clamp(max=window_size - 1)).to(prefill_gather_lens.dtype)


def compressed_slot_mapping(compressed_slot_mapping, slot_mapping, query_start_loc, seq_lens, block_table, block_size,
                            compress_ratio, dcp_world_size, cp_interleave):
    """compressor_utils.CompressedSlotMappingKernel: the last token of every `compress_ratio` writes the
    compressed state's slot; every other token (and one whose own slot is PAD) maps to PAD (-1)."""
    for request in range(block_table.shape[0]):
        query_start = int(query_start_loc[request])
        query_len = int(query_start_loc[request + 1]) - query_start
        if query_len <= 0:
            continue
        pos = int(seq_lens[request]) - query_len + torch.arange(query_len, dtype=torch.int64)
        slot = slot_mapping[query_start:query_start + query_len].to(torch.int64)
        valid = ((pos + 1) % compress_ratio == 0) & (slot != -1)
        local = pos // (cp_interleave * dcp_world_size) * cp_interleave + pos % cp_interleave
        compressed = local // compress_ratio
        block_index = torch.where(valid, compressed // block_size, torch.zeros_like(compressed))
        block_number = block_table[request].to(torch.int64)[block_index]
        slots = torch.where(valid, block_number * block_size + compressed % block_size, torch.full_like(pos, -1))
        compressed_slot_mapping[query_start:query_start + query_len] = slots.to(compressed_slot_mapping.dtype)


def build_prefill_chunk_metadata(query_start_loc, uncompressed_seq_lens, cu_compressed_seq_lens, row_start_cu,
                                 token_to_seq, cu_seq_len_ks, cu_seq_len_ke, query_slice_start, query_slice_stop,
                                 dcp_rank, dcp_world, dcp_interleave, *, num_reqs, COMPRESS_RATIO):
    """indexer.BuildPrefillChunkMetadataKernel: per query token, its row range in the gathered compressed K;
    per compressed K row, its request."""
    assert dcp_world == 1, "decode context parallelism: not needed by a one-process engine"
    for request in range(num_reqs):
        query_start = int(query_start_loc[request])
        query_len = int(query_start_loc[request + 1]) - query_start
        seq_start = int(cu_compressed_seq_lens[request])
        seq_end = int(cu_compressed_seq_lens[request + 1])
        row_start = int(row_start_cu[request])
        start_pos = int(uncompressed_seq_lens[request]) - query_len
        offset = torch.arange(query_len, dtype=torch.int64)
        absolute = query_start + offset
        keep = (absolute >= query_slice_start) & (absolute < query_slice_stop)
        out = absolute[keep] - query_slice_start
        cu_seq_len_ks[out] = row_start
        cu_seq_len_ke[out] = (row_start + (start_pos + 1 + offset[keep]) // COMPRESS_RATIO).to(cu_seq_len_ke.dtype)
        token_to_seq[seq_start:seq_end] = request


def _patch_metadata(module) -> None:
    module.compute_token_to_req_indices = compute_token_to_req_indices


def _patch_sparse_swa(module) -> None:
    module.compute_token_to_req_indices = compute_token_to_req_indices
    module._COMPUTE_SWA_INDICES_AND_LENS_KERNEL = compute_swa_indices_and_lens
    module._COMPUTE_PREFILL_METADATA_KERNEL = compute_prefill_metadata


def _patch_cpu_mla(module) -> None:
    """Not a Triton kernel: vLLM 0.32's CPU SWA builder returns tile-scheduler slots for three layer types
    while the shared builder reads five (``KeyError: 'c1a'`` at the first step); CPU runs no tile
    scheduler, so every slot is None."""
    builder = module.DeepseekV4CPUSparseSWAMetadataBuilder
    plain = builder.build_tile_scheduler

    def build_tile_scheduler(self, num_decode_tokens):
        slots = dict.fromkeys(("swaonly", "c4a", "c128a", "c1a", "c2a"))
        slots.update(plain(self, num_decode_tokens))
        return slots

    builder.build_tile_scheduler = build_tile_scheduler


def _patch_compressor_utils(module) -> None:
    module._COMPRESSED_SLOT_MAPPING_KERNEL = compressed_slot_mapping


def _patch_indexer(module) -> None:
    module._BUILD_PREFILL_CHUNK_METADATA_KERNEL = build_prefill_chunk_metadata


# module name -> what replaces its Triton kernels, applied as the module is first imported.
PATCHED_MODULES = {
    "vllm.v1.attention.ops.metadata": _patch_metadata,
    "vllm.v1.attention.backends.mla.sparse_swa": _patch_sparse_swa,
    "vllm.models.deepseek_v4.cpu.cpu_mla": _patch_cpu_mla,
    "vllm.v1.attention.backends.mla.compressor_utils": _patch_compressor_utils,
    "vllm.v1.attention.backends.mla.indexer": _patch_indexer,
}

