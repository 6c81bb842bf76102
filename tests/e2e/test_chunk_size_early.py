"""An LMCache chunk size that cannot fit vLLM's blocks is refused while vLLM builds its config.

vLLM's real ``EngineArgs.create_engine_config`` on its CPU build (the platform fixes the
block size in the config's own checks), LMCache's real configuration loader (its
environment variables and the KV-transfer config's ``lmcache.`` keys), and the
``vllm-lmcache-chunk-size-early`` patch applied through the registry. No weights are
read: the model folder holds only a ``config.json``.
"""

from __future__ import annotations

import json

import pytest

from lmcache_ascend.patches import State, registry
from tests.stack import only_with_vllm_cpu_build
from tests.patching import apply_now

REGISTRY = registry.process_registry()
only_with_vllm_cpu_build("the early chunk-size check on a real VllmConfig")

PATCH = "vllm-lmcache-chunk-size-early"


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "max_position_embeddings": 4096, "torch_dtype": "float32",
    }))
    return tmp_path


@pytest.fixture(autouse=True)
def no_plugin_activation(monkeypatch):
    """vLLM's EngineArgs loads its plugins, ours among them, which would arm every patch for the
    rest of the session: this module applies its one patch by hand."""
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", True)


@pytest.fixture
def patched():
    assert apply_now(REGISTRY, PATCH) is State.APPLIED, REGISTRY.record(PATCH).reason
    yield
    REGISTRY.revert(PATCH)


@pytest.fixture
def lmcache_chunk_size(monkeypatch):
    """Set LMCache's chunk size as a user does (``LMCACHE_CHUNK_SIZE``), LMCache's cached config dropped."""
    from lmcache.integration.vllm import utils

    def set_chunk_size(value: int) -> None:
        monkeypatch.setenv("LMCACHE_CHUNK_SIZE", str(value))
        monkeypatch.setattr(utils, "_config_instance", None)

    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    return set_chunk_size


def _config(model, connector="LMCacheConnectorV1", block_size=None, extra=None):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = None if connector is None else KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra or {})
    return EngineArgs(model=str(model), skip_tokenizer_init=True, block_size=block_size, max_model_len=1024,
                      kv_transfer_config=transfer).create_engine_config()


@pytest.mark.parametrize(("block_size", "chunk_size", "nearest"), [(None, 200, "128 or 256"), (32, 200, "192 or 224"),
                                                                   (64, 96, "64 or 128")])
def test_a_chunk_that_ends_inside_a_block_is_refused_naming_the_nearest_sizes(
        model, patched, lmcache_chunk_size, block_size, chunk_size, nearest):
    lmcache_chunk_size(chunk_size)
    with pytest.raises(ValueError) as raised:
        _config(model, block_size=block_size)
    text = str(raised.value)
    assert f"LMCache chunk_size={chunk_size} does not fit the KV-cache block sizes {block_size or 128} (vLLM block_size)" in text
    assert f"set chunk_size to {nearest}" in text


@pytest.mark.parametrize(("block_size", "chunk_size"), [(None, 256), (32, 96), (16, 16)])
def test_a_chunk_of_whole_blocks_passes(model, patched, lmcache_chunk_size, block_size, chunk_size):
    lmcache_chunk_size(chunk_size)
    assert _config(model, block_size=block_size).cache_config.block_size == (block_size or 128)


def test_the_kv_transfer_configs_lmcache_key_is_read_as_lmcache_reads_it(model, patched, lmcache_chunk_size):
    from lmcache.integration.vllm.utils import lmcache_get_or_create_config

    lmcache_chunk_size(256)
    with pytest.raises(ValueError, match="LMCache chunk_size=100 does not fit"):
        _config(model, block_size=32, extra={"lmcache.chunk_size": 100})
    _config(model, block_size=32, extra={"lmcache.chunk_size": "96"})
    assert lmcache_get_or_create_config().chunk_size == 256, "LMCache's own config must stay as LMCache loaded it"


@pytest.mark.parametrize("connector", [None, "LMCacheMPConnector"])
def test_without_lmcache_in_process_nothing_is_checked(model, patched, lmcache_chunk_size, connector):
    """No connector; LMCache's MP connector, whose chunk size is its server's (checked there)."""
    lmcache_chunk_size(200)
    assert _config(model, connector=connector).cache_config.block_size == 128


def test_the_same_config_passes_vllm_alone(model, lmcache_chunk_size):
    """The control: without the patch vLLM takes the size and the engine would find out after its weights load."""
    assert REGISTRY.state(PATCH) is not State.APPLIED
    lmcache_chunk_size(200)
    assert _config(model).cache_config.block_size == 128
