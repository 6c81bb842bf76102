"""vllm-ascend patches against vllm-ascend's REAL published source (run by test_vllm_ascend_patches.py).

This file runs in its own interpreter (``VLLM_ASCEND_SDIST`` names the unpacked
sdist): importing vllm-ascend applies vllm-ascend's own patches to vLLM
process-wide, which must not leak into the rest of the suite. Only the
hardware (``torch_npu``, ``torch.npu``, the SoC build info) is faked.
"""

from __future__ import annotations

import os
import types

import pytest

from tests.vllm_ascend import fake_npu

SDIST = os.environ["VLLM_ASCEND_SDIST"]
fake_npu.install(SDIST)

import torch  # noqa: E402

from lmcache_ascend.patches import State, registry  # noqa: E402

PATCHES = (
    "vllm-ascend-dsv4-prefix-block-size",
    "vllm-ascend-dsv4-attention-block-size",
    "vllm-ascend-dsv4-indexer-block-size",
)
HAS_DSV4 = os.path.isdir(os.path.join(SDIST, "vllm_ascend", "models", "layer"))


@pytest.fixture(scope="module", autouse=True)
def vllm_ascend_loaded():
    if HAS_DSV4:
        import vllm_ascend.ops  # noqa: F401  (vllm-ascend's own import order; avoids its circular chain)
    yield


@pytest.fixture
def patched():
    states = {name: registry.apply_now(name) for name in PATCHES}
    yield states
    for name in PATCHES:
        if registry.state(name) is State.APPLIED:
            registry.revert(name)


def test_states(patched):
    expected = State.APPLIED if HAS_DSV4 else State.SKIPPED_VERSION
    assert patched == {name: expected for name in PATCHES}, {n: registry.record(n).reason for n in PATCHES}


# DeepSeek-V4 support exists from vllm-ascend 0.23 on; on 0.18.0 each test below
# asserts the 0.18.0 expectation instead: skipped-version, read from the sdist's own
# metadata (scripts/fetch-vllm-ascend writes its PKG-INFO as a .dist-info).
needs_dsv4 = HAS_DSV4


def _compressed_spec(block_size=128, compress_ratio=128):
    from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec

    return AscendMLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        model_version="deepseek_v4",
        compress_ratio=compress_ratio,
        cache_dtype_str="auto",
    )


def _coordinator_shell():
    """The real coordinator class; only the three fields the method reads are set."""
    from vllm_ascend.patch.platform.patch_kv_cache_coordinator import AscendHybridKVCacheCoordinator

    coordinator = object.__new__(AscendHybridKVCacheCoordinator)
    coordinator.dcp_world_size = coordinator.pcp_world_size = 1
    coordinator.enable_caching = True
    return coordinator


def test_prefix_block_size_unpacks_uniform_bundle():
    if not needs_dsv4:
        assert registry.apply_now(PATCHES[0]) is State.SKIPPED_VERSION
        return
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    member = _compressed_spec()
    bundle = UniformTypeKVCacheSpecs(block_size=128, kv_cache_specs={"layers.0.attn": member, "layers.1.attn": member})
    coordinator = _coordinator_shell()
    # As shipped: the bundle hides compress_ratio -> 128 instead of 128 x 128.
    assert coordinator._get_effective_block_size(member) == 16384
    assert coordinator._get_effective_block_size(bundle) == 128
    assert registry.apply_now(PATCHES[0]) is State.APPLIED
    try:
        assert coordinator._get_effective_block_size(bundle) == 16384
        assert coordinator._get_effective_block_size(member) == 16384
    finally:
        registry.revert(PATCHES[0])


def _indexer(compress_ratio):
    from vllm.config import CacheConfig
    from vllm_ascend.models.deepseek_v4 import AscendDeepseekV4IndexerCache

    indexer = object.__new__(AscendDeepseekV4IndexerCache)  # nn.Module state is not needed by the spec
    indexer.head_dim = 128
    indexer.dtype = torch.int8
    indexer.compress_ratio = compress_ratio
    indexer.cache_config = CacheConfig(block_size=128)
    return indexer


def _attention(compress_ratio):
    from vllm_ascend.models.layer.attention.layer import DSAAttention

    attention = object.__new__(DSAAttention)
    attention.compress_ratio = compress_ratio
    attention.kv_cache_dtype = "auto"
    attention.head_size = 512
    return attention


