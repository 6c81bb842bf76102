"""The three entry points and the import order, each in a fresh interpreter of this stack.

Every way in (explicit import before or after the targets, the wheel's .pth
start-up hook, vLLM's general-plugin entry point) must end in the same patch
states; with the hook switched off and no import, nothing is touched.
"""

from __future__ import annotations

import json

import pytest

from lmcache_ascend.compat.source import module_is_locatable
from lmcache_ascend.compat.versions import installed_version
from lmcache_ascend.patches import registry as registry_module

pytestmark = pytest.mark.subprocess

REGISTRY = registry_module.process_registry()
# Targets this stack can import (vllm-ascend patches report target-missing here).
IMPORTABLE_TARGETS = sorted(
    {
        record.patch.target
        for record in REGISTRY.records()
        if module_is_locatable(record.patch.target) and all(installed_version(d) for d in record.patch.requires)
    }
    | {"vllm.v1.core.kv_cache_utils"}
)

REPORT = """
import json, sys
def stale_references(reg):
    # Per applied patch, every module-level name in any loaded module still bound to an
    # object the patch replaced in the module that defines it: code there would run
    # unpatched.  (A name the target imported, e.g. `torch`, is the target's view only.)
    from lmcache_ascend.compat.bindings import is_defined_in
    from lmcache_ascend.patches.model import MISSING
    found = {}
    for r in reg.records():
        if r.state.value != 'applied':
            continue
        target = sys.modules[r.patch.target]
        replaced = {id(v): (path, v) for path, v in r.originals.items() if v is not MISSING and is_defined_in(v, target)}
        found[r.patch.name] = sorted(
            f"{name}.{key} ({replaced[id(value)][0]})"
            for name, module in list(sys.modules.items()) if module is not None
            for key, value in list(getattr(module, '__dict__', {}).items())
            if id(value) in replaced and value is replaced[id(value)][1]
        )
    return found
def report(label):
    loaded = 'lmcache_ascend' in sys.modules
    states, activated_by, stale = {}, [], {}
    if loaded:
        from lmcache_ascend.patches import registry
        reg = registry.process_registry()
        states = {r.patch.name: r.state.value for r in reg.records()}
        activated_by = reg.activated_by
        stale = stale_references(reg)
    print('REPORT=' + json.dumps({'label': label, 'loaded': loaded, 'states': states, 'activated_by': activated_by, 'stale': stale}))
"""

IMPORT_TARGETS = "import importlib\nfor name in %r:\n    importlib.import_module(name)\n" % (IMPORTABLE_TARGETS,)


