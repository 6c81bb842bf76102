"""``importlib.reload`` of a patch target: the patch goes onto the new objects, once.

The reloaded body makes fresh functions and classes without our changes: the
post-import hook runs again and the patch is applied to them, exactly once (never
a wrapper around our wrapper); a reload that keeps part of the patch is reported
`overridden`.  Objects of the earlier execution keep the patch (modules that bound
them still use them) and are restored by revert too.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from lmcache_ascend.compat import markers
from lmcache_ascend.patches.model import Patch, PatchKind, State
from lmcache_ascend.patches.registry import Registry
from lmcache_ascend import flags as flag_table

DEFAULT_FLAGS = flag_table.validate_all({})


def _wrap_build(ctx):
    values = {}
    for path in ctx.patch.attributes:
        original = ctx.original_function(path)

        def wrapper(self, _original=original):
            return "patched " + _original(self)

        wrapper.__wrapped__ = original
        values[path] = wrapper
    return values


def _patch(attributes: tuple[str, ...]) -> Patch:
    return Patch(
        name="test-reload", target="reload_pkg.target", attributes=attributes, kind=PatchKind.WRAP,
        build=_wrap_build, summary="s", why="w", mirrors="m", delete_when="d",
    )


@pytest.fixture
def target_package(tmp_path, monkeypatch):
    package = tmp_path / "reload_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shared.py").write_text("class Shared:\n    def method(self):\n        return 'shared'\n")
    (package / "target.py").write_text(
        "from reload_pkg.shared import Shared\n\nclass Local:\n    def method(self):\n        return 'local'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("reload_pkg.target", "reload_pkg.shared", "reload_pkg"):
        sys.modules.pop(name, None)


def _marked_layers(value: object) -> int:
    layers = 0
    while value is not None:
        layers += "test-reload" in vars(value).get(markers.MARKER_ATTRIBUTE, ())
        value = getattr(value, "__wrapped__", None)
    return layers


def test_a_reloaded_target_gets_the_patch_again_once(target_package):
    registry = Registry([_patch(("Local.method",))])
    registry.activate(DEFAULT_FLAGS, "test")
    try:
        module = importlib.import_module("reload_pkg.target")
        old_class = module.Local
        assert registry.state("test-reload") is State.APPLIED and module.Local().method() == "patched local"
        for _ in range(2):
            module = importlib.reload(module)
            assert module.Local is not old_class
            assert registry.state("test-reload") is State.APPLIED, registry.record("test-reload").reason
            assert module.Local().method() == "patched local"  # not "patched patched local"
            assert _marked_layers(vars(module.Local)["method"]) == 1
        assert old_class().method() == "patched local"  # whoever bound the old class keeps the patch
    finally:
        registry.deactivate()
    assert registry.state("test-reload") is State.REVERTED
    assert module.Local().method() == "local" and old_class().method() == "local"
    assert _marked_layers(vars(module.Local)["method"]) == _marked_layers(vars(old_class)["method"]) == 0


def test_a_reload_that_keeps_part_of_the_patch_is_overridden_and_fails_strict(target_package, monkeypatch, capsys):
    from lmcache_ascend.patches import __main__ as cli
    from lmcache_ascend.patches import registry as registry_module

    registry = Registry([_patch(("Local.method", "Shared.method"))])
    monkeypatch.setattr(registry_module, "_PROCESS_REGISTRY", registry)
    registry.activate(DEFAULT_FLAGS, "test")
    try:
        module = importlib.import_module("reload_pkg.target")
        assert registry.state("test-reload") is State.APPLIED
        module = importlib.reload(module)  # Local is new, Shared (another module's) is still ours
        assert registry.state("test-reload") is State.OVERRIDDEN
        assert "executed again" in registry.record("test-reload").reason
        assert module.Local().method() == "local" and module.Shared().method() == "patched shared"
        assert cli.main(["--strict"]) == 1
        assert "test-reload: overridden" in capsys.readouterr().out
    finally:
        registry.deactivate()
    assert module.Shared().method() == "shared"


RELOAD_EVERY_APPLIED_PATCH = """
import importlib, json
import lmcache_ascend
from lmcache_ascend.compat import markers
from lmcache_ascend.patches import registry
from lmcache_ascend.patches.model import read_raw, resolve_owner, split_attribute_path

reg = registry.process_registry()
reg.import_targets()

def shape(record):
    module = importlib.import_module(record.patch.target)
    out = {}
    for path in record.patch.attributes:
        owner_path, attribute = split_attribute_path(path)
        value = read_raw(resolve_owner(module, owner_path), attribute)
        if isinstance(value, tuple):
            out[path] = [getattr(item, '__qualname__', repr(item)) for item in value]
            continue
        layers, carrier = 0, value
        for _ in range(32):
            carrier = getattr(carrier, '__func__', None) or getattr(carrier, 'fget', None) or carrier
            layers += record.patch.name in (vars(carrier).get(markers.MARKER_ATTRIBUTE, ()) if hasattr(carrier, '__dict__') else ())
            carrier = getattr(carrier, '__wrapped__', None)
            if carrier is None:
                break
        out[path] = layers
    return out

applied = [r for r in reg.records() if r.state.value == 'applied']
before = {r.patch.name: shape(r) for r in applied}
for target in sorted({r.patch.target for r in applied}):
    importlib.reload(importlib.import_module(target))
after = {r.patch.name: r.state.value for r in reg.records()}
shapes = {r.patch.name: shape(r) for r in applied}
config = importlib.import_module('lmcache.v1.config')
keys = hasattr(config.LMCacheEngineConfig.from_defaults(), 'ascend_blend_holes')
lmcache_ascend.deactivate()
reverted = {r.patch.name: r.state.value for r in applied}
left = {r.patch.name: shape(r) for r in applied}
print('RELOAD=' + json.dumps({'applied': [r.patch.name for r in applied], 'before': before, 'after': after,
      'shapes': shapes, 'keys': keys, 'reverted': reverted, 'left': left, 'no_keys': 'ascend_blend_holes' not in config._CONFIG_DEFINITIONS}))
"""


@pytest.mark.subprocess
def test_reloading_every_applied_target_of_this_stack_reapplies_once(fresh_python):
    result = fresh_python(RELOAD_EVERY_APPLIED_PATCH, env={"LMCACHE_ASCEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RELOAD="))[7:])
    assert "lmcache-config-flag-keys" in report["applied"]
    for name in report["applied"]:
        assert report["after"][name] == "applied", (name, report["after"][name])
        assert report["shapes"][name] == report["before"][name], name  # the same layers: applied once
        assert report["reverted"][name] == "reverted", name
        for path, layers in report["left"][name].items():
            if not isinstance(layers, list):
                assert layers == 0, (name, path)
    assert report["keys"] and report["no_keys"]
