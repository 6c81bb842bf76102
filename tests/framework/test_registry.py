"""The registry's contract, proven with test-only patch declarations on real upstream targets.

Each test builds its own `Registry` so the process registry (the catalogue's
patches) stays untouched.  The targets are vLLM's real free-block queue and
LMCache's real engine class on whichever stack runs the suite.
"""

from __future__ import annotations

import compileall
import importlib
import sys
import textwrap

import pytest

from lmcache_ascend import flags as flag_table
from lmcache_ascend.compat import markers
from lmcache_ascend.compat.source import fingerprint
from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.patches import MISSING, Patch, PatchKind, State, UpstreamGuard
from lmcache_ascend.patches import install as install_module
from lmcache_ascend.patches import registry as registry_module
from lmcache_ascend.patches.registry import Registry
from tests.patching import apply_now

TARGET = "vllm.v1.core.kv_cache_utils"
kv_cache_utils = importlib.import_module(TARGET)
Queue = kv_cache_utils.FreeKVCacheBlockQueue
STACK_HAS_PREPEND_N = "prepend_n" in vars(Queue)  # vLLM >= 0.23 (stack B)

DEFAULT_FLAGS = flag_table.validate_all({})


def flags_with(**overrides: object) -> dict[str, object]:
    values = dict(DEFAULT_FLAGS)
    values.update(overrides)
    return values


def snapshot(owner: object) -> dict[str, object]:
    """The raw attribute table of `owner`, plus its bases for classes."""
    state = dict(vars(owner))
    if isinstance(owner, type):
        state["__bases__"] = owner.__bases__
    return state


def assert_identical(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key == "__bases__":
            assert before[key] == after[key]
        else:
            assert before[key] is after[key], f"{key} changed"


def counting_wrap_build(calls: list[str]):
    def build(ctx):
        values = {}
        for path in ("FreeKVCacheBlockQueue.popleft", "FreeKVCacheBlockQueue.append"):
            original = ctx.original_function(path)

            def wrapper(self, *args, _original=original, _path=path, **kwargs):
                calls.append(_path)
                return _original(self, *args, **kwargs)

            wrapper.__wrapped__ = original
            values[path] = wrapper
        return values

    return build


def make_patch(**overrides: object) -> Patch:
    fields: dict[str, object] = dict(
        name="test-queue-counting",
        target=TARGET,
        attributes=("FreeKVCacheBlockQueue.popleft", "FreeKVCacheBlockQueue.append"),
        kind=PatchKind.WRAP,
        build=counting_wrap_build([]),
        summary="counts queue operations (test only)",
        why="proves the framework on a real target",
        mirrors="nothing upstream",
        delete_when="never: test fixture",
        requires={"vllm": ">=0.18"},
    )
    fields.update(overrides)
    return Patch(**fields)


def make_blocks(count: int) -> list:
    return [kv_cache_utils.KVCacheBlock(block_id) for block_id in range(count)]


# ---------------------------------------------------------------- apply / revert


def test_wrap_applies_marks_and_calls_through():
    calls: list[str] = []
    registry = Registry([make_patch(build=counting_wrap_build(calls))])
    before = snapshot(Queue)
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.APPLIED
    try:
        assert "test-queue-counting" in markers.patch_names_on(vars(Queue)["popleft"])
        queue = Queue(make_blocks(4))
        first = queue.popleft()
        queue.append(first)
        assert first.block_id == 0
        assert calls == ["FreeKVCacheBlockQueue.popleft", "FreeKVCacheBlockQueue.append"]
        assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 3, 0]
    finally:
        assert registry.revert("test-queue-counting") is State.REVERTED
    assert_identical(before, snapshot(Queue))
    # Revert twice is a no-op.
    assert registry.revert("test-queue-counting") is State.REVERTED
    assert_identical(before, snapshot(Queue))


