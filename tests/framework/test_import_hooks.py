"""The post-import hook mechanism (standard library only)."""

from __future__ import annotations

import inspect
import sys

from lmcache_ascend.compat import import_hooks


def _make_package(tmp_path, name: str) -> None:
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "target.py").write_text("EXECUTED = True\n\ndef answer():\n    return 42\n")


def test_hook_runs_after_the_module_executed(tmp_path, monkeypatch):
    _make_package(tmp_path, "hook_pkg_a")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    import_hooks.register_post_import_hook("hook_pkg_a.target", lambda module: seen.append(module.EXECUTED))
    assert seen == [] and "hook_pkg_a.target" in sorted(import_hooks._pending)
    import hook_pkg_a.target as target

    assert seen == [True]
    assert "hook_pkg_a.target" not in sorted(import_hooks._pending)
    # The wrapped loader still serves source (fingerprints and tracebacks need it).
    assert "return 42" in inspect.getsource(target.answer)
    for name in ("hook_pkg_a.target", "hook_pkg_a"):
        sys.modules.pop(name)


def test_hook_for_an_imported_module_runs_at_once(tmp_path, monkeypatch):
    _make_package(tmp_path, "hook_pkg_b")
    monkeypatch.syspath_prepend(str(tmp_path))
    import hook_pkg_b.target  # noqa: F401

    seen = []
    import_hooks.register_post_import_hook("hook_pkg_b.target", lambda module: seen.append(module.__name__))
    assert seen == ["hook_pkg_b.target"]
    for name in ("hook_pkg_b.target", "hook_pkg_b"):
        sys.modules.pop(name)


def test_unrelated_imports_are_not_touched(tmp_path, monkeypatch):
    _make_package(tmp_path, "hook_pkg_c")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_hooks.register_post_import_hook("hook_pkg_c.other", lambda module: None)
    import hook_pkg_c.target as target

    assert not isinstance(target.__spec__.loader, import_hooks._HookedLoader)
    for name in ("hook_pkg_c.target", "hook_pkg_c"):
        sys.modules.pop(name)
    import_hooks._pending.pop("hook_pkg_c.other", None)
