"""vllm-ascend DeepSeek-V4 patches: absent vllm-ascend here, its real sdist in a subprocess."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.patches import State, registry
from tests.fixtures.sdists import sdists_dir
from tests.patching import apply_now

REGISTRY = registry.process_registry()
REPO = Path(__file__).resolve().parents[2]
PATCH_MODULES = {
    "vllm-ascend-dsv4-prefix-block-size": "lmcache_ascend.patches.vllm_ascend.dsv4_prefix_block_size",
    "vllm-ascend-dsv4-attention-block-size": "lmcache_ascend.patches.vllm_ascend.dsv4_compressed_block_size_attention",
    "vllm-ascend-dsv4-indexer-block-size": "lmcache_ascend.patches.vllm_ascend.dsv4_compressed_block_size_indexer",
    "vllm-ascend-kv-cache-layer-names": "lmcache_ascend.patches.vllm_ascend.kv_cache_layer_names",
    "vllm-ascend-dsv4-aggregated-page-size": "lmcache_ascend.patches.vllm_ascend.dsv4_aggregated_page_size",
}
# The vllm-ascend release built on each stack's vLLM (fetched by scripts/fetch-vllm-ascend).
VLLM_VERSION = Version(installed_version("vllm"))
# vLLM 0.33 (stack C) has no vllm-ascend release built on it.
SDIST_VERSION = (
    "0.18.0" if VLLM_VERSION < Version("0.23") else "0.23.0.post1" if VLLM_VERSION < Version("0.24") else None
)


def test_patch_modules_import_without_vllm_ascend_and_report_target_missing():
    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("vllm-ascend is installed here: its targets are not missing")
    for name, module_name in PATCH_MODULES.items():
        module = importlib.import_module(module_name)
        assert module.PATCH.name == name
        assert apply_now(REGISTRY, name) is State.TARGET_MISSING
        assert "not found" in REGISTRY.record(name).reason


@pytest.mark.subprocess
def test_against_real_vllm_ascend_source():
    if SDIST_VERSION is None:
        # No vllm-ascend exists for this vLLM: its patches must stay out, reporting why.
        for name in PATCH_MODULES:
            assert apply_now(REGISTRY, name) is State.TARGET_MISSING
        return
    sdist = sdists_dir() / f"vllm-ascend-{SDIST_VERSION}"
    assert (sdist / "vllm_ascend").is_dir(), f"missing {sdist}: run scripts/fetch-vllm-ascend"
    env = dict(os.environ, LMCACHE_ASCEND_AUTOLOAD="0", VLLM_ASCEND_SDIST=str(sdist))
    env.pop("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).with_name("sdist_checks.py"))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
