"""The catalogue and the lazily imported declarations.

Activation works from `lmcache_ascend.patches.catalogue` alone: it imports no patch
declaration and none of the logic they import; a declaration is imported with its
target.  The catalogue is derived from the declarations, so these tests check that
it is exactly what they generate, that a stale entry is refused (never applied
with facts the declaration no longer states), and that the decisions activation
postpones come out as the eager ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib

import pytest

from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.patches import catalogue
from lmcache_ascend.patches import registry as registry_module
from lmcache_ascend.patches.model import CatalogueEntry, Patch, PatchKind, State
from lmcache_ascend.patches.records import declared_in
from lmcache_ascend.patches.registry import DeclarationError, Registry
from tests.conftest import REPO_ROOT
from tests.patching import apply_now

DEFAULT_FLAGS = flag_table.validate_all({})
QUEUE_ENTRY = next(entry for entry in catalogue.CATALOGUE if entry.name == "vllm-free-queue-prepend")


def _maintainer_tool():
    spec = importlib.util.spec_from_file_location("patch_catalogue", REPO_ROOT / "scripts" / "patch_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _maintainer_tool()


def test_the_catalogue_file_is_what_the_declarations_generate():
    written = pathlib.Path(catalogue.__file__).read_text()
    assert written == tool.catalogue_source(), (
        "lmcache_ascend/patches/catalogue.py is out of date: run python scripts/patch_catalogue.py write"
    )
    assert tool.main(["check"]) == 0


def test_every_entry_equals_its_declaration_and_every_declaration_has_one():
    declared = {
        patch.name: CatalogueEntry.of(patch, module_name)
        for module_name in tool.declaration_modules()
        for patch in declared_in(module_name)
    }
    listed = {entry.name: entry for entry in catalogue.CATALOGUE}
    assert list(listed) == [entry.name for entry in catalogue.CATALOGUE], "a name is listed twice"
    assert listed.keys() == declared.keys()
    for name, entry in listed.items():
        assert entry == declared[name], f"{name}: catalogue {entry!r} != declaration {declared[name]!r}"
    assert catalogue.PATCH_MODULES == tuple(dict.fromkeys(tool.declaration_modules()))


def test_entries_compare_every_field():
    fields = dict(module=QUEUE_ENTRY.module, target=QUEUE_ENTRY.target, requires=QUEUE_ENTRY.requires,
                  flags=QUEUE_ENTRY.flags, enabled_by=QUEUE_ENTRY.enabled_by, after=QUEUE_ENTRY.after)
    assert CatalogueEntry(QUEUE_ENTRY.name, **fields) == QUEUE_ENTRY
    changes = dict(module="x.y", target="x.y", requires={"vllm": "<0.1"}, flags=("LMCACHE_ASCEND_BLEND_HOLES",),
                   enabled_by="LMCACHE_ASCEND_BLEND_HOLES", after=("other",))
    assert set(changes) | {"name"} == set(CatalogueEntry.__slots__)
    assert CatalogueEntry("other", **fields) != QUEUE_ENTRY
    for field, value in changes.items():
        assert CatalogueEntry(QUEUE_ENTRY.name, **{**fields, field: value}) != QUEUE_ENTRY, field


def _queue_snapshot() -> dict[str, object]:
    queue = importlib.import_module(QUEUE_ENTRY.target).FreeKVCacheBlockQueue
    return dict(vars(queue))


@pytest.mark.parametrize(
    "entry, reason_part",
    [
        (CatalogueEntry(QUEUE_ENTRY.name, module=QUEUE_ENTRY.module, target=QUEUE_ENTRY.target,
                        requires={"vllm": ">=0.1"}), "out of date"),
        (CatalogueEntry("no-such-patch", module=QUEUE_ENTRY.module, target=QUEUE_ENTRY.target,
                        requires=QUEUE_ENTRY.requires), "declares no patch 'no-such-patch'"),
        (CatalogueEntry("test-missing-module", module="lmcache_ascend.patches.vllm.no_such_module",
                        target=QUEUE_ENTRY.target, requires=QUEUE_ENTRY.requires), "ModuleNotFoundError"),
    ],
    ids=["stale-entry", "unknown-name", "missing-module"],
)
def test_a_declaration_that_does_not_match_its_entry_fails_and_touches_nothing(entry, reason_part):
    registry = Registry([entry])
    before = _queue_snapshot()
    registry.activate(DEFAULT_FLAGS, "test")  # the target is imported: the hook fires at once
    try:
        record = registry.record(entry.name)
        assert record.state is State.FAILED
        assert "declaration did not load" in record.reason and reason_part in record.reason
        assert list(registry.load_errors) == [entry.module]
        assert reason_part in registry.load_errors[entry.module]
        with pytest.raises(DeclarationError, match=reason_part.split("'")[0]):
            record.patch
        after = _queue_snapshot()
        assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
        row = record.as_json()
        assert row["state"] == "failed" and row["target"] == entry.target and row["attributes"] == []
    finally:
        registry.deactivate()


def test_the_catalogue_registry_loads_a_declaration_only_when_asked():
    registry = Registry(catalogue.CATALOGUE)
    record = registry.record(QUEUE_ENTRY.name)
    assert record._patch is None
    patch = record.patch
    assert isinstance(patch, Patch) and CatalogueEntry.of(patch, QUEUE_ENTRY.module) == QUEUE_ENTRY
    assert registry.record("lmcache-stable-token-hash")._patch is None
    assert registry.load_errors == {}  # asking for them loads every declaration
    assert all(r._patch is not None for r in registry.records())


def _patch_on_a_missing_module(requires: dict[str, str]) -> Patch:
    return Patch(
        name="test-missing-module", target="vllm.v1.core.no_such_module", attributes=("f",), kind=PatchKind.REPLACE,
        build=lambda ctx: {"f": lambda: None}, summary="a patch whose target is absent (test only)",
        why="proves the postponed decision", mirrors="nothing upstream", delete_when="never: test fixture",
        requires=requires,
    )


@pytest.mark.parametrize(
    "requires, state, reason_part, distribution_installed",
    [
        ({"vllm": "<0.1"}, State.SKIPPED_VERSION, "is outside <0.1", True),
        ({"vllm": ">=0.1"}, State.TARGET_MISSING, "module vllm.v1.core.no_such_module not found", True),
        ({"vllm": ">=0.1", "no-such-distribution": ">=1"}, State.TARGET_MISSING, "not found", False),
    ],
)
def test_a_missing_target_is_decided_when_first_read_as_it_would_be_at_once(
    requires, state, reason_part, distribution_installed
):
    postponed = Registry([_patch_on_a_missing_module(requires)])
    postponed.activate(DEFAULT_FLAGS, "test")
    record = postponed.record("test-missing-module")
    assert record._postponed is not None  # activation did not look the versions up
    assert record.state is state and reason_part in record.reason
    assert record.distribution_installed is distribution_installed
    assert record._postponed is None
    eager = Registry([_patch_on_a_missing_module(requires)])
    assert apply_now(eager, "test-missing-module", DEFAULT_FLAGS) is state
    eager_record = eager.record("test-missing-module")
    assert (eager_record.reason, eager_record.distribution_installed) == (record.reason, distribution_installed)
    assert "test-missing-module" not in postponed._hooked


ACTIVATION_IMPORTS = """
import json, sys
import lmcache_ascend
before = sorted(name for name in sys.modules if name.startswith('lmcache_ascend'))
import {target}
from lmcache_ascend.patches import catalogue, registry
after = sorted(name for name in sys.modules if name.startswith('lmcache_ascend'))
hooked = sorted({{entry.module for entry in catalogue.CATALOGUE if entry.target in sys.modules}})
print('IMPORTS=' + json.dumps({{'before': before, 'after': after, 'hooked': hooked,
      'state': registry.process_registry().state({name!r}).value}}))