def test_apply_is_idempotent_and_never_double_wraps():
    calls: list[str] = []
    registry = Registry([make_patch(build=counting_wrap_build(calls))])
    apply_now(registry, "test-queue-counting", DEFAULT_FLAGS)
    installed = vars(Queue)["popleft"]
    try:
        apply_now(registry, "test-queue-counting", DEFAULT_FLAGS)
        registry.apply_to_module("test-queue-counting", kv_cache_utils)
        assert vars(Queue)["popleft"] is installed
        # A second registry (a second copy of the package) sees the marks and stays out.
        other = Registry([make_patch(build=counting_wrap_build(calls))])
        assert apply_now(other, "test-queue-counting", DEFAULT_FLAGS) is State.APPLIED
        assert "already applied" in other.record("test-queue-counting").reason
        assert vars(Queue)["popleft"] is installed
        other.revert("test-queue-counting")  # nothing of the other copy's to undo
        assert vars(Queue)["popleft"] is installed
        Queue(make_blocks(2)).popleft()
        assert calls == ["FreeKVCacheBlockQueue.popleft"]
    finally:
        registry.revert("test-queue-counting")


def test_activate_twice_registers_one_hook_and_applies_on_import(monkeypatch):
    registered: list[str] = []  # the targets of the registry's own hooks (re-activation applies without one)

    def register(target, hook):
        if getattr(hook, "__qualname__", "").startswith("lmcache_ascend["):
            registered.append(target)
        hook(sys.modules[target])

    monkeypatch.setattr(registry_module.import_hooks, "register_post_import_hook", register)
    registry = Registry([make_patch()])
    registry.activate(DEFAULT_FLAGS, "test")
    registry.activate(DEFAULT_FLAGS, "test again")
    try:
        assert registered == [TARGET]
        assert registry.state("test-queue-counting") is State.APPLIED
        assert registry.activated_by == ["test", "test again"]
    finally:
        registry.deactivate()
    assert registry.state("test-queue-counting") is State.REVERTED
    # Re-activation after deactivate() applies again without a second hook.
    registry.activate(DEFAULT_FLAGS, "third")
    try:
        assert registered == [TARGET]
        assert registry.state("test-queue-counting") is State.APPLIED
    finally:
        registry.deactivate()


def test_build_failure_leaves_target_identical():
    def broken_build(ctx):
        raise RuntimeError("boom in build")

    registry = Registry([make_patch(build=broken_build)])
    before = snapshot(Queue)
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.FAILED
    record = registry.record("test-queue-counting")
    assert "boom in build" in record.reason and record.error
    assert_identical(before, snapshot(Queue))


def test_install_failure_halfway_rolls_back(monkeypatch):
    """The second setattr fails: the first must be undone, the target left as it was."""
    real_setattr = setattr
    seen: list[str] = []

    def failing_second_setattr(owner, name, value):
        seen.append(name)
        if len(seen) == 2:
            raise TypeError("injected failure on the second attribute")
        real_setattr(owner, name, value)

    monkeypatch.setattr(install_module, "setattr", failing_second_setattr, raising=False)
    registry = Registry([make_patch()])
    before = snapshot(Queue)
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.FAILED
    monkeypatch.undo()
    assert seen[:2] == ["popleft", "append"]
    assert "injected failure" in registry.record("test-queue-counting").reason
    assert_identical(before, snapshot(Queue))


def test_build_must_return_exactly_the_declared_attributes():
    registry = Registry([make_patch(build=lambda ctx: {"FreeKVCacheBlockQueue.popleft": lambda self: None})])
    before = snapshot(Queue)
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.FAILED
    assert "expected exactly" in registry.record("test-queue-counting").reason
    assert_identical(before, snapshot(Queue))


def test_override_is_detected_and_revert_restores_only_what_is_still_ours():
    registry = Registry([make_patch()])
    before = snapshot(Queue)
    apply_now(registry, "test-queue-counting", DEFAULT_FLAGS)
    ours = vars(Queue)["popleft"]

    def newcomer(self):
        return ours(self)

    Queue.popleft = newcomer  # someone else wraps our wrapper after we applied
    try:
        assert registry.state("test-queue-counting") is State.OVERRIDDEN
        assert registry.revert("test-queue-counting") is State.OVERRIDDEN
        assert vars(Queue)["popleft"] is newcomer  # theirs is left as found
        assert vars(Queue)["append"] is before["append"]  # ours is undone
        assert registry.revert("test-queue-counting") is State.OVERRIDDEN  # twice: no-op
    finally:
        Queue.popleft = before["popleft"]
    assert_identical(before, snapshot(Queue))


# ---------------------------------------------------------------- each skip reason


