"""`kernels.upload`: every value arrives (small copies from pageable memory, large ones pinned); per-call tables
are kept per stream on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_ascend.kernels.upload import PAGEABLE_UPLOAD_BYTES, stream_table, to_device

SIZES = (1, 5, PAGEABLE_UPLOAD_BYTES // 8, PAGEABLE_UPLOAD_BYTES // 8 + 1, 3 * PAGEABLE_UPLOAD_BYTES // 8)


def _values(count: int) -> np.ndarray:
    return np.random.default_rng(count).integers(-(2**62), 2**62, size=count, dtype=np.int64)


@pytest.mark.parametrize("count", SIZES)
def test_the_cpu_gets_the_values_themselves_or_a_copy_into_out(count):
    values = _values(count)
    shared = to_device(values, torch.device("cpu"))
    assert shared.data_ptr() == values.ctypes.data and shared.tolist() == values.tolist()
    out = torch.full((count,), -7, dtype=torch.int64)
    assert to_device(values, torch.device("cpu"), out=out) is out
    values_before = values.copy()
    values[:] = 0  # the copy is made: `out` keeps what was given
    assert out.tolist() == values_before.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("count", SIZES)
def test_cuda_copies_arrive_whole_and_values_may_be_reused_at_once(count):
    device = torch.device("cuda")
    expected = _values(count)
    values = expected.copy()
    fresh = to_device(values, device)
    out = torch.full((count,), -7, dtype=torch.int64, device=device)
    assert to_device(values, device, out=out) is out
    values[:] = 0  # reused as soon as the calls return, before the device has run the copies
    torch.cuda.synchronize()
    assert fresh.cpu().tolist() == expected.tolist() and out.cpu().tolist() == expected.tolist()


def test_the_cpu_gets_a_new_table_each_call():
    first, second = stream_table(torch.device("cpu"), 8), stream_table(torch.device("cpu"), 8)
    assert first.shape == (8,) and first.dtype == torch.int64 and first.data_ptr() != second.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tables_are_kept_per_stream_and_length():
    device = torch.device("cuda")
    table = stream_table(device, 16)
    assert stream_table(device, 16) is table and stream_table(device, 32) is not table
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert stream_table(device, 16) is not table
