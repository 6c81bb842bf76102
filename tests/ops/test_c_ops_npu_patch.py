"""Stack A: `lmcache-c-ops-npu` gives LMCache 0.4.5's `lmcache.c_ops` users our ops on an NPU host, only there.

Our ops equal LMCache 0.4.5's own Python fallback byte for byte on the shared
random cases (its direction is a plain Enum, so ints are converted for it; the
formats it lacks, > 8, are left out). The host is faked (torch.npu), LMCache is real.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

fallback = pytest.importorskip("lmcache.non_cuda_equivalents", reason="LMCache 0.4.x's c_ops fallback")
if not hasattr(fallback, "GPUKVFormat"):
    pytest.skip("LMCache 0.5.x has no 0.4.x c_ops fallback", allow_module_level=True)

from lmcache_ascend.patches import registry as registry_module  # noqa: E402
from lmcache_ascend.patches.lmcache.c_ops_npu import OPS  # noqa: E402
from lmcache_ascend.patches.model import State  # noqa: E402
from tests.framework.test_catalogue_contract import fake_served_host, flags_enabling  # noqa: E402
from tests.ops import _cases  # noqa: E402
from tests.ops._baseline import Adapter, ours  # noqa: E402
from tests.ops._cases import HypothesisDraw  # noqa: E402
from tests.patching import apply_now  # noqa: E402

CASES_PER_OP = int(os.environ.get("LMCACHE_ASCEND_OPS_CASES", "300"))
NAME = "lmcache-c-ops-npu"
# Where each op takes its direction (0.4.x: TransferDirection is an Enum, not an int).
DIRECTION_AT = {"multi_layer_kv_transfer": 5, "multi_layer_kv_transfer_unilateral": 5, "single_layer_kv_transfer": 3}


class Fallback045(Adapter):
    def __getattr__(self, name):
        op = getattr(self._module, name)
        if name not in DIRECTION_AT:
            return op

        def call(*args, **kwargs):
            args = list(args)
            args[DIRECTION_AT[name]] = fallback.TransferDirection(args[DIRECTION_AT[name]])
            return op(*args, **kwargs)

        return call


@pytest.mark.parametrize("op", OPS)
def test_our_op_equals_lmcache_045_fallback(op):
    baseline = Fallback045(fallback, fallback.GPUKVFormat, fallback.PageBufferShapeDesc)
    mine = ours(fallback.GPUKVFormat)
    outcomes = collections.Counter()

    @settings(max_examples=CASES_PER_OP, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        case = _cases.build(op, HypothesisDraw(data), torch.device("cpu"))
        assume(case["meta"].get("fmt", 0) in set(fallback.GPUKVFormat))
        outcome, detail = _cases.run_case(case, mine, baseline)
        outcomes[outcome] += 1
        outcomes[detail] += outcome == "equal"
        assert outcome != "mismatch", f"{case['meta']}: {detail}"

    check()
    assert outcomes["equal"] >= 0.9 * sum(outcomes[k] for k in ("equal", "both-raise")), outcomes
    assert outcomes["moved"] >= 0.3 * outcomes["equal"], outcomes  # hypothesis starts from small (empty) cases


@pytest.fixture
def registry():
    registry = registry_module.process_registry()
    yield registry
    registry.revert(NAME)


def test_cpu_host_keeps_lmcache_fallback(registry):
    import lmcache.c_ops as c_ops

    before = {name: getattr(c_ops, name) for name in OPS}
    assert apply_now(registry, NAME, flags_enabling(NAME)) is State.SKIPPED_HOST
    assert "no NPU" in registry.record(NAME).reason
    assert {name: getattr(c_ops, name) for name in OPS} == before


def test_cuda_host_keeps_lmcache_ops(registry, monkeypatch):
    import lmcache.c_ops as c_ops

    before = {name: getattr(c_ops, name) for name in OPS}
    fake_served_host(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_now(registry, NAME, flags_enabling(NAME)) is State.SKIPPED_HOST
    assert "CUDA host" in registry.record(NAME).reason
    assert {name: getattr(c_ops, name) for name in OPS} == before


@pytest.mark.parametrize("op", OPS)
def test_npu_host_lmcache_c_ops_users_run_our_op(registry, monkeypatch, op):
    import lmcache.c_ops as c_ops

    import lmcache_ascend.ops as our_ops

    assert c_ops is fallback  # LMCache put its fallback in lmcache.c_ops's place
    original = getattr(c_ops, op)
    calls = []
    real = getattr(our_ops, op)
    monkeypatch.setattr(our_ops, op, lambda *a, **k: (calls.append(op), real(*a, **k))[1])
    fake_served_host(monkeypatch)
    assert apply_now(registry, NAME, flags_enabling(NAME)) is State.APPLIED
    # A c_ops user (LMCache's own call shape, its Enum direction) now runs ours, with the fallback's bytes.
    for seed in range(50):  # up to the first case that moves bytes
        case = _cases.build(op, _cases.RandomDraw(seed), torch.device("cpu"))
        if case["meta"].get("fmt", 1) not in set(fallback.GPUKVFormat):
            continue
        outcome, detail = _cases.run_case(case, Fallback045(c_ops, fallback.GPUKVFormat, None),
                                          Fallback045(_Originals(original, op), fallback.GPUKVFormat, None))
        assert outcome == "equal", (case["meta"], detail)
        if detail == "moved":
            break
    assert calls and detail == "moved", (calls, detail)
    assert registry.revert(NAME) is State.REVERTED
    assert getattr(c_ops, op) is original


class _Originals:
    """The fallback with one op as it was before the patch."""

    def __init__(self, original, op):
        self._original, self._op = original, op

    def __getattr__(self, name):
        return self._original if name == self._op else getattr(fallback, name)
