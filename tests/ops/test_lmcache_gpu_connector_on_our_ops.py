"""LMCache 0.5.x's own vLLM GPU connector stores and loads chunks on our bound ops exactly as on its torch baseline."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("lmcache.v1.platform.devices.npu.device_ops", reason="LMCache 0.5.x platform layer")

CASES = 12  # x 3 layouts, each a store of 1-3 chunks and a load of them


def _run(fresh_python, corrupt: bool):
    return fresh_python(
        f"from tests.ops._connector_run import main; main({CASES}, corrupt={corrupt})",
        env={"PYTHONOPTIMIZE": "1", "LMCACHE_ASCEND_AUTOLOAD": "0", "LMCACHE_ASCEND_TRANSFER_BACKEND": "torch"},
        timeout=600,
    )


@pytest.mark.subprocess
def test_vllm_paged_connector_from_gpu_to_gpu_equal_the_baseline_on_our_ops(fresh_python):
    result = _run(fresh_python, corrupt=False)
    assert result.returncode == 0 and f"CASES {CASES} PROBLEMS 0" in result.stdout, (
        result.stdout[-4000:] + result.stderr[-4000:]
    )


@pytest.mark.subprocess
def test_the_comparison_finds_one_wrong_byte(fresh_python):
    result = _run(fresh_python, corrupt=True)
    found = re.search(r"PROBLEMS (\d+)", result.stdout)
    assert result.returncode == 1 and found and int(found.group(1)) >= CASES, result.stdout[-4000:] + result.stderr[-4000:]