def run_order(fresh_python, body: str, env: dict[str, str]) -> dict:
    result = fresh_python(REPORT + body, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT=")]
    assert lines, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(lines[-1][len("REPORT="):])


ORDERS = {
    "import-then-targets": ("import lmcache_ascend\n" + IMPORT_TARGETS, {"LMCACHE_ASCEND_AUTOLOAD": "0"}),
    "targets-then-import": (IMPORT_TARGETS + "import lmcache_ascend\n", {"LMCACHE_ASCEND_AUTOLOAD": "0"}),
    "pth-autoload": (IMPORT_TARGETS, {"LMCACHE_ASCEND_AUTOLOAD": "1"}),
    # The start-up hook is armed and the user imports the overlay first: activation must
    # not call back into the hook (it once deadlocked on its own lock there).
    "import-with-hook-armed": ("import lmcache_ascend\n" + IMPORT_TARGETS, {"LMCACHE_ASCEND_AUTOLOAD": "1"}),
    "vllm-plugin": (
        "from vllm.plugins import load_general_plugins\nload_general_plugins()\n" + IMPORT_TARGETS,
        {"LMCACHE_ASCEND_AUTOLOAD": "0"},
    ),
}


@pytest.fixture(scope="module")
def order_reports(request):
    from tests.conftest import run_fresh_python

    return {
        label: run_order(run_fresh_python, body + f"report({label!r})\n", env) for label, (body, env) in ORDERS.items()
    }


def test_every_entry_point_activates(order_reports):
    expected_source = {
        "import-then-targets": "import",
        "targets-then-import": "import",
        "pth-autoload": "autoload",
        "import-with-hook-armed": "import",
        "vllm-plugin": "vllm-plugin",
    }
    for label, report in order_reports.items():
        assert report["loaded"], label
        assert expected_source[label] in report["activated_by"], (label, report["activated_by"])


def test_every_order_ends_in_the_same_states(order_reports):
    reference = order_reports["import-then-targets"]["states"]
    assert set(reference) == set(REGISTRY.names())
    for label, report in order_reports.items():
        assert report["states"] == reference, label
    targets = {record.patch.name: record.patch.target for record in REGISTRY.records()}
    for name, state in reference.items():
        # A target no order imports (a required distribution is absent) is still pending.
        allowed = ("failed",) if targets[name] not in IMPORTABLE_TARGETS else ("failed", "pending")
        assert state not in allowed, (name, state)


def test_every_order_leaves_no_stale_reference(order_reports):
    """The same behaviour in every order: no loaded module keeps an object a patch
    replaced (late activation re-binds a `from target import name` made before it)."""
    for label, report in order_reports.items():
        assert set(report["stale"]) == {n for n, s in report["states"].items() if s == "applied"}, label
        assert report["stale"] == {name: [] for name in report["stale"]}, (label, report["stale"])


def test_late_activation_rebinds_imported_names_and_revert_puts_them_back(fresh_python):
    """LMCache's conf_api binds `_CONFIG_DEFINITIONS` by name before the overlay comes in."""
    if not module_is_locatable("lmcache.v1.internal_api_server.vllm.conf_api"):
        pytest.skip("this LMCache has no conf_api")
    code = (
        "import lmcache.v1.config as config, lmcache.v1.internal_api_server.vllm.conf_api as api\n"
        "before = api._CONFIG_DEFINITIONS\n"
        "import lmcache_ascend\n"
        "from lmcache_ascend.patches import registry\n"
        "state = registry.process_registry().state('lmcache-config-flag-keys').value\n"
        "late = (api._CONFIG_DEFINITIONS is config._CONFIG_DEFINITIONS, 'ascend_skip_state_groups' in api._CONFIG_DEFINITIONS)\n"
        "registry.process_registry().revert('lmcache-config-flag-keys')\n"
        "back = (api._CONFIG_DEFINITIONS is before, config._CONFIG_DEFINITIONS is before, 'ascend_skip_state_groups' in before)\n"
        "print('RESULT', state, late, back)\n"
    )
    result = fresh_python(code, env={"LMCACHE_ASCEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT applied (True, True) (True, True, False)" in result.stdout, result.stdout[-2000:]


def test_no_hook_no_import_touches_nothing(fresh_python):
    report = run_order(fresh_python, IMPORT_TARGETS + "report('off')\n", {"LMCACHE_ASCEND_AUTOLOAD": "0"})
    assert not report["loaded"]


def test_master_switch_disables_everything(fresh_python):
    report = run_order(
        fresh_python,
        "import lmcache_ascend\n" + IMPORT_TARGETS + "report('master-off')\n",
        {"LMCACHE_ASCEND_AUTOLOAD": "0", "LMCACHE_ASCEND_PATCHES": "0"},
    )
    assert set(report["states"].values()) <= {"skipped-disabled"}


def test_bad_flag_fails_activation_with_a_clear_error(fresh_python):
    """Explicit activation raises; the import and the start-up hook warn and let a process that
    does not use LMCache go on (tests/framework/test_start_rules.py: where LMCache is used)."""
    result = fresh_python("import lmcache_ascend\nlmcache_ascend.activate()",
                          env={"LMCACHE_ASCEND_SKIP_STATE_GROUPS": "sometimes"})
    assert result.returncode != 0
    assert "LMCACHE_ASCEND_SKIP_STATE_GROUPS='sometimes' is not a boolean" in result.stderr.strip().splitlines()[-1]
    result = fresh_python(
        "import vllm.v1.core.kv_cache_utils; print('imported')",
        env={"LMCACHE_ASCEND_AUTOLOAD": "1", "LMCACHE_ASCEND_SKIP_STATE_GROUPS": "sometimes"},
    )
    assert result.returncode == 0 and "imported" in result.stdout
    assert "lmcache-ascend: not active in this process: invalid lmcache-ascend flag: LMCACHE_ASCEND_SKIP_STATE_GROUPS" in result.stderr


@pytest.mark.parametrize("raw", ["0", "often"])
def test_a_flag_upstream_reads_never_stops_activation(fresh_python, raw):
    """VLLM_PREFIX_CACHE_RETENTION_INTERVAL=0 is valid for vLLM 0.23; a value only the
    backport would refuse fails the backport alone, and only where it applies."""
    report = run_order(
        fresh_python,
        IMPORT_TARGETS + "report('retention')\n",
        {"LMCACHE_ASCEND_AUTOLOAD": "1", "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": raw},
    )
    assert report["loaded"] and "autoload" in report["activated_by"]
    states = report["states"]
    assert states["lmcache-adapter-worker-multigroup"] == "applied"
    backports = ("vllm-sliding-window-retention", "vllm-coordinator-scheduler-block-size")
    if states["vllm-free-queue-prepend"] == "applied":  # stack A: the backport owns the flag
        expected = "applied" if raw == "0" else "failed"
        assert [states[name] for name in backports] == [expected, expected]
    else:
        assert {states[name] for name in backports} == {"skipped-upstream-has-it"}
