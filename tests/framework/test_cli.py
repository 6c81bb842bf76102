"""`python -m lmcache_ascend.patches` and the installed `lmcache-ascend-patches`: table, JSON schema,
strict mode, show, flags, bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_ascend import CLI_SCRIPT
from lmcache_ascend import flags as flag_table
from lmcache_ascend.patches import registry as registry_module
from tests.conftest import REPO_ROOT

REGISTRY = registry_module.process_registry()
JSON_KEYS = {"schema_version", "mode", "python", "versions", "distributions", "flag_error", "load_errors", "patches", "strict_problems"}
ROW_KEYS = {
    "name", "target", "attributes", "kind", "state", "reason", "untested_target", "error", "requires", "flags",
    "enabled_by", "after", "fingerprints",
}
STATES = {
    "pending", "applied", "skipped-disabled", "skipped-version", "skipped-upstream-has-it", "skipped-host",
    "target-missing",
    "failed", "reverted", "overridden",
}


def run_cli(*args: str, env: dict[str, str] | None = None, bare: bool = False) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_ASCEND_", "VLLM_ASCEND_"))}
    child_env["PYTHONPATH"] = str(REPO_ROOT)
    child_env["LMCACHE_ASCEND_AUTOLOAD"] = "0"
    child_env.update(env or {})
    # -S: no site-packages at all, i.e. a bare interpreter with only the standard library.
    command = [sys.executable, *(["-S"] if bare else []), "-m", "lmcache_ascend.patches", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=child_env, capture_output=True, text=True, timeout=300)


def test_bare_python_lists_every_patch_as_json():
    result = run_cli("--json", bare=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == JSON_KEYS and report["schema_version"] == 1
    assert all(version is None for version in report["versions"].values())
    assert [row["name"] for row in report["patches"]] == REGISTRY.names()
    for row in report["patches"]:
        assert set(row) == ROW_KEYS
        assert row["state"] in {"target-missing", "skipped-disabled"}, row


def test_bare_python_table():
    result = run_cli(bare=True)
    assert result.returncode == 0, result.stderr
    assert "lmcache-ascend patches (no-import mode" in result.stdout
    for name in REGISTRY.names():
        assert name in result.stdout


@pytest.fixture(scope="module")
def import_report():
    result = run_cli("--import", "--json", "--strict")
    return result


def test_import_mode_reports_real_states_and_passes_strict(import_report):
    assert import_report.returncode == 0, import_report.stdout[-3000:] + import_report.stderr[-3000:]
    report = json.loads(import_report.stdout)
    assert report["mode"] == "import" and report["versions"]["vllm"] and report["versions"]["lmcache"]
    assert report["strict_problems"] == []
    for row in report["patches"]:
        assert row["state"] in STATES
        assert row["state"] not in ("pending", "failed"), row


def test_no_import_mode_does_not_import_targets():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['lmcache_ascend.patches', '--json']\n"
        "import io, contextlib\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        runpy.run_module('lmcache_ascend.patches', run_name='__main__')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'lmcache', 'torch'))\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_ASCEND_")}
    env.update(PYTHONPATH=str(REPO_ROOT), LMCACHE_ASCEND_AUTOLOAD="0")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "HEAVY=\n" in result.stdout


BAD_BACKEND = {"LMCACHE_ASCEND_TRANSFER_BACKEND": "cuda-graphs"}
BAD_BACKEND_TEXT = "LMCACHE_ASCEND_TRANSFER_BACKEND='cuda-graphs' is not allowed; allowed: auto | triton | torch"


@pytest.mark.parametrize("args", [(), ("--strict",), ("--json",), ("--import",), ("flags",)], ids=" ".join)
def test_a_bad_flag_is_one_line_and_exit_2(args):
    result = run_cli(*args, env=BAD_BACKEND, bare=args != ("--import",))
    assert result.returncode == 2, (result.stdout, result.stderr)
    problem = [line for line in result.stderr.splitlines() if "LMCACHE_ASCEND" in line]
    assert problem == [f"python -m lmcache_ascend.patches: invalid lmcache-ascend flag: {BAD_BACKEND_TEXT}"]
    assert "Traceback" not in result.stderr


def test_a_config_file_without_pyyaml_is_an_error_not_defaults(tmp_path):
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nascend_transfer_backend: torch\n")
    result = run_cli(env={"LMCACHE_CONFIG_FILE": str(config)}, bare=True)  # -S: no PyYAML
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"LMCACHE_CONFIG_FILE={str(config)!r} is set but PyYAML is not installed" in result.stderr
    assert "pip install 'lmcache-ascend[yaml]'" in result.stderr


def _installed_script() -> Path:
    script = Path(sys.executable).parent / CLI_SCRIPT
    if not script.exists():
        pytest.skip(f"{CLI_SCRIPT} is not installed beside {sys.executable} (scripts/test-env installs the project)")
    return script


def _outside_checkout_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_ASCEND_", "VLLM_ASCEND_", "PYTHONPATH"))}
    env.update(LMCACHE_ASCEND_AUTOLOAD="0", **extra)
    return env


def test_installed_console_script_lists_and_reports_bad_flags(tmp_path):
    script = _installed_script()
    listed = subprocess.run([str(script)], cwd=tmp_path, env=_outside_checkout_env(), capture_output=True, text=True,
                            timeout=300)
    assert listed.returncode == 0, listed.stderr
    for name in REGISTRY.names():
        assert name in listed.stdout
    bad = subprocess.run([str(script), "--strict"], cwd=tmp_path, env=_outside_checkout_env(**BAD_BACKEND),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, (bad.stdout, bad.stderr)
    assert bad.stderr.strip().splitlines() == [f"{CLI_SCRIPT}: invalid lmcache-ascend flag: {BAD_BACKEND_TEXT}"]


def test_an_installed_package_can_not_rewrite_its_catalogue(tmp_path):
    """Regenerating the catalogue is scripts/patch_catalogue.py's, in a checkout: the wheel has no such command."""
    _installed_script()  # the project is installed in this environment
    code = "import lmcache_ascend.patches.catalogue as c, pathlib; print(pathlib.Path(c.__file__).read_bytes().hex())"
    env = _outside_checkout_env()
    before = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    written = subprocess.run([sys.executable, "-m", "lmcache_ascend.patches", "catalogue", "--write"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
    after = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert written.returncode == 2 and "invalid choice: 'catalogue'" in written.stderr
    assert before.returncode == 0 and before.stdout == after.stdout


@pytest.mark.parametrize("name", REGISTRY.names())
def test_show_prints_the_catalogue_entry(name):
    result = run_cli("show", name, bare=True)
    assert result.returncode == 0, result.stderr
    for label in ("patch:", "target:", "changes:", "why:", "mirrors:", "delete when:"):
        assert label in result.stdout
    assert REGISTRY.record(name).patch.target in result.stdout


def test_show_unknown_patch_fails():
    result = run_cli("show", "no-such-patch", bare=True)
    assert result.returncode == 2 and "no patch named 'no-such-patch'" in result.stderr


def test_flag_table_in_readme_is_current():
    result = subprocess.run([sys.executable, "-S", str(REPO_ROOT / "scripts" / "patch_catalogue.py"), "flags-table"],
                            env={**os.environ, "LMCACHE_ASCEND_AUTOLOAD": "0"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    readme = (REPO_ROOT / "README.md").read_text()
    for line in result.stdout.strip().splitlines():
        assert line in readme, f"README flag table is stale (scripts/patch_catalogue.py flags-table): {line}"
    assert len(result.stdout.strip().splitlines()) == len(flag_table.FLAGS) + 2


def test_readme_lists_every_patch():
    readme = (REPO_ROOT / "README.md").read_text()
    for record in REGISTRY.records():
        assert f"| `{record.patch.name}` | {record.patch.summary} |" in readme, f"README lacks {record.patch.name}"