@pytest.mark.parametrize(
    "flag_overrides, patch_overrides, reason_part",
    [
        ({"LMCACHE_ASCEND_PATCHES": False}, {}, "LMCACHE_ASCEND_PATCHES=0"),
        ({"LMCACHE_ASCEND_DISABLED_PATCHES": ("test-queue-counting",)}, {}, "LMCACHE_ASCEND_DISABLED_PATCHES"),
        ({"LMCACHE_ASCEND_DISABLED_PATCHES": ("*",)}, {}, "LMCACHE_ASCEND_DISABLED_PATCHES"),
        ({}, {"enabled_by": "LMCACHE_ASCEND_BLEND_HOLES"}, "set LMCACHE_ASCEND_BLEND_HOLES=1"),
    ],
)
def test_skipped_disabled(flag_overrides, patch_overrides, reason_part):
    registry = Registry([make_patch(**patch_overrides)])
    before = snapshot(Queue)
    assert apply_now(registry, "test-queue-counting", flags_with(**flag_overrides)) is State.SKIPPED_DISABLED
    assert reason_part in registry.record("test-queue-counting").reason
    assert_identical(before, snapshot(Queue))


def test_enabled_by_flag_on_applies():
    registry = Registry([make_patch(enabled_by="LMCACHE_ASCEND_BLEND_HOLES")])
    assert apply_now(registry, "test-queue-counting", flags_with(LMCACHE_ASCEND_BLEND_HOLES=True)) is State.APPLIED
    registry.revert("test-queue-counting")


def test_skipped_version():
    registry = Registry([make_patch(requires={"vllm": "<0.1"})])
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.SKIPPED_VERSION
    assert f"vllm {installed_version('vllm')} is outside <0.1" in registry.record("test-queue-counting").reason


def test_prerelease_and_local_versions_satisfy_specifiers():
    from lmcache_ascend.compat.versions import version_satisfies

    assert version_satisfies("0.23.0rc1", ">=0.23.0rc1,<0.24")
    assert version_satisfies("2.13.0+cpu", ">=2.13")
    assert not version_satisfies("0.18.1", ">=0.23")


def test_skipped_upstream_by_probe_wins_over_source():
    guard = UpstreamGuard(probe=lambda module: True, unfixed_if_source_contains=("class FreeKVCacheBlockQueue",))
    registry = Registry([make_patch(guard=guard)])
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.SKIPPED_UPSTREAM
    assert "capability probe" in registry.record("test-queue-counting").reason


def test_skipped_upstream_by_source_text():
    guard = UpstreamGuard(fixed_if_source_contains=("class FreeKVCacheBlockQueue",))
    registry = Registry([make_patch(guard=guard)])
    registry.evaluate_without_import(DEFAULT_FLAGS)
    assert registry.state("test-queue-counting") is State.SKIPPED_UPSTREAM
    assert "source has" in registry.record("test-queue-counting").reason


def test_probe_that_raises_falls_back_to_source():
    def broken_probe(module):
        raise AttributeError("renamed upstream")

    guard = UpstreamGuard(probe=broken_probe, unfixed_if_source_contains=("class FreeKVCacheBlockQueue",))
    registry = Registry([make_patch(guard=guard)])
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.APPLIED
    assert "lacks-fix" in registry.record("test-queue-counting").reason
    registry.revert("test-queue-counting")


def test_add_kind_is_skipped_where_upstream_defines_the_attribute():
    """prepend_n: absent on stack A (added), present on stack B (upstream has it)."""

    def build(ctx):
        def prepend_n(self, blocks):
            for block in reversed(list(blocks)):
                self.append(block)  # test body only

        return {"FreeKVCacheBlockQueue.prepend_n": prepend_n}

    patch = make_patch(name="test-add-prepend", attributes=("FreeKVCacheBlockQueue.prepend_n",), kind=PatchKind.ADD, build=build)
    registry = Registry([patch])
    before = snapshot(Queue)
    state = apply_now(registry, "test-add-prepend", DEFAULT_FLAGS)
    if STACK_HAS_PREPEND_N:
        assert state is State.SKIPPED_UPSTREAM
        assert_identical(before, snapshot(Queue))
    else:
        assert state is State.APPLIED
        assert "prepend_n" in vars(Queue)
        registry.revert("test-add-prepend")
        assert "prepend_n" not in vars(Queue)
        assert_identical(before, snapshot(Queue))


