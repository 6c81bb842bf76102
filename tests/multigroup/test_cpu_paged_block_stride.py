"""LMCache's own torch transfer of its MP server (``multi_layer_block_kv_transfer`` of
``lmcache.v1.platform.torch_ops.mp_mem_kernels``, which a CPU server runs) over a pool whose pages
hold several layers' blocks, addressed by raw pointers and ``block_stride_elems`` as LMCache's server
hands them over.

Two layers share each page (a gap of padding between them and at the page's end), blocks out of
order. A store must copy exactly each layer's blocks into the chunk objects, every element, against
plain indexing of the layers' own views; a load into a poisoned pool must write exactly those blocks
back and leave every other byte (other blocks, the padding) poisoned. Without
``lmcache-cpu-paged-block-stride`` (the control) LMCache refuses the pool.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("lmcache.v1.platform.torch_ops.mp_mem_kernels",
                              reason="LMCache without its torch MP transfer")

PATCH = "lmcache-cpu-paged-block-stride"
BLOCKS, BLOCK_SIZE, WIDTH = 9, 4, 24           # per layer: [blocks, tokens per block, bytes per token]
LAYER_BYTES = BLOCK_SIZE * WIDTH
LAYER_OFFSETS = (8, 8 + LAYER_BYTES + 40)      # where each layer's block starts inside a page
PAGE = LAYER_OFFSETS[1] + LAYER_BYTES + 16     # one page: both layers' blocks and padding
BLOCK_IDS = [5, 2, 7, 0, 3, 8]
BLOCKS_PER_CHUNK = 2
POISON = 0xAB


def _pool(fill: str):
    pages = torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8) if fill == "random" else \
        torch.full((BLOCKS, PAGE), POISON, dtype=torch.uint8)
    layers = [pages[:, offset:offset + LAYER_BYTES].view(BLOCKS, BLOCK_SIZE, WIDTH) for offset in LAYER_OFFSETS]
    return pages, layers


def _transfer(layers, chunks, direction):
    from lmcache.lmcache_native import EngineKVFormat
    from lmcache.v1.platform.ops_types import PageBufferShapeDesc

    desc = PageBufferShapeDesc()
    desc.nb, desc.nl, desc.bs, desc.nh, desc.hs = BLOCKS, len(layers), BLOCK_SIZE, 1, WIDTH
    desc.kv_size, desc.element_size, desc.block_stride_elems = 1, 1, PAGE
    pointers = torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.int64)
    kernels.multi_layer_block_kv_transfer(pointers, chunks, BLOCK_IDS, "cpu", direction, desc,
                                          BLOCKS_PER_CHUNK * BLOCK_SIZE, EngineKVFormat.NL_X_NB_BS_HS, 0)


def _chunks(layers) -> list:
    """What each chunk object holds, by plain indexing of the layers' views: [layers, tokens, width]."""
    return [torch.stack([layer[BLOCK_IDS[start:start + BLOCKS_PER_CHUNK]].reshape(-1, WIDTH) for layer in layers])
            for start in range(0, len(BLOCK_IDS), BLOCKS_PER_CHUNK)]


def test_store_and_load_through_pages_shared_by_layers(patched):
    from lmcache.lmcache_native import TransferDirection

    _, layers = _pool("random")
    chunks = [torch.full((len(layers), BLOCKS_PER_CHUNK * BLOCK_SIZE, WIDTH), POISON, dtype=torch.uint8)
              for _ in range(len(BLOCK_IDS) // BLOCKS_PER_CHUNK)]
    if not patched:
        with pytest.raises(NotImplementedError, match="Non-tight per-block strides"):
            _transfer(layers, chunks, TransferDirection.D2H)
        return
    _transfer(layers, chunks, TransferDirection.D2H)
    expected = _chunks(layers)
    assert all(torch.equal(chunk, want) for chunk, want in zip(chunks, expected, strict=True))

    pages, loaded = _pool("poison")
    _transfer(loaded, chunks, TransferDirection.H2D)
    for layer, source in zip(loaded, layers, strict=True):
        assert torch.equal(layer[BLOCK_IDS], source[BLOCK_IDS])
    written = torch.zeros_like(pages, dtype=torch.bool)
    for offset in LAYER_OFFSETS:
        written[BLOCK_IDS, offset:offset + LAYER_BYTES] = True
    assert torch.all(pages[~written] == POISON), "bytes outside the loaded blocks were written"


def test_tight_pools_take_upstream_path_unchanged(patched):
    """A pool whose blocks are a block apart goes to upstream's own reconstruction, patched or not."""
    from lmcache.lmcache_native import EngineKVFormat, TransferDirection
    from lmcache.v1.platform.ops_types import PageBufferShapeDesc

    layer = torch.randint(0, 256, (BLOCKS, BLOCK_SIZE, WIDTH), dtype=torch.uint8)
    desc = PageBufferShapeDesc()
    desc.nb, desc.nl, desc.bs, desc.nh, desc.hs = BLOCKS, 1, BLOCK_SIZE, 1, WIDTH
    desc.kv_size, desc.element_size, desc.block_stride_elems = 1, 1, LAYER_BYTES
    chunks = [torch.full((1, BLOCKS_PER_CHUNK * BLOCK_SIZE, WIDTH), POISON, dtype=torch.uint8)
              for _ in range(len(BLOCK_IDS) // BLOCKS_PER_CHUNK)]
    kernels.multi_layer_block_kv_transfer(torch.tensor([layer.data_ptr()], dtype=torch.int64), chunks, BLOCK_IDS,
                                          "cpu", TransferDirection.D2H, desc, BLOCKS_PER_CHUNK * BLOCK_SIZE,
                                          EngineKVFormat.NL_X_NB_BS_HS, 0)
    assert all(torch.equal(chunk, want) for chunk, want in zip(chunks, _chunks([layer]), strict=True))
