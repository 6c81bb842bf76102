"""`lmcache_ascend.ops` refuses a block size or shape that does not match the paged caches.

Each case of the byte-exactness suite is run again with one of the arguments that
describe the paged caches disagreeing with them (`block_size` of
`multi_layer_kv_transfer`; `bs` of the block op's `PageBufferShapeDesc`, whose
other fields both read from the tensors).  Where LMCache 0.5.6's torch baseline raises, ours must raise
too rather than move rows at shifted offsets; where the baseline moves, ours moves
the same bytes or refuses (never other bytes).  Every output is poisoned and every
byte compared (`_cases.run_case`).
"""

from __future__ import annotations

import collections

import pytest
import torch

from tests.ops import _cases

pytest.importorskip("lmcache.v1.platform.torch_ops", reason="LMCache 0.5.x's torch baseline")

CASES_PER_OP = 300


class _Skewed:
    """An op surface whose cache description argument is changed by `skew` before each call."""

    def __init__(self, adapter, op: str, skew) -> None:
        self._adapter, self._op, self._skew = adapter, op, skew

    def __getattr__(self, name):
        value = getattr(self._adapter, name)
        if name != self._op:
            return value

        def call(*args, **kwargs):
            if name == "multi_layer_kv_transfer":
                kwargs["block_size"] = self._skew(kwargs["block_size"])
            else:
                desc = args[5]
                field, change = self._skew
                setattr(desc, field, change(getattr(desc, field)))
            return value(*args, **kwargs)

        return call


SKEWS = {
    "multi_layer_kv_transfer": {"block_size*2": lambda bs: bs * 2, "block_size/2": lambda bs: max(bs // 2, 1),
                                "block_size+1": lambda bs: bs + 1},
    "multi_layer_block_kv_transfer": {
        "bs*2": ("bs", lambda v: v * 2), "bs/2": ("bs", lambda v: max(v // 2, 1)),
    },
}


@pytest.mark.parametrize(
    "op, skew", [(op, name) for op, skews in SKEWS.items() for name in skews], ids=lambda value: str(value)
)
def test_a_cache_description_that_disagrees_is_refused_where_the_baseline_raises(op, skew):
    from tests.ops._baseline import lmcache_baseline, ours

    baseline = lmcache_baseline()
    mine = ours(baseline.fmt)
    change = SKEWS[op][skew]
    outcomes = collections.Counter()
    for seed in range(CASES_PER_OP):
        case = _cases.build(op, _cases.RandomDraw(seed), torch.device("cpu"))
        if op == "multi_layer_kv_transfer" and change(case["meta"]["bs"]) == case["meta"]["bs"]:
            continue
        outcome, detail = _cases.run_case(case, _Skewed(mine, op, change), _Skewed(baseline, op, change))
        if outcome == "mismatch" and detail.startswith("ours raised") and "baseline raised None" in detail:
            outcome = "ours-refuses"  # stricter than the baseline: allowed, never a silent difference
        outcomes[outcome] += 1
        assert outcome != "mismatch", f"{case['meta']} ({skew}): {detail}"
    # The skew must matter: the baseline raised in some cases (only some formats read the block size).
    assert outcomes["both-raise"] >= 0.03 * sum(outcomes.values()), outcomes