"""

# What activation may import: the framework, never a declaration or the logic behind one (the
# spec-kind table is a leaf of data the flag table takes its allowed state spec names from).
ACTIVATION_MODULES = {
    "lmcache_ascend", "lmcache_ascend.flags", "lmcache_ascend.compat", "lmcache_ascend.compat.import_hooks",
    "lmcache_ascend.compat.interpreter", "lmcache_ascend.compat.source", "lmcache_ascend.patches",
    "lmcache_ascend.patches.model", "lmcache_ascend.patches.registry", "lmcache_ascend.patches.records",
    "lmcache_ascend.patches.gates", "lmcache_ascend.patches.install", "lmcache_ascend.patches.catalogue",
    "lmcache_ascend.multigroup", "lmcache_ascend.multigroup.spec_kinds",
}


@pytest.mark.subprocess
def test_activation_imports_no_declaration_and_a_target_imports_its_own(fresh_python):
    code = ACTIVATION_IMPORTS.format(target=QUEUE_ENTRY.target, name=QUEUE_ENTRY.name)
    result = fresh_python(code, env={"LMCACHE_ASCEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("IMPORTS="))[8:])
    assert set(report["before"]) <= ACTIVATION_MODULES, set(report["before"]) - ACTIVATION_MODULES
    # Exactly the declarations of the patches whose targets are imported now (that one, and any
    # target it imports itself).
    declarations = {name for name in report["after"] if name.startswith(tool.PATCH_PACKAGES)} - set(tool.PATCH_PACKAGES)
    assert QUEUE_ENTRY.module in declarations
    assert declarations == set(report["hooked"])
    expected = State.APPLIED if installed_version("vllm") else State.TARGET_MISSING
    if "prepend_n" in vars(importlib.import_module(QUEUE_ENTRY.target).FreeKVCacheBlockQueue):
        expected = State.SKIPPED_UPSTREAM  # vLLM >= 0.23 has it
    assert report["state"] == expected.value