@pytest.mark.parametrize(
    "patch_overrides, reason_part",
    [
        ({"requires": {"a-distribution-that-is-not-installed": ">=1"}}, "is not installed"),
        ({"target": "vllm.v1.core.no_such_module"}, "not found"),
        ({"attributes": ("FreeKVCacheBlockQueue.no_such_method",)}, "has no FreeKVCacheBlockQueue.no_such_method"),
        ({"attributes": ("NoSuchClass.method",)}, "has no NoSuchClass"),
    ],
)
def test_target_missing(patch_overrides, reason_part):
    registry = Registry([make_patch(**patch_overrides)])
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.TARGET_MISSING
    assert reason_part in registry.record("test-queue-counting").reason


def test_bases_can_be_extended_and_restored():
    """The shape of the SupportsHMA patches: a mixin appended to a real connector's bases."""
    connector_module = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector")
    connector = connector_module.LMCacheConnectorV1

    import abc

    class AbcMixin(abc.ABC):  # like SupportsHMA: an ABC whose answers are cached
        pass

    class Mixin(AbcMixin):
        def lmcache_ascend_test_mixin(self):
            return "mixed"

    def build(ctx):
        return {"LMCacheConnectorV1.__bases__": ctx.original("LMCacheConnectorV1.__bases__") + (Mixin,)}

    patch = make_patch(
        name="test-bases", target=connector_module.__name__, attributes=("LMCacheConnectorV1.__bases__",),
        kind=PatchKind.REPLACE, build=build,
    )
    registry = Registry([patch])
    before = snapshot(connector)
    assert not issubclass(connector, AbcMixin)  # fills the ABC's negative cache
    assert apply_now(registry, "test-bases", DEFAULT_FLAGS) is State.APPLIED
    assert issubclass(connector, Mixin)
    assert issubclass(connector, AbcMixin)  # no stale "no" from before the patch
    assert connector.lmcache_ascend_test_mixin(None) == "mixed"
    registry.revert("test-bases")
    assert not issubclass(connector, Mixin)
    assert not issubclass(connector, AbcMixin)  # no stale "yes" after revert
    assert_identical(before, snapshot(connector))


# ---------------------------------------------------------------- drift and guards without source


def test_untested_fingerprint_applies_but_says_so():
    registry = Registry([make_patch(tested_fingerprints={"FreeKVCacheBlockQueue.popleft": ("000000000000",)})])
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.APPLIED
    record = registry.record("test-queue-counting")
    try:
        assert record.untested
        assert "untested target" in record.reason
    finally:
        registry.revert("test-queue-counting")


def test_known_fingerprint_is_tested():
    prints = {path: (fingerprint(vars(Queue)[path.split(".")[1]]),) for path in ("FreeKVCacheBlockQueue.popleft", "FreeKVCacheBlockQueue.append")}
    registry = Registry([make_patch(tested_fingerprints=prints)])
    apply_now(registry, "test-queue-counting", DEFAULT_FLAGS)
    try:
        assert not registry.record("test-queue-counting").untested
    finally:
        registry.revert("test-queue-counting")


