"""What a user meets in the listing command: plain words, 120 columns, one line per bad input.

Every command (listing, ``flags``, ``--strict``, ``--import``, ``--json``) refuses a patch name in
LMCACHE_ASCEND_DISABLED_PATCHES that is no patch with the same one line and exit status 2
(``--json`` still prints its report, ``flag_error`` filled); ``flags`` says where a value from
LMCache's YAML file comes from; a distribution other than ours that provides ``lmcache_ascend``
(LMCache-Ascend uses the same names) is named in one warning line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmcache_ascend import __version__
from lmcache_ascend.patches import registry as registry_module
from tests.conftest import REPO_ROOT
from tests.framework.test_cli import run_cli

REGISTRY = registry_module.process_registry()
PROGRAM = "python -m lmcache_ascend.patches"

TYPO = {"LMCACHE_ASCEND_DISABLED_PATCHES": "vllm-free-queue-prepen"}
TYPO_TEXT = (
    "invalid lmcache-ascend flag: LMCACHE_ASCEND_DISABLED_PATCHES='vllm-free-queue-prepen' names no patch "
    "'vllm-free-queue-prepen' (did you mean 'vllm-free-queue-prepend'?); allowed: '*' or patch names"
)


@pytest.mark.parametrize("args", [(), ("flags",), ("--strict",), ("--import",), ("--json",)], ids=" ".join)
def test_a_disabled_patch_that_is_no_patch_is_one_line_and_exit_2_in_every_command(args):
    result = run_cli(*args, env=TYPO, bare=args != ("--import",))
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    problem = [line for line in result.stderr.splitlines() if "LMCACHE_ASCEND" in line]
    assert len(problem) == 1 and problem[0].startswith(f"{PROGRAM}: {TYPO_TEXT}"), result.stderr
    if args == ("--json",):
        report = json.loads(result.stdout)
        assert report["flag_error"].startswith(TYPO_TEXT)
        assert [row["name"] for row in report["patches"]] == REGISTRY.names()


def test_a_target_that_does_not_import_is_one_line_for_fingerprint():
    script = str(REPO_ROOT / "scripts" / "patch_catalogue.py")
    result = subprocess.run([sys.executable, "-S", script, "fingerprint", "vllm-ascend-kv-cache-layer-names"],
                            env={**os.environ, "LMCACHE_ASCEND_AUTOLOAD": "0"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "fingerprint vllm-ascend-kv-cache-layer-names: vllm_ascend.worker.v2.attn_utils does not import here: "
        "ModuleNotFoundError: No module named 'vllm_ascend'"
    ]


def test_flags_shows_the_values_of_lmcaches_file_with_their_source(tmp_path):
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nascend_blend_holes: true\nascend_skip_state_spec_allowlist: [C4AttnKVState]\n")
    result = run_cli("flags", env={"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_ASCEND_DISABLED_PATCHES": ""})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"LMCACHE_ASCEND_BLEND_HOLES = 1 (from {config}: ascend_blend_holes)" in lines
    assert f"LMCACHE_ASCEND_SKIP_STATE_SPEC_ALLOWLIST = C4AttnKVState (from {config}: ascend_skip_state_spec_allowlist)" in lines
    assert "LMCACHE_ASCEND_DISABLED_PATCHES = (empty list)" in lines  # set empty: the empty list
    assert "LMCACHE_ASCEND_TRANSFER_BACKEND = auto (default)" in lines
    # The listing follows the same value: the blend patches are on.
    listing = json.loads(run_cli("--json", env={"LMCACHE_CONFIG_FILE": str(config)}).stdout)
    states = {row["name"]: row["state"] for row in listing["patches"]}
    assert states["lmcache-blend-holes-engine"] != "skipped-disabled"


def test_an_empty_flag_is_refused_by_the_command():
    result = run_cli("flags", env={"LMCACHE_ASCEND_BUNDLE_MULTI_SPEC": ""}, bare=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{PROGRAM}: invalid lmcache-ascend flag: LMCACHE_ASCEND_BUNDLE_MULTI_SPEC='' is empty; "
        "allowed: 1/0, true/false, yes/no, on/off (unset it for the default, 1)"
    ]


@pytest.fixture(scope="module")
def listings():
    return {mode: run_cli(*args) for mode, args in
            {"no-import": (), "import": ("--import",), "wide": ("--wide",)}.items()}


JARGON = ("guard:", "lacks-fix", "has-fix", "probe", "target-missing", "skipped-", "pending", "module vllm_ascend")


@pytest.mark.parametrize("mode", ["no-import", "import"])
def test_the_listing_fits_120_columns_in_plain_words(listings, mode):
    result = listings[mode]
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    table = [line for line in lines if line.split(" ", 1)[0] in REGISTRY.names()]
    assert len(table) == len(REGISTRY.names())
    for line in table:
        assert not any(word in line for word in JARGON), line
    # vllm-ascend is absent from this stack: said so, in those words.
    for line in table:
        if line.startswith("vllm-ascend-"):
            assert line.split()[1:] == ["not", "installed", "vllm-ascend", "not", "installed"], line


def test_wide_shows_whole_lines_with_the_targets(listings):
    result = listings["wide"]
    assert result.returncode == 0, result.stderr[-2000:]
    for record in REGISTRY.records():
        line = next(line for line in result.stdout.splitlines() if line.startswith(record.entry.name + " "))
        assert record.entry.target in line and not line.endswith("\u2026"), line
    assert max(len(line) for line in result.stdout.splitlines()) > 120


def test_version():
    result = run_cli("--version", bare=True)
    assert result.returncode == 0 and result.stdout.strip() == f"lmcache-ascend {__version__}"


def _fake_distribution(folder, entry_points: str | None) -> None:
    info = folder / "lmcache_ascend-0.9.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: lmcache_ascend\nVersion: 0.9.0\nSummary: LMCache Ascend NPU plugin\n\n"
    )
    (info / "RECORD").write_text("lmcache_ascend/__init__.py,,\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)


def test_another_distribution_of_the_same_name_is_named_in_one_warning(tmp_path):
    _fake_distribution(tmp_path / "theirs", None)
    env = {"PYTHONPATH": f"{tmp_path / 'theirs'}:{REPO_ROOT}"}
    result = run_cli("--version", env=env, bare=True)
    assert result.returncode == 0
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warning == [
        f"{PROGRAM}: warning: the installed distribution lmcache_ascend 0.9.0 (LMCache Ascend NPU plugin) is not "
        "this overlay (it has no lmcache-ascend-patches command) but provides the same lmcache_ascend package: "
        "LMCache-Ascend, LMCache's NPU plugin, uses the same names; install only one of the two in an environment"
    ], result.stderr
    # Ours (the command among its entry points) is not warned about.
    _fake_distribution(tmp_path / "ours", "[console_scripts]\nlmcache-ascend-patches = lmcache_ascend.patches.__main__:main\n")
    ours = run_cli("--version", env={"PYTHONPATH": f"{tmp_path / 'ours'}:{REPO_ROOT}"}, bare=True)
    assert ours.returncode == 0 and "warning" not in ours.stderr, ours.stderr
