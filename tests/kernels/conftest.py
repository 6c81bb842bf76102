"""The kernels' tests run the Triton kernel on the CPU through Triton's interpreter, in a fresh process
(TRITON_INTERPRET must be set before a kernel is decorated)."""

from __future__ import annotations

import pytest


@pytest.fixture
def interpreted(fresh_python):
    """Run `code` in a fresh interpreter under TRITON_INTERPRET=1; fail with its stderr unless it ends well."""
    pytest.importorskip("triton")

    def run(code: str) -> None:
        done = fresh_python(code + "\nprint('ok')\n", env={"TRITON_INTERPRET": "1"}, timeout=600)
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

    return run
