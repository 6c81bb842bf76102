"""LMCache's own Ascend platform binds `lmcache_ascend.ops`, and LMCache's code runs on the bound ops."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("lmcache.v1.platform.devices.npu.device_ops", reason="LMCache 0.5.x platform layer")

from tests.ops._cases import OPS  # noqa: E402

# The list: every op LMCache dispatches KV movement to, and the one type they take.
EXPECTED = {*OPS, "PageBufferShapeDesc"}


def test_public_surface_is_exactly_the_device_ops():
    import lmcache_ascend.ops as ops

    public = {name for name in dir(ops) if not name.startswith("_")}
    bindable = {name for name in public if isinstance(getattr(ops, name), type) or callable(getattr(ops, name))}
    assert bindable == EXPECTED == set(ops.__all__)


def test_import_is_cheap_and_needs_no_npu_nor_triton(fresh_python):
    result = fresh_python(
        "import sys, time; t = time.perf_counter(); import lmcache_ascend.ops; "
        "print('SECONDS', time.perf_counter() - t); "
        "print('LOADED', sorted(m for m in ('triton', 'lmcache', 'torch_npu') if m in sys.modules))",
        env={"LMCACHE_ASCEND_AUTOLOAD": "0"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED []" in result.stdout, result.stdout


def test_npu_device_ops_ensure_native_binds_our_ops():
    from lmcache.v1.platform.devices.npu.device_ops import NpuDeviceOps

    import lmcache_ascend.ops as ops

    device_ops = NpuDeviceOps()
    device_ops.ensure_native()  # imports lmcache_ascend.ops: no NPU needed for that
    for name in EXPECTED:
        assert getattr(device_ops, name) is getattr(ops, name), name
    # LMCache's MP transfer context passes tensors to ops whose annotation says so.
    from lmcache.v1.multiprocess.transfer_context.base import _detect_block_transfer_accepts_tensor

    assert _detect_block_transfer_accepts_tensor(device_ops.multi_layer_block_kv_transfer)


def _bound_ops(monkeypatch):
    """LMCache's `device_ops` (CPU) swapped for an NpuDeviceOps that bound our ops."""
    import lmcache
    from lmcache.v1.platform.devices.npu.device_ops import NpuDeviceOps

    device_ops = NpuDeviceOps()
    device_ops.ensure_native()
    monkeypatch.setattr(lmcache, "device_ops", device_ops)
    return device_ops


def test_lmcache_mp_gather_and_scatter_run_on_our_ops_and_equal_the_baseline(monkeypatch):
    from lmcache.v1.multiprocess.transfer_context import base

    layers, blocks, bs, heads, head_size = 3, 8, 4, 2, 8
    kv = {f"model.layers.{i}.attn": torch.randn(2, blocks, bs, heads, head_size, dtype=torch.bfloat16)
          for i in range(layers)}
    block_ids = [5, 1, 7, 2]
    expected = base.gather_paged_kv_to_cpu(kv, block_ids, blocks_per_chunk=2)
    device_ops = _bound_ops(monkeypatch)
    calls = []
    original = device_ops.multi_layer_block_kv_transfer
    monkeypatch.setattr(device_ops, "multi_layer_block_kv_transfer",
                        lambda *a, **k: (calls.append(1), original(*a, **k))[1], raising=False)
    monkeypatch.setattr(base, "resolve_device_ops", lambda device_type: device_ops)
    monkeypatch.setattr(base, "_detect_block_transfer_accepts_tensor", lambda fn: True)
    poisoned = [torch.full_like(t, 7.0) for t in expected]
    got = base.gather_paged_kv_to_cpu(kv, block_ids, blocks_per_chunk=2, out=poisoned)
    assert calls, "LMCache did not call our op"
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, expected))
    assert not torch.equal(expected[0], torch.full_like(expected[0], 7.0))  # control: data moved
