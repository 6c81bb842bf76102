"""Test-session set-up shared by every test directory.

The suite runs inside a real stack (scripts/test-env): vLLM, LMCache and torch
are the pinned wheels, never look-alikes.  Importing ``lmcache_ascend`` arms its
patches; the session disarms them at once, so every test starts from pristine
upstream modules and applies (and reverts) exactly the patches it is about.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# The wheel's .pth hook must not activate the overlay behind the tests' back.
os.environ.setdefault("LMCACHE_ASCEND_AUTOLOAD", "0")

import lmcache_ascend  # noqa: E402  (after the environment is set)
from hypothesis import HealthCheck, settings  # noqa: E402

lmcache_ascend.deactivate()

# "ci" replays the same examples every run (a red CI must be reproducible) and has
# no deadline (a 2-core CI box is slow and shared); "dev" explores new examples.
settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def run_fresh_python(code: str, env: dict[str, str] | None = None, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run `code` in a new interpreter of this stack, with the checkout first on sys.path."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_ASCEND_", "VLLM_ASCEND_"))}
    child_env["PYTHONPATH"] = str(REPO_ROOT)
    child_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def fresh_python():
    return run_fresh_python


@pytest.fixture(params=[True, False], ids=["patched", "control"])
def patched(request):
    """The test module's ``PATCH`` applied for the test (True), or left off for its control run
    (False): a test that takes this fixture runs twice and asserts what differs without the patch."""
    from lmcache_ascend.patches import State, registry
    from tests.patching import apply_now

    patches = registry.process_registry()
    name = request.module.PATCH
    if request.param:
        assert apply_now(patches, name) is State.APPLIED, patches.record(name).reason
    else:
        assert patches.record(name).state is not State.APPLIED
    yield request.param
    if request.param:
        patches.revert(name)
