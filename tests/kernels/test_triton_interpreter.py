"""The Triton kernel's source, run on CPU through Triton's interpreter (one fresh process).

TRITON_INTERPRET must be set before the kernel is decorated, hence the subprocess.
"""

from __future__ import annotations

import re

import pytest

INTERPRETED_EXAMPLES = 120


@pytest.mark.subprocess
def test_triton_kernel_matches_the_contract_under_the_interpreter(fresh_python):
    result = fresh_python(
        f"from tests.kernels._triton_interpret_fuzz import main; main({INTERPRETED_EXAMPLES})",
        env={"TRITON_INTERPRET": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert re.search(r"REGRESSIONS_OK 12", result.stdout), result.stdout[-4000:]
    summary = re.search(r"TRITON_INTERPRET_OK examples=(\d+) widths=(\[.*\])", result.stdout)
    assert summary, result.stdout[-4000:]
    assert int(summary.group(1)) >= INTERPRETED_EXAMPLES // 2, summary.group(0)
    # Every element width (16/4/2/1 bytes) of the kernel was exercised.
    assert summary.group(2) == "[1, 2, 4, 16]", summary.group(0)
