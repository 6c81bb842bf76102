"""Run the equality cases on the Triton kernel through Triton's interpreter (TRITON_INTERPRET=1, CPU)."""

from __future__ import annotations

import collections
import sys

import torch

from lmcache_ascend.kernels import launch_counter
from tests.ops import _cases
from tests.ops._baseline import lmcache_baseline, ours


def main(cases_per_op: int) -> None:
    baseline = lmcache_baseline()
    mine = ours(baseline.fmt)
    failed = False
    for op in _cases.OPS:
        outcomes = collections.Counter()
        launch_counter.reset()
        for seed in range(cases_per_op):
            case = _cases.build(op, _cases.RandomDraw(seed), torch.device("cpu"))
            outcome, detail = _cases.run_case(case, mine, baseline)
            outcomes[outcome] += 1
            outcomes[detail] += outcome == "equal"
            if outcome == "mismatch":
                failed = True
                print("MISMATCH", op, seed, case["meta"], detail)
        assert launch_counter.torch == 0 and launch_counter.triton > 0, launch_counter
        print(f"{op} equal={outcomes['equal']} both-raise={outcomes['both-raise']} mismatch={outcomes['mismatch']} "
              f"moved={outcomes['moved']}")
    sys.exit(1 if failed else 0)