def test_pyc_only_target_falls_back_to_the_version_gate(tmp_path, monkeypatch):
    package = tmp_path / "pyc_only_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "target.py").write_text(textwrap.dedent("""
        class Thing:
            def method(self):
                return 'original'  # FIXED-MARKER
    """))
    compileall.compile_dir(str(package), legacy=True, quiet=1)
    (package / "target.py").unlink()
    monkeypatch.syspath_prepend(str(tmp_path))

    def build(ctx):
        return {"Thing.method": lambda self: "patched"}

    def make(requires):
        return Patch(
            name="test-pyc", target="pyc_only_pkg.target", attributes=("Thing.method",), kind=PatchKind.REPLACE,
            build=build, summary="s", why="w", mirrors="m", delete_when="d", requires=requires,
            guard=UpstreamGuard(fixed_if_source_contains=("FIXED-MARKER",)),
        )

    from lmcache_ascend.compat.source import module_source_text

    assert module_source_text("pyc_only_pkg.target") is None
    in_range = Registry([make({"vllm": ">=0.1"})])
    assert apply_now(in_range, "test-pyc", DEFAULT_FLAGS) is State.APPLIED  # source unknown -> version decides
    assert "unknown" in in_range.record("test-pyc").reason
    module = sys.modules["pyc_only_pkg.target"]
    assert module.Thing().method() == "patched"
    in_range.revert("test-pyc")
    out_of_range = Registry([make({"vllm": "<0.1"})])
    assert apply_now(out_of_range, "test-pyc", DEFAULT_FLAGS) is State.SKIPPED_VERSION
    assert module.Thing().method() == "original"
    for name in ("pyc_only_pkg.target", "pyc_only_pkg"):
        sys.modules.pop(name, None)


def test_a_target_without_source_is_untested_and_fails_strict(tmp_path, monkeypatch, capsys):
    """No source, no proof that it is a version we tested: applied, but untested."""
    from lmcache_ascend.patches import __main__ as cli

    package = tmp_path / "sourceless_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "target.py").write_text("class Thing:\n    def method(self):\n        return 'original'\n")
    compileall.compile_dir(str(package), legacy=True, quiet=1)
    (package / "target.py").unlink()
    monkeypatch.syspath_prepend(str(tmp_path))
    patch = Patch(
        name="test-sourceless", target="sourceless_pkg.target", attributes=("Thing.method",), kind=PatchKind.REPLACE,
        build=lambda ctx: {"Thing.method": lambda self: "patched"}, summary="s", why="w", mirrors="m",
        delete_when="d", requires={"vllm": ">=0.1"}, tested_fingerprints={"Thing.method": ("0123456789ab",)},
    )
    registry = Registry([patch])
    monkeypatch.setattr(registry_module, "_PROCESS_REGISTRY", registry)
    try:
        assert apply_now(registry, "test-sourceless", DEFAULT_FLAGS) is State.APPLIED
        record = registry.record("test-sourceless")
        assert record.untested and "Thing.method has no source" in record.reason
        assert cli.main(["--strict"]) == 1
        out = capsys.readouterr().out
        assert "applied (untested target)" in out and "test-sourceless: untested target" in out
        from lmcache_ascend.compat.source import NO_SOURCE

        assert record.fingerprints == {"Thing.method": NO_SOURCE}
        # Listed as tested without source (generated code), it is tested.
        registry.revert("test-sourceless")
        tested_sourceless = Registry([Patch(**{**vars(patch), "tested_fingerprints": {"Thing.method": (NO_SOURCE,)}})])
        assert apply_now(tested_sourceless, "test-sourceless", DEFAULT_FLAGS) is State.APPLIED
        assert not tested_sourceless.record("test-sourceless").untested
        tested_sourceless.revert("test-sourceless")
    finally:
        registry.revert("test-sourceless")
        for name in ("sourceless_pkg.target", "sourceless_pkg"):
            sys.modules.pop(name, None)


def test_lmcache_target_round_trip():
    """One real LMCache class, to prove the framework on the second distribution too."""
    engine_module = importlib.import_module("lmcache.v1.cache_engine")
    engine_class = engine_module.LMCacheEngine

    def build(ctx):
        original = ctx.original_function("LMCacheEngine.close")

        def close(self, *args, **kwargs):
            return original(self, *args, **kwargs)

        close.__wrapped__ = original
        return {"LMCacheEngine.close": close}

    patch = Patch(
        name="test-lmcache-close", target="lmcache.v1.cache_engine", attributes=("LMCacheEngine.close",),
        kind=PatchKind.WRAP, build=build, summary="s", why="w", mirrors="m", delete_when="d",
        requires={"lmcache": ">=0.4"},
    )
    registry = Registry([patch])
    before = snapshot(engine_class)
    assert apply_now(registry, "test-lmcache-close", DEFAULT_FLAGS) is State.APPLIED
    assert vars(engine_class)["close"] is not before["close"]
    registry.revert("test-lmcache-close")
    assert_identical(before, snapshot(engine_class))


def test_duplicate_names_and_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="two patches are named"):
        Registry([make_patch(), make_patch()])
    with pytest.raises(ValueError, match="not among attributes"):
        make_patch(tested_fingerprints={"Other.thing": ("x",)})
    with pytest.raises(ValueError, match="must be a non-empty word"):
        make_patch(name="has space")
    registry = Registry([make_patch(requires={"vllm": "not a specifier"})])
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.SKIPPED_VERSION
    assert "invalid requirement" in registry.record("test-queue-counting").reason


def test_missing_is_falsy_and_unique():
    assert not MISSING and repr(MISSING) == "MISSING"


# ---------------------------------------------------------------- prerequisites


def _prerequisite_pair():
    first = make_patch(name="test-first", attributes=("FreeKVCacheBlockQueue.popleft",),
                       build=lambda ctx: {"FreeKVCacheBlockQueue.popleft": lambda self: "first"})

    def second_build(ctx):
        # Builds on what the first installed: proves the order.
        assert "test-first" in markers.patch_names_on(ctx.original("FreeKVCacheBlockQueue.popleft"))
        return {"FreeKVCacheBlockQueue.append": lambda self, block: "second"}

    second = make_patch(name="test-second", attributes=("FreeKVCacheBlockQueue.append",), build=second_build,
                        after=("test-first",))
    return first, second


def test_prerequisite_is_applied_first_and_reverted_last():
    first, second = _prerequisite_pair()
    registry = Registry([first, second])
    before = snapshot(Queue)
    assert apply_now(registry, "test-second", DEFAULT_FLAGS) is State.APPLIED
    assert registry.state("test-first") is State.APPLIED
    assert registry.revert("test-first") is State.REVERTED  # takes its dependent out first
    assert registry.state("test-second") is State.REVERTED
    assert_identical(before, snapshot(Queue))


def test_dependent_of_a_disabled_prerequisite_is_skipped_with_the_reason():
    first, second = _prerequisite_pair()
    registry = Registry([first, second])
    values = flags_with(LMCACHE_ASCEND_DISABLED_PATCHES=("test-first",))
    before = snapshot(Queue)
    assert apply_now(registry, "test-second", values) is State.SKIPPED_DISABLED
    assert "needs test-first, which is skipped-disabled" in registry.record("test-second").reason
    assert_identical(before, snapshot(Queue))


def test_unknown_prerequisite_fails_cleanly():
    registry = Registry([make_patch(after=("no-such-patch",))])
    before = snapshot(Queue)
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.FAILED
    assert "not declared" in registry.record("test-queue-counting").reason
    assert_identical(before, snapshot(Queue))


@pytest.mark.parametrize("kind", [PatchKind.WRAP, PatchKind.REPLACE])
def test_a_target_attribute_that_is_not_callable_fails(monkeypatch, kind):
    monkeypatch.setattr(Queue, "popleft", 42)  # upstream turned the method into data
    registry = Registry([make_patch(kind=kind)])
    before = snapshot(Queue)
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.FAILED
    assert "not callable" in registry.record("test-queue-counting").reason
    assert_identical(before, snapshot(Queue))


def test_strict_counts_an_overridden_patch(monkeypatch, capsys):
    from lmcache_ascend.patches import __main__ as cli

    registry = Registry([make_patch()])
    monkeypatch.setattr(registry_module, "_PROCESS_REGISTRY", registry)
    assert apply_now(registry, "test-queue-counting", DEFAULT_FLAGS) is State.APPLIED
    try:
        monkeypatch.setattr(Queue, "popleft", lambda self: None)  # someone replaced ours
        assert cli.main(["--strict"]) == 1
        assert "test-queue-counting: overridden" in capsys.readouterr().out
    finally:
        monkeypatch.undo()
        registry.revert("test-queue-counting")


def test_a_record_moves_only_along_the_transition_table():
    from lmcache_ascend.patches.model import TRANSITIONS

    assert set(TRANSITIONS) == set(State)
    record = Registry([make_patch()]).record("test-queue-counting")
    with pytest.raises(RuntimeError, match="no transition pending -> reverted"):
        record.set(State.REVERTED, "never applied")
    assert record.state is State.PENDING
    record.set(State.APPLIED, "test")
    with pytest.raises(RuntimeError, match="no transition applied -> pending"):
        record.set(State.PENDING, "")  # an applied patch is reverted first
    record.set(State.REVERTED, "test")
    record.set(State.PENDING, "")
    assert record.state is State.PENDING
