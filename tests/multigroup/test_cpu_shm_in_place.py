"""LMCache's own CPU shared-memory registration (``migrate_to_shm_and_wrap``, which its MP transfer calls
for every KV cache of a CPU worker) of caches that are strided views of pages shared by several layers,
as vLLM's CPU worker lays out DeepSeek-V4's.

Two layers view one pool with different offsets; LMCache's connector registers reshaped views of its
own, so the views registered here are not the tensors the model writes. Both are registered, sent
through LMCache's own wire encoding and mapped again as LMCache's server does, in another process.
Bytes the model writes after registration, through its own views (never handed to LMCache), must be
what the other process reads, every element; bytes the other process writes must reach the model's
views. Without ``lmcache-cpu-shm-in-place`` (the control) LMCache refuses the first view.
"""

from __future__ import annotations

import multiprocessing

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache.v1.platform.devices.cpu.shm", reason="LMCache without its CPU shared-memory wrapper")

PATCH = "lmcache-cpu-shm-in-place"
# A pool large enough to lie on pages of its own (the allocator maps it apart from the heap), as a KV pool does.
BLOCKS, PAGE_BYTES = 40_000, 1000


def _model_views():
    """The model's views: layer 0 the first 584 bytes of each page as [blocks, 8, 73] uint8, layer 1 the last
    400 as [blocks, 8, 25] bf16 (a window with an offset)."""
    pool = torch.zeros(BLOCKS, PAGE_BYTES, dtype=torch.uint8)
    return pool, pool[:, :584].view(BLOCKS, 8, 73), pool[:, 600:].view(torch.bfloat16).view(BLOCKS, 8, 25)


def _registered(layer):
    """What LMCache's connector registers: a reshaped view of its own ([blocks, 1, ...])."""
    return layer.unsqueeze(1)


def _bytes(tensor) -> bytes:
    return tensor.clone().view(torch.uint8).numpy().tobytes()


def _encode(wrapper) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(wrapper.to_wire())


def _decode(wire: bytes):
    import msgspec
    from lmcache.v1.platform.base.ipc_wire import CpuShmIPCData
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

    return CpuShmTensorWrapper.from_wire(msgspec.msgpack.decode(wire, type=CpuShmIPCData))


def _map_and_write(wires: list[bytes], replies) -> None:
    """The server's side: map each descriptor's segment, report its bytes, then write a pattern into it."""
    tensors = [_decode(wire).to_tensor() for wire in wires]
    replies.put([_bytes(tensor) for tensor in tensors])
    for index, tensor in enumerate(tensors):
        tensor.copy_(torch.full_like(tensor, 7 + index))
    replies.put("written")


def test_the_model_and_the_server_share_the_pages(patched):
    from lmcache.v1.platform.devices.cpu import shm

    pool, layer0, layer1 = _model_views()
    if not patched:
        with pytest.raises(ValueError, match="requires a contiguous tensor"):
            shm.migrate_to_shm_and_wrap(_registered(layer0))
        return
    wrappers = [shm.CpuShmTensorWrapper.wrap(_registered(layer)) for layer in (layer0, layer1)]
    assert wrappers[0].shm_name == wrappers[1].shm_name, "two views of one storage must share one segment"
    # Written after registration, through the model's own views (as vLLM writes its caches).
    layer0.copy_(torch.randint(0, 256, layer0.shape, dtype=torch.uint8))
    layer1.copy_(torch.randn(layer1.shape).to(torch.bfloat16))
    written, gap = [_bytes(layer0), _bytes(layer1)], _bytes(pool[:, 584:600])
    context = multiprocessing.get_context("spawn")
    replies = context.Queue()
    server = context.Process(target=_map_and_write, args=([_encode(w) for w in wrappers], replies))
    server.start()
    try:
        assert replies.get(timeout=120) == written
        assert replies.get(timeout=120) == "written"
    finally:
        server.join(60)
    assert server.exitcode == 0
    assert torch.equal(layer0, torch.full_like(layer0, 7))
    assert torch.equal(layer1, torch.full_like(layer1, 8))
    assert _bytes(pool[:, 584:600]) == gap, "bytes between the two layers changed"


def test_small_tensors_share_too(patched):
    """A cache registered whole (contiguous) shares its pages in place as well; bytes round-trip exactly."""
    from lmcache.v1.platform.devices.cpu import shm

    cache = torch.arange(4 * 16, dtype=torch.int16).view(4, 16)
    wrapper = shm.migrate_to_shm_and_wrap(cache)
    assert wrapper.stride == (16, 1) and wrapper.shape == (4, 16)
    mapped = _decode(_encode(wrapper)).to_tensor()
    assert torch.equal(mapped, torch.arange(64, dtype=torch.int16).view(4, 16))
    cache[2, 3] = -5
    assert mapped[2, 3] == -5, "the registered tensor and the mapped segment must be one memory"
