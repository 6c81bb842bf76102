"""lmcache-ascend flags registered as LMCache config keys (YAML, env wins)."""

from __future__ import annotations

import importlib

import pytest

from lmcache_ascend.flags import FLAGS
from lmcache_ascend.multigroup.connector_state import policy_for_config
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from lmcache_ascend.patches import State, registry
from lmcache_ascend.patches.lmcache.config_flag_keys import ConfigKeyError

PATCH = "lmcache-config-flag-keys"
KEYS = {flag.lmcache_config_key: flag for flag in FLAGS if flag.lmcache_config_key}


@pytest.fixture
def config_module(monkeypatch):
    for flag in FLAGS:
        monkeypatch.delenv(flag.name, raising=False)
    module = importlib.import_module("lmcache.v1.config")
    original_class, original_table = module.LMCacheEngineConfig, module._CONFIG_DEFINITIONS
    assert registry.apply_now(PATCH) is State.APPLIED, registry.record(PATCH).reason
    yield module
    assert registry.revert(PATCH) is State.REVERTED
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
        "ascend_skip_state_spec_allowlist: [C4AttnKVState, Custom]\nascend_transfer_backend: torch\n"
    )
    config = config_module.LMCacheEngineConfig.from_file(str(path))
    assert (config.chunk_size, config.ascend_skip_state_groups, config.ascend_transfer_backend) == (512, False, "torch")
    assert config.ascend_skip_state_spec_allowlist == ("C4AttnKVState", "Custom")
    assert policy_for_config(config) == StateGroupPolicy(False, frozenset({"C4AttnKVState", "Custom"}))
    monkeypatch.setenv("LMCACHE_ASCEND_SKIP_STATE_GROUPS", "1")
    config.update_config_from_env()
    assert config.ascend_skip_state_groups is True
    assert policy_for_config(config).skip_state_groups is True


def test_bad_yaml_value_stops_with_the_key_named(config_module, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("ascend_transfer_backend: cuda\n")
    with pytest.raises(ConfigKeyError, match="ascend_transfer_backend='cuda'.*auto \\| triton \\| torch"):
        config_module.LMCacheEngineConfig.from_file(str(path))
