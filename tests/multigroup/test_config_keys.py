"""lmcache-ascend flags registered as LMCache config keys (YAML, env wins)."""

from __future__ import annotations

import importlib

import pytest

from lmcache_ascend.flags import FLAGS
from lmcache_ascend.multigroup.connector_state import policy_for_config
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.patches import State, registry
from lmcache_ascend.patches.lmcache.config_flag_keys import ConfigKeyError
from tests.patching import apply_now

REGISTRY = registry.process_registry()
PATCH = "lmcache-config-flag-keys"
KEYS = {flag.lmcache_config_key: flag for flag in FLAGS if flag.lmcache_config_key}


@pytest.fixture
def config_module(monkeypatch):
    for flag in FLAGS:
        monkeypatch.delenv(flag.name, raising=False)
    module = importlib.import_module("lmcache.v1.config")
    original_class, original_table = module.LMCacheEngineConfig, module._CONFIG_DEFINITIONS
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    assert module.LMCacheEngineConfig is original_class  # patched in place: every binding sees the keys
    yield module
    assert REGISTRY.revert(PATCH) is State.REVERTED
    assert module.LMCacheEngineConfig is original_class and module._CONFIG_DEFINITIONS is original_table
    assert not set(KEYS) & set(original_table)


def test_every_flag_key_has_its_default(config_module):
    config = config_module.LMCacheEngineConfig.from_defaults(chunk_size=128)
    assert config.chunk_size == 128
    for key, flag in KEYS.items():
        assert getattr(config, key) == flag.default, key
    assert set(KEYS) <= set(config_module._CONFIG_DEFINITIONS)
    assert callable(config.validate) and callable(config.get_extra_config_value)