def _engine_config():
    from vllm.config import CacheConfig

    # Only the two sub-configs the spec methods read; a full VllmConfig needs model files.
    return types.SimpleNamespace(cache_config=CacheConfig(block_size=128), model_config=types.SimpleNamespace(dtype=torch.bfloat16))


@pytest.mark.parametrize("layer", ["indexer", "attention"])
@pytest.mark.parametrize(("flag", "ratio", "expected"), [(None, 128, 128), ("128", 128, 128), ("32", 128, 32), ("64", 128, 64), ("32", 4, 128)])
def test_compressed_block_size_flag(patched, monkeypatch, layer, flag, ratio, expected):
    if not needs_dsv4:
        assert patched[PATCHES[1]] is State.SKIPPED_VERSION
        return
    if flag is None:
        monkeypatch.delenv("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", flag)
    make = _indexer if layer == "indexer" else _attention
    spec = make(ratio).get_kv_cache_spec(_engine_config())
    assert spec.block_size == expected
    assert spec.compress_ratio == ratio
    registry.revert(PATCHES[1])
    registry.revert(PATCHES[2])
    legacy = make(ratio).get_kv_cache_spec(_engine_config())
    # Everything but the block size is what vllm-ascend itself returns.
    assert legacy.block_size == 128
    assert {**vars(spec), "block_size": 128} == vars(legacy)


def test_bad_flag_value_is_named(patched, monkeypatch):
    if not needs_dsv4:
        return
    from lmcache_ascend.flags import FlagError

    monkeypatch.setenv("VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE", "48")
    with pytest.raises(FlagError, match=r"VLLM_ASCEND_DSV4_COMPRESSED_KV_BLOCK_SIZE='48' is not allowed; allowed: 32 \| 64 \| 128"):
        _indexer(128).get_kv_cache_spec(_engine_config())


LAYER_NAMES_PATCH = "vllm-ascend-kv-cache-layer-names"


def _layer_config(group_layers, tensor_layers):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    return KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[KVCacheTensor(size=2 * spec.page_size_bytes, shared_by=[name]) for name in tensor_layers],
        kv_cache_groups=[KVCacheGroupSpec(list(group_layers), spec)],
    )


def _engine_context():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))


def test_layer_name_mismatch_lists_missing_and_extra():
    state = registry.apply_now(LAYER_NAMES_PATCH)
    if not HAS_DSV4:
        assert state is State.SKIPPED_VERSION
        return
    from lmcache_ascend.prefix_cache.layer_names import LayerNameMismatchError
    from vllm_ascend.worker.v2 import attn_utils

    assert state is State.APPLIED, registry.record(LAYER_NAMES_PATCH).reason
    try:
        config = _layer_config(["layers.0.attn", "layers.1.attn", "layers.2.attn"], ["layers.0.attn", "mtp.attn"])
        with pytest.raises(LayerNameMismatchError) as error:
            attn_utils._allocate_kv_cache(config, {"layers.2.attn": "layers.0.attn"}, torch.device("cpu"))
        assert error.value.missing == ["layers.1.attn"] and error.value.extra == ["mtp.attn"]
        assert "mtp.attn: KVCacheTensor(" in str(error.value)
    finally:
        registry.revert(LAYER_NAMES_PATCH)
    # As shipped: an extra layer ends in a bare KeyError, a missing one in a bare assert.
    with _engine_context(), pytest.raises(KeyError, match="mtp.attn"):
        attn_utils._allocate_kv_cache(config, {"layers.2.attn": "layers.0.attn"}, torch.device("cpu"))
    only_missing = _layer_config(["layers.0.attn", "layers.1.attn", "layers.2.attn"], ["layers.0.attn"])
    with _engine_context(), pytest.raises(AssertionError, match="Some layers are not correctly initialized"):
        attn_utils._allocate_kv_cache(only_missing, {"layers.2.attn": "layers.0.attn"}, torch.device("cpu"))


def test_matching_layer_names_allocate_as_before():
    if not HAS_DSV4:
        return
    from vllm_ascend.worker.v2 import attn_utils

    assert registry.apply_now(LAYER_NAMES_PATCH) is State.APPLIED
    try:
        config = _layer_config(["layers.0.attn", "layers.1.attn"], ["layers.0.attn", "layers.1.attn"])
        with _engine_context():
            tensors = attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"))
        assert sorted(tensors) == ["layers.0.attn", "layers.1.attn"]
    finally:
        registry.revert(LAYER_NAMES_PATCH)
