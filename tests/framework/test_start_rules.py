"""How the ways in that nobody calls by hand (the import, the .pth start-up hook, vLLM's plugin)
treat a bad flag and an unreadable LMCache configuration file, and when an import is the CLI's.

- A process that uses LMCache never runs without the overlay: a bad flag stops it at the first
  import of LMCache (or of vLLM's LMCache connector), with the error naming the flag, its value
  and what is allowed, also behind vLLM's plugin loader, which swallows errors raised while it
  imports a plugin.
- A process that never uses LMCache is not stopped: one warning line.
- ``LMCACHE_CONFIG_FILE`` is LMCache's: a file that can't be read leaves the overlay active
  without it and stops the process only where LMCache is used.
- ``python -m lmcache_ascend.patches`` does not activate; ``python -m other`` whose packages
  import lmcache_ascend does.

Every case runs in a fresh interpreter of this stack, without starting an engine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, run_fresh_python

pytestmark = pytest.mark.subprocess

BAD = {"LMCACHE_ASCEND_BUNDLE_MULTI_SPEC": "2"}
BAD_TEXT = "invalid lmcache-ascend flag: LMCACHE_ASCEND_BUNDLE_MULTI_SPEC='2' is not a boolean; allowed: 1/0, true/false, yes/no, on/off"
WARNING = f"lmcache-ascend: not active in this process: {BAD_TEXT} (where this process uses LMCache, it stops with this error)"
LOAD_PLUGINS = "from vllm.plugins import load_general_plugins\nload_general_plugins()\nprint('PLUGINS LOADED', flush=True)\n"
VLLM_LMCACHE_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
ACTIVATED_BY = (
    "from lmcache_ascend.patches import registry\n"
    "print('ACTIVATED_BY', registry.process_registry().activated_by, flush=True)\n"
)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_behind_vllms_plugin_loader_a_bad_flag_stops_the_first_use_of_lmcache():
    result = run_fresh_python(LOAD_PLUGINS + f"import {VLLM_LMCACHE_CONNECTOR}\nprint('CONNECTOR IMPORTED')\n",
                              env={"LMCACHE_ASCEND_AUTOLOAD": "0", **BAD})
    assert result.returncode != 0 and "PLUGINS LOADED" in result.stdout and "CONNECTOR IMPORTED" not in result.stdout
    assert last_line(result) == f"lmcache_ascend.flags.FlagError: {BAD_TEXT}"
    assert "Failed to load plugin" not in result.stderr
    assert result.stderr.count(WARNING) == 1, result.stderr[-3000:]


def test_the_plugin_function_raises_where_lmcache_is_already_in_use():
    """vLLM calls the entry point's function outside its try: the error is not swallowed there."""
    result = run_fresh_python("import lmcache\n" + LOAD_PLUGINS, env={"LMCACHE_ASCEND_AUTOLOAD": "0", **BAD})
    assert result.returncode != 0 and "PLUGINS LOADED" not in result.stdout
    assert last_line(result) == f"lmcache_ascend.flags.FlagError: {BAD_TEXT}"
    assert "Failed to load plugin" not in result.stderr and "in register" in result.stderr


@pytest.mark.parametrize("autoload", ["0", "1"])
def test_a_process_that_never_uses_lmcache_is_not_stopped(autoload):
    result = run_fresh_python(LOAD_PLUGINS + "import vllm.v1.core.sched.scheduler\n" + ACTIVATED_BY,
                              env={"LMCACHE_ASCEND_AUTOLOAD": autoload, **BAD})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ACTIVATED_BY []" in result.stdout  # the overlay is off, and said so once
    assert result.stderr.count(WARNING) == 1, result.stderr[-3000:]


def test_the_start_up_hook_stops_lmcaches_own_import():
    result = run_fresh_python("import lmcache.v1.config\nprint('IMPORTED')\n", env={"LMCACHE_ASCEND_AUTOLOAD": "1", **BAD})
    assert result.returncode != 0 and "IMPORTED" not in result.stdout
    assert last_line(result) == f"lmcache_ascend.flags.FlagError: {BAD_TEXT}"
    assert "autoload did not activate" not in result.stderr


def test_an_unreadable_lmcache_config_file_stops_only_lmcache(tmp_path):
    missing = str(tmp_path / "stale.yaml")
    text = f"LMCache's configuration file LMCACHE_CONFIG_FILE={missing!r} can't be read: [Errno 2] No such file or directory: {missing!r}"
    env = {"LMCACHE_ASCEND_AUTOLOAD": "1", "LMCACHE_CONFIG_FILE": missing}
    result = run_fresh_python(LOAD_PLUGINS + "import vllm.v1.core.kv_cache_utils\n" + ACTIVATED_BY
                              + "import lmcache.v1.config\nprint('IMPORTED')\n", env=env)
    assert "PLUGINS LOADED" in result.stdout and "IMPORTED" not in result.stdout
    # The overlay itself is active (the file only holds values for LMCache-facing patches).
    assert "ACTIVATED_BY ['import', 'autoload', 'vllm-plugin']" in result.stdout, result.stdout
    assert result.stderr.count(f"lmcache-ascend: {text} (where this process uses LMCache") == 1, result.stderr[-3000:]
    assert last_line(result) == f"lmcache_ascend.flags.ConfigFileError: {text}"
    assert "invalid lmcache-ascend flag" not in result.stderr
    control = run_fresh_python(LOAD_PLUGINS + "import vllm.v1.core.kv_cache_utils\nprint('DONE')\n", env=env)
    assert control.returncode == 0 and "DONE" in control.stdout, control.stderr[-3000:]


def test_explicit_activation_still_raises_at_once():
    result = run_fresh_python("import lmcache_ascend\nprint('IMPORTED', flush=True)\nlmcache_ascend.activate()\n",
                              env={"LMCACHE_ASCEND_AUTOLOAD": "0", **BAD})
    assert result.returncode != 0 and "IMPORTED" in result.stdout
    assert last_line(result) == f"lmcache_ascend.flags.FlagError: {BAD_TEXT}"


def _run_module(module: str, folder, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_ASCEND_", "VLLM_ASCEND_"))}
    env.update(PYTHONPATH=f"{folder}:{REPO_ROOT}", LMCACHE_ASCEND_AUTOLOAD="0")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=240)


def test_python_m_of_another_module_whose_package_imports_the_overlay_activates(tmp_path):
    """While runpy imports the parent packages of the module it runs, sys.argv[0] is "-m"."""
    package = tmp_path / "user_app"
    package.mkdir()
    (package / "__init__.py").write_text("import lmcache_ascend\n")
    (package / "serve.py").write_text(ACTIVATED_BY)
    result = _run_module("user_app.serve", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ACTIVATED_BY ['import']" in result.stdout, result.stdout


def test_python_m_of_the_command_does_not_activate(tmp_path):
    # Reports, once the command is done, whether anything activated the overlay.
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        "def _report():\n"
        "    registry = sys.modules.get('lmcache_ascend.patches.registry')\n"
        "    print('ACTIVATED_BY', registry.process_registry().activated_by if registry else None, file=sys.stderr)\n"
        "atexit.register(_report)\n"
    )
    for module in ("lmcache_ascend.patches", "lmcache_ascend.patches.__main__"):
        result = _run_module(module, tmp_path, "--json")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "ACTIVATED_BY []" in result.stderr, result.stderr[-3000:]
