"""A hand-over's block ids expanded on the device (`kernels.block_slots`) equal the host's expansion.

The host expansion (`DeviceSlots.for_requests` with the torch backend, numpy) is the
oracle; it is itself checked row by row against vLLM-style slot mappings in
tests/multigroup/test_pure_logic.py. Requests mix full, compressed and sliding-window
groups, null blocks, cached prefixes ending inside a block and requests without rows;
every slot of every request is compared, and the kernel's output is poisoned first. The
kernel runs on CUDA when there is one and under Triton's interpreter (a subprocess).
"""

from __future__ import annotations

import random

import pytest
import torch

from lmcache_ascend.kv_worker import device_slots
from lmcache_ascend.kv_worker.device_slots import DeviceSlots
from lmcache_ascend.multigroup.slots import step_block_ids
from lmcache_ascend.multigroup.specs import KVGroupSpec, kv_groups_from_specs
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.multigroup.tracker import NULL_BLOCK_ID, GroupBlockTracker

CPU = torch.device("cpu")
POISON = -777
GROUPS = (
    KVGroupSpec(0, "Full", 16),
    KVGroupSpec(1, "C4", 16, compress_ratio=4),
    KVGroupSpec(2, "SlidingWindow", 8, sliding_window=32),
    KVGroupSpec(3, "C128", 128, compress_ratio=128),
)


def _requests(seed: int):
    """(requests for `DeviceSlots.for_requests`, the model's groups) of a random step."""
    draw = random.Random(seed)
    kv_groups = kv_groups_from_specs(GROUPS, 16, StateGroupPolicy())
    requests = {}
    for index in range(draw.randint(1, 6)):
        tokens = draw.choice([0, 1, 15, 16, 17, 255, 256, 700, draw.randint(0, 2000)])
        ids = []
        for group in kv_groups.groups:
            count = group.num_blocks(tokens)
            ids.append([NULL_BLOCK_ID if draw.random() < 0.2 else draw.randint(1, 400) for _ in range(count)])
        step = step_block_ids(kv_groups, GroupBlockTracker.for_new_request(tuple(ids), len(ids)), tokens, 256)
        store = draw.random() < 0.5
        cached = 0 if store or not tokens else draw.randint(0, tokens)  # may end inside a block
        requests[(f"r{index}", store)] = (step, cached)
    return requests, kv_groups


def _poisoned_expansion(monkeypatch, device: torch.device) -> None:
    """Make every device expansion write into a poisoned tensor, so an unwritten row shows."""
    from lmcache_ascend.kernels import block_slots

    real = block_slots.expand_on_device

    def poisoned(plan, ids, total_rows, on, **kwargs):
        out = torch.full((max(total_rows, 1),), POISON, dtype=torch.int64, device=on)
        return real(plan, ids, total_rows, on, out=out, **kwargs)

    monkeypatch.setattr(block_slots, "expand_on_device", poisoned)


def _compare(device: torch.device, seeds, *, queued: bool = False) -> int:
    """Every request's slots on `device` (Triton) equal the host's; returns the slots compared.
    `queued`: every step's expansion is issued before any is read (they reuse their upload tables)."""
    compared = 0
    steps = []
    for seed in seeds:
        requests, groups = _requests(seed)
        steps.append((seed, requests, DeviceSlots.for_requests(requests, groups, device, backend="triton")
                      if queued else None))
    for seed, requests, expanded in steps:
        groups = _requests(seed)[1]
        host = DeviceSlots.for_requests(requests, groups, CPU, backend="torch")
        if expanded is None:
            expanded = DeviceSlots.for_requests(requests, groups, device, backend="triton")
        assert list(expanded) == list(host)
        for key, want in host.items():
            got = expanded[key]
            assert got.slots.device.type == device.type
            assert (dict(got.offsets), dict(got.lengths)) == (dict(want.offsets), dict(want.lengths)), (seed, key)
            assert torch.equal(got.slots.cpu(), want.slots), (seed, key)
            compared += got.slots.numel()
    return compared


def test_the_host_oracle_has_skipped_and_moved_rows():
    """A control: the random steps hold null blocks, cached prefixes and real slots."""
    values = []
    for seed in range(20):
        requests, groups = _requests(seed)
        for slots in DeviceSlots.for_requests(requests, groups, CPU, backend="torch").values():
            values.extend(slots.slots.tolist())
    assert -1 in values and max(values) > 0


def test_requests_take_the_host_expansion_without_triton(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the device expansion ran for the torch backend")

    monkeypatch.setattr(device_slots, "_expanded_on_device", refuse)
    requests, groups = _requests(0)
    assert DeviceSlots.for_requests(requests, groups, CPU, backend="torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_expansion_equals_the_host_expansion_on_cuda(monkeypatch):
    pytest.importorskip("triton")
    _poisoned_expansion(monkeypatch, torch.device("cuda"))
    assert _compare(torch.device("cuda"), range(60)) > 10_000
    # issued back to back, each reading the ids uploaded for it, not those of the steps after it
    assert _compare(torch.device("cuda"), range(60, 120), queued=True) > 10_000


def test_device_expansion_equals_the_host_expansion_interpreted(fresh_python):
    pytest.importorskip("triton")
    code = (
        "import pytest, torch\n"
        "from tests.kv_worker.test_device_expansion import _compare, _poisoned_expansion\n"
        "mp = pytest.MonkeyPatch()\n"
        "_poisoned_expansion(mp, torch.device('cpu'))\n"
        "print('compared', _compare(torch.device('cpu'), range(12)))\n"
    )
    done = fresh_python(code, env={"TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and "compared" in done.stdout, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 1000


def test_a_plan_that_leaves_rows_uncovered_fills_them_with_minus_one(fresh_python):
    pytest.importorskip("triton")
    code = (
        "import numpy as np, torch\n"
        "from lmcache_ascend.kernels.block_slots import expand_on_device\n"
        "plan = [(2, 5, 0, 2, 1), (9, 3, 3, 4, 0)]\n"
        "ids = [np.array([4, 0, 7], dtype=np.int64), np.array([1, 2], dtype=np.int64)]\n"
        "out = torch.full((14,), -777, dtype=torch.int64)\n"
        "got = expand_on_device(plan, ids, 14, torch.device('cpu'), null_id=0, fill=True, out=out)\n"
        "print(got.tolist())\n"
    )
    done = fresh_python(code, env={"TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    # entry 0: rows 2..6, ids 4, 0, 7 (2 rows a block), first row cached; entry 1: rows 9..11,
    # id 1 (4 rows a block); rows 0, 1, 7, 8, 12, 13 belong to no entry
    assert eval(done.stdout.strip()) == [-1, -1, -1, 9, -1, -1, 14, -1, -1, 4, 5, 6, -1, -1]