def test_yaml_sets_keys_and_environment_wins(config_module, tmp_path, monkeypatch):
    path = tmp_path / "lmcache.yaml"
    path.write_text(
        "chunk_size: 512\nascend_skip_state_groups: false\n"
        "ascend_skip_state_spec_allowlist: [C4AttnKVState, C128AttnKVState]\nascend_transfer_backend: torch\n"
    )
    config = config_module.LMCacheEngineConfig.from_file(str(path))
    assert (config.chunk_size, config.ascend_skip_state_groups, config.ascend_transfer_backend) == (512, False, "torch")
    assert config.ascend_skip_state_spec_allowlist == ("C4AttnKVState", "C128AttnKVState")
    assert policy_for_config(config) == StateGroupPolicy(False, frozenset({"C4AttnKVState", "C128AttnKVState"}))
    monkeypatch.setenv("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "1")
    config.update_config_from_env()
    assert config.ascend_skip_state_groups is True
    assert policy_for_config(config).skip_state_groups is True


def test_bad_yaml_value_stops_with_the_key_named(config_module, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("ascend_transfer_backend: cuda\n")
    with pytest.raises(ConfigKeyError, match="ascend_transfer_backend='cuda'.*auto \\| triton \\| torch"):
        config_module.LMCacheEngineConfig.from_file(str(path))


def test_rebuilt_members_are_exactly_what_the_class_builder_makes_per_class(config_module):
    """If LMCache's class builder grows another member built per class, the list must follow;
    a member it shares between classes must not be in it (our mark would land on upstream's)."""
    from lmcache.v1.config_base import create_config_class

    from lmcache_ascend.patches.lmcache.config_flag_keys import REBUILT_MEMBERS

    table = config_module._CONFIG_DEFINITIONS
    first, second = (create_config_class(config_name="LMCacheEngineConfig", config_definitions=dict(table)) for _ in "ab")
    per_class = {
        name for name, value in vars(first).items()
        if name not in table and name not in ("__dict__", "__weakref__", "__doc__")
        and getattr(value, "__func__", value) is not getattr(vars(second)[name], "__func__", vars(second)[name])
    }
    # Members lmcache.v1.config passes in itself (namespace_extras) stay LMCache's own.
    own = {
        name for name, value in vars(config_module.LMCacheEngineConfig).items()
        if getattr(getattr(value, "__func__", value), "__module__", None) == config_module.__name__
    }
    assert per_class - own == set(REBUILT_MEMBERS)


LATE_ACTIVATION = """
import importlib, sys
import lmcache.integration.vllm.utils as utils   # LMCache first: no .pth hook ran
import lmcache_ascend                            # late activation
import lmcache.v1.config as config
stale = sorted(name for name, module in list(sys.modules.items())
               if vars(module).get("LMCacheEngineConfig", config.LMCacheEngineConfig) is not config.LMCacheEngineConfig)
print("STALE", stale)
loaded = utils.LMCacheEngineConfig.from_file(sys.argv[1] if len(sys.argv) > 1 else %r)
print("VALUE", loaded.ascend_bundle_multi_spec)
"""


def test_late_activation_reaches_every_binding_of_the_config_class(fresh_python, tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 256\nascend_bundle_multi_spec: false\n")
    result = fresh_python(LATE_ACTIVATION % str(path), env={"LMCACHE_ASCEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STALE []" in result.stdout and "VALUE False" in result.stdout, result.stdout[-2000:]


# One resolution: activation (LMCACHE_CONFIG_FILE), LMCache's loader (the registered
# keys) and the connector (an LMCache config object) give a YAML value the same
# answer: the same typed value, or the same refusal naming flag, value and what is allowed.
RESOLUTION_CASES = [
    ("ascend_transfer_backend", ["torch"]),  # a list for a one-value flag
    ("ascend_blend_holes", ["1"]),
    ("ascend_transfer_backend", True),
    ("ascend_transfer_backend", 3.5),
    ("ascend_skip_state_spec_allowlist", [1, 2]),
    ("ascend_skip_state_spec_allowlist", ["C4AttnKVState", "Custom"]),
    ("ascend_skip_state_spec_allowlist", "C4AttnKVState, Custom"),
    ("ascend_blend_holes", 1),
    ("ascend_blend_holes", "on"),
    ("ascend_transfer_backend", "torch"),
]


@pytest.mark.parametrize(("key", "value"), RESOLUTION_CASES, ids=[f"{k}={v!r}" for k, v in RESOLUTION_CASES])
def test_activation_loader_and_connector_resolve_a_value_alike(config_module, tmp_path, key, value):
    import types

    import yaml

    from lmcache_ascend.flags import FlagError, flag_value, validate_all

    flag = KEYS[key]
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump({key: value}))

    def outcome(resolve):
        try:
            return "value", resolve()
        except (FlagError, ConfigKeyError) as error:
            return "refused", str(error)

    answers = {
        "activation": outcome(lambda: validate_all({"LMCACHE_CONFIG_FILE": str(path)})[flag.name]),
        "loader": outcome(lambda: getattr(config_module.LMCacheEngineConfig.from_file(str(path)), key)),
        "connector": outcome(lambda: flag_value(flag.name, {}, lmcache_config=types.SimpleNamespace(**{key: value}))),
    }
    kinds = {kind for kind, _ in answers.values()}
    assert len(kinds) == 1, answers
    if kinds == {"value"}:
        assert len({repr(answer) for _, answer in answers.values()}) == 1, answers
    else:
        for where, (_, message) in answers.items():
            assert f"{flag.name}={value!r}" in message and f"allowed: {flag.allowed_text()}" in message, (where, message)
    if isinstance(value, list) and flag.kind.value != "name-list":
        assert "is a list" in answers["activation"][1]


def test_the_connector_reads_the_loaded_config_through_the_same_resolution(config_module, tmp_path):
    from lmcache_ascend.flags import flag_value

    path = tmp_path / "lmcache.yaml"
    path.write_text("ascend_transfer_backend: torch\nascend_bundle_multi_spec: false\n")
    config = config_module.LMCacheEngineConfig.from_file(str(path))
    assert flag_value("LMCACHE_ASCEND_TRANSFER_BACKEND", {}, lmcache_config=config) == "torch"
    assert flag_value("LMCACHE_ASCEND_BUNDLE_MULTI_SPEC", {}, lmcache_config=config) is False
    # The environment wins over every LMCache source, as in LMCache.
    environ = {"LMCACHE_ASCEND_TRANSFER_BACKEND": "triton"}
    assert flag_value("LMCACHE_ASCEND_TRANSFER_BACKEND", environ, lmcache_config=config) == "triton"
