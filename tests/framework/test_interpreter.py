"""The CPython import internals `lmcache_ascend.compat.interpreter` reads, checked on the
running interpreter: a Python release that changes one fails here, by name."""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading

from lmcache_ascend.compat import interpreter


def _module_file(tmp_path, monkeypatch, name: str, *lines: str) -> None:
    """A module `name` of `lines` (after interpreter's import) importable from `tmp_path`."""
    monkeypatch.syspath_prepend(str(tmp_path))
    header = ("import sys", "from lmcache_ascend.compat import interpreter")
    (tmp_path / f"{name}.py").write_text("\n".join((*header, *lines, "")))


def test_a_module_is_initializing_while_its_body_runs_and_not_after(tmp_path, monkeypatch):
    _module_file(
        tmp_path, monkeypatch, "interp_body_probe", "DURING = interpreter.is_initializing(sys.modules[__name__])"
    )
    module = importlib.import_module("interp_body_probe")
    try:
        assert module.DURING is True
        assert interpreter.is_initializing(module) is False
    finally:
        sys.modules.pop("interp_body_probe")


def test_waiting_for_another_threads_import_returns_once_its_body_ends(tmp_path, monkeypatch):
    _module_file(
        tmp_path, monkeypatch, "interp_slow_probe",
        "gate = sys.modules['interp_gate']",
        "SELF_WAIT = interpreter.wait_for_import_elsewhere(__name__)",  # this thread's own import: no wait
        "gate.started.set()", "gate.release.wait(10)", "DONE = True",
    )
    gate = type(sys)("interp_gate")
    gate.started, gate.release = threading.Event(), threading.Event()
    monkeypatch.setitem(sys.modules, "interp_gate", gate)
    importer = threading.Thread(target=importlib.import_module, args=("interp_slow_probe",))
    importer.start()
    try:
        assert gate.started.wait(10)
        module = sys.modules["interp_slow_probe"]
        assert interpreter.is_initializing(module)
        waited = []
        waiter = threading.Thread(
            target=lambda: waited.append(interpreter.wait_for_import_elsewhere("interp_slow_probe"))
        )
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "returned while the other thread's body was still running"
        gate.release.set()
        waiter.join(10)
        assert waited == [True]
        assert module.DONE and module.SELF_WAIT is False and not interpreter.is_initializing(module)
    finally:
        gate.release.set()
        importer.join(10)
        sys.modules.pop("interp_slow_probe", None)


def test_runpy_is_seen_importing_the_parents_of_the_module_it_runs(tmp_path):
    package = tmp_path / "interp_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from lmcache_ascend.compat import interpreter\n"
        "print('RUN', interpreter.runpy_is_starting(frozenset({'interp_pkg.tool'})),"
        " interpreter.runpy_is_starting(frozenset({'interp_pkg.other'})))\n"
    )
    (package / "tool.py").write_text("")
    from tests.conftest import REPO_ROOT

    result = subprocess.run(
        [sys.executable, "-m", "interp_pkg.tool"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": f"{tmp_path}:{REPO_ROOT}", "LMCACHE_ASCEND_AUTOLOAD": "0"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "RUN True False" in result.stdout
