"""The framework contract, checked on every patch the catalogue declares, on this stack.

For each real patch: it applies (or is skipped for a stated reason, never
failed), its targets are ones we have tested (fingerprints), revert restores the
raw attribute tables object for object, revert twice is a no-op, apply after
revert works again, a failure injected while installing leaves the target
identical, and disabling it by name keeps it out.
"""

from __future__ import annotations

import importlib

import pytest

from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat.source import module_is_locatable
from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.patches import install as install_module
from lmcache_ascend.patches import registry as registry_module
from lmcache_ascend.patches.model import State, resolve_owner, split_attribute_path
from tests.patching import apply_now

REGISTRY = registry_module.process_registry()
NAMES = REGISTRY.names()
OK_STATES = {State.APPLIED, State.SKIPPED_UPSTREAM, State.SKIPPED_VERSION, State.SKIPPED_HOST, State.TARGET_MISSING}


def flags_enabling(name: str) -> dict[str, object]:
    """Default flags, plus the patch's own enabling flag (default-off features are tested too)."""
    values = flag_table.validate_all({})
    enabled_by = REGISTRY.record(name).patch.enabled_by
    if enabled_by:
        values[enabled_by] = True
    return values


def owners_snapshot(name: str) -> dict[str, object] | None:
    """Raw attribute tables of every owner the patch touches, or None if the target won't import."""
    patch = REGISTRY.record(name).patch
    try:
        module = importlib.import_module(patch.target)
    except Exception:
        return None
    snapshot: dict[str, object] = {}
    for path in patch.attributes:
        owner_path, _ = split_attribute_path(path)
        try:
            owner = resolve_owner(module, owner_path)
        except AttributeError:
            return None
        table = dict(vars(owner))
        if isinstance(owner, type):
            table["__bases__"] = owner.__bases__
        snapshot[owner_path or "<module>"] = table
    return snapshot


def assert_same_snapshot(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for owner, table in before.items():
        assert table.keys() == after[owner].keys(), f"{owner}: attributes added or removed"
        for key, value in table.items():
            if key == "__bases__":
                assert value == after[owner][key], f"{owner}.__bases__ changed"
            else:
                assert value is after[owner][key], f"{owner}.{key} changed"


def fake_served_host(monkeypatch) -> None:
    """An Ascend NPU host without CUDA: only the hardware answers are faked."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "npu", type("FakeNpu", (), {"is_available": staticmethod(lambda: True)}),
                        raising=False)


def test_catalogue_loads_without_errors():
    assert REGISTRY.load_errors == {}


@pytest.fixture(autouse=True)
def _leave_everything_reverted():
    yield
    REGISTRY.revert_all()


@pytest.mark.parametrize("name", NAMES)
def test_patch_contract(name, monkeypatch):
    record = REGISTRY.record(name)
    before = owners_snapshot(name)
    state = apply_now(REGISTRY, name, flags_enabling(name))
    assert state in OK_STATES, f"{name}: {state.value}: {record.reason}\n{record.error or ''}"
    if state is State.TARGET_MISSING:
        # Only acceptable where the target's package is genuinely absent (vllm-ascend here), or a
        # library the target imports that the patch requires by name (LMCache 0.4.x's MP server
        # requires cupy; LMCache's Redis connector, redis-py).
        missing = [dist for dist in record.patch.requires if installed_version(dist) is None]
        absent = missing and not module_is_locatable(record.patch.target.partition(".")[0])
        own_package = record.patch.target.partition(".")[0].replace("_", "-")
        assert absent or any(dist != own_package for dist in missing), f"{name}: {record.reason}"
        return
    if state is State.SKIPPED_HOST:
        # Not this kind of machine: untouched here; then the whole contract on the host it serves (faked).
        assert_same_snapshot(before, owners_snapshot(name))
        fake_served_host(monkeypatch)
        assert REGISTRY.record(name).patch.host() is None
        state = apply_now(REGISTRY, name, flags_enabling(name))
        assert state is State.APPLIED, f"{name}: {state.value}: {record.reason}\n{record.error or ''}"
    if state is not State.APPLIED:  # skipped: the target must be exactly as it was
        if before is not None:
            assert_same_snapshot(before, owners_snapshot(name))
        return

    assert before is not None
    assert not record.untested, f"{name}: untested target fingerprints {record.fingerprints}"
    # Revert, revert twice, re-apply, revert.
    assert REGISTRY.revert(name) is State.REVERTED
    assert_same_snapshot(before, owners_snapshot(name))
    assert REGISTRY.revert(name) is State.REVERTED
    assert_same_snapshot(before, owners_snapshot(name))
    assert apply_now(REGISTRY, name, flags_enabling(name)) is State.APPLIED
    assert REGISTRY.revert(name) is State.REVERTED
    assert_same_snapshot(before, owners_snapshot(name))

    # A failure while installing the last attribute leaves everything as it was.
    real_setattr = setattr
    calls: list[str] = []
    last = len(record.patch.attributes)

    def failing_last_setattr(owner, attribute, value):
        calls.append(attribute)
        if len(calls) == last:
            raise RuntimeError("injected install failure")
        real_setattr(owner, attribute, value)

    with pytest.MonkeyPatch.context() as injected:
        injected.setattr(install_module, "setattr", failing_last_setattr, raising=False)
        assert apply_now(REGISTRY, name, flags_enabling(name)) is State.FAILED
    assert_same_snapshot(before, owners_snapshot(name))

    # Disabled by name: stays out.
    values = flags_enabling(name)
    values["LMCACHE_ASCEND_DISABLED_PATCHES"] = (name,)
    assert apply_now(REGISTRY, name, values) is State.SKIPPED_DISABLED
    assert_same_snapshot(before, owners_snapshot(name))


@pytest.mark.parametrize("name", NAMES)
def test_catalogue_entry_is_complete(name):
    patch = REGISTRY.record(name).patch
    for field in ("summary", "why", "mirrors", "delete_when"):
        assert len(getattr(patch, field).strip()) >= 10, f"{name}: catalogue field {field} is empty"
    for flag in patch.flags + ((patch.enabled_by,) if patch.enabled_by else ()):
        flag_table.get_flag(flag)  # every flag a patch reads is in the one table
    assert patch.requires, f"{name}: no version requirement"
