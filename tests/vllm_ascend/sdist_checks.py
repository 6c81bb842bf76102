"""vllm-ascend patches against vllm-ascend's REAL published source (run by test_vllm_ascend_patches.py).

This file runs in its own interpreter (``VLLM_ASCEND_SDIST`` names the unpacked
sdist): importing vllm-ascend applies vllm-ascend's own patches to vLLM
process-wide, which must not leak into the rest of the suite. Only the
hardware (``torch_npu``, ``torch.npu``, the SoC build info) is faked.
"""

from __future__ import annotations

import inspect
import os
import types

import pytest

from tests.vllm_ascend import fake_npu

SDIST = os.environ["VLLM_ASCEND_SDIST"]
fake_npu.install(SDIST)

import torch  # noqa: E402

from lmcache_ascend.patches import State, registry  # noqa: E402
from tests.patching import apply_now  # noqa: E402

REGISTRY = registry.process_registry()
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
    states = {name: apply_now(REGISTRY, name) for name in PATCHES}
    yield states
    for name in PATCHES:
        if REGISTRY.state(name) is State.APPLIED:
            REGISTRY.revert(name)


def test_states(patched):
    expected = State.APPLIED if HAS_DSV4 else State.SKIPPED_VERSION
    assert patched == {name: expected for name in PATCHES}, {n: REGISTRY.record(n).reason for n in PATCHES}


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
        assert apply_now(REGISTRY, PATCHES[0]) is State.SKIPPED_VERSION
        return
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    member = _compressed_spec()
    bundle = UniformTypeKVCacheSpecs(block_size=128, kv_cache_specs={"layers.0.attn": member, "layers.1.attn": member})
    coordinator = _coordinator_shell()
    # As shipped: the bundle hides compress_ratio -> 128 instead of 128 x 128.
    assert coordinator._get_effective_block_size(member) == 16384
    assert coordinator._get_effective_block_size(bundle) == 128
    assert apply_now(REGISTRY, PATCHES[0]) is State.APPLIED
    try:
        assert coordinator._get_effective_block_size(bundle) == 16384
        assert coordinator._get_effective_block_size(member) == 16384
    finally:
        REGISTRY.revert(PATCHES[0])


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
    REGISTRY.revert(PATCHES[1])
    REGISTRY.revert(PATCHES[2])
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
    state = apply_now(REGISTRY, LAYER_NAMES_PATCH)
    if not HAS_DSV4:
        assert state is State.SKIPPED_VERSION
        return
    from lmcache_ascend.prefix_cache.layer_names import LayerNameMismatchError
    from vllm_ascend.worker.v2 import attn_utils

    assert state is State.APPLIED, REGISTRY.record(LAYER_NAMES_PATCH).reason
    try:
        config = _layer_config(["layers.0.attn", "layers.1.attn", "layers.2.attn"], ["layers.0.attn", "mtp.attn"])
        with pytest.raises(LayerNameMismatchError) as error:
            attn_utils._allocate_kv_cache(config, {"layers.2.attn": "layers.0.attn"}, torch.device("cpu"))
        assert error.value.missing == ["layers.1.attn"] and error.value.extra == ["mtp.attn"]
        assert "mtp.attn: KVCacheTensor(" in str(error.value)
    finally:
        REGISTRY.revert(LAYER_NAMES_PATCH)
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

    assert apply_now(REGISTRY, LAYER_NAMES_PATCH) is State.APPLIED
    try:
        config = _layer_config(["layers.0.attn", "layers.1.attn"], ["layers.0.attn", "layers.1.attn"])
        with _engine_context():
            tensors = attn_utils._allocate_kv_cache(config, {}, torch.device("cpu"))
        assert sorted(tensors) == ["layers.0.attn", "layers.1.attn"]
    finally:
        REGISTRY.revert(LAYER_NAMES_PATCH)


PAGE_SIZE_PATCH = "vllm-ascend-dsv4-aggregated-page-size"


def _dsv4_groups():
    """DSv4-like groups: C4 (attention + one indexer), C128 at block size 32, sliding window, MTP.

    Page sizes (bytes per block): C4 attention 131072, C4 indexer 16384, C128 at
    block 32: 32768 (absent from group 0), sliding window 131072, MTP 131072.
    Group 0 has one indexer for two attentions, so its 16384 slot 1 is empty.
    """
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowMLASpec, UniformTypeKVCacheSpecs
    from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec

    def dsa(block_size, compress_ratio, head_size=512, dtype=torch.bfloat16):
        return AscendMLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=head_size,
            dtype=dtype,
            model_version="deepseek_v4",
            compress_ratio=compress_ratio,
            cache_dtype_str="auto",
        )

    swa = SlidingWindowMLASpec(block_size=128, num_kv_heads=1, head_size=512, dtype=torch.bfloat16, sliding_window=128)
    layers_by_group = [
        {"layers.0.attn": dsa(128, 4), "layers.0.indexer": dsa(128, 4, 128, torch.int8), "layers.2.attn": dsa(128, 4), "mtp.0.attn": dsa(128, 4)},
        {"layers.1.attn": dsa(32, 128), "layers.3.attn": dsa(32, 128)},
        {"layers.0.swa": swa, "layers.1.swa": swa},
    ]
    groups = [
        KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=UniformTypeKVCacheSpecs(block_size=128, kv_cache_specs=layers))
        for layers in layers_by_group
    ]
    page_sizes = {name: spec.page_size_bytes for layers in layers_by_group for name, spec in layers.items()}
    # The premise of the test: group 1's page size is not among group 0's.
    assert page_sizes["layers.1.attn"] == 32768
    assert {page_sizes["layers.0.attn"], page_sizes["layers.0.indexer"]} == {131072, 16384}
    return groups, page_sizes


def _layout(groups, available_memory):
    """Through vLLM's own caller, which vllm-ascend redirected to its DSv4 layout."""
    from vllm.config import CacheConfig
    from vllm.v1.core import kv_cache_utils

    engine_config = types.SimpleNamespace(cache_config=CacheConfig(block_size=128))
    config = kv_cache_utils.get_kv_cache_config_from_groups(engine_config, groups, available_memory)
    return config.num_blocks, [(tensor.size, list(tensor.shared_by)) for tensor in config.kv_cache_tensors]


def test_dsv4_page_size_aggregated_across_groups():
    state = apply_now(REGISTRY, PAGE_SIZE_PATCH)
    if not needs_dsv4:
        assert state is State.SKIPPED_VERSION
        return
    assert state is State.APPLIED, REGISTRY.record(PAGE_SIZE_PATCH).reason
    groups, page_sizes = _dsv4_groups()
    every_layer = sorted(page_sizes)
    bytes_per_block = 16384 + 2 * 32768 + 2 * 131072 + 131072  # every planned tensor once, nothing else
    try:
        num_blocks, tensors = _layout(groups, 7 * bytes_per_block + bytes_per_block - 1)
    finally:
        REGISTRY.revert(PAGE_SIZE_PATCH)
    assert num_blocks == 7
    assert tensors == [
        (16384 * 7, ["layers.0.indexer"]),
        (32768 * 7, ["layers.1.attn"]),
        (131072 * 7, ["layers.0.attn", "layers.0.swa"]),
        (32768 * 7, ["layers.3.attn"]),
        (131072 * 7, ["layers.2.attn", "layers.1.swa"]),
        (131072 * 7, ["mtp.0.attn"]),
    ]
    covered = [name for _, shared_by in tensors for name in shared_by]
    assert sorted(covered) == every_layer  # each layer in exactly one tensor
    for size, shared_by in tensors:
        assert all(size == page_sizes[name] * num_blocks for name in shared_by)

    # As shipped: group 0's page sizes only -> the C128 layers get no tensor, an
    # empty tensor is planned, and the block budget counts a whole tuple per MTP layer.
    num_blocks, tensors = _layout(groups, 7 * bytes_per_block + bytes_per_block - 1)
    shipped_covered = {name for _, shared_by in tensors for name in shared_by}
    assert set(every_layer) - shipped_covered == {"layers.1.attn", "layers.3.attn"}
    assert any(not shared_by for _, shared_by in tensors)
    assert num_blocks == (8 * bytes_per_block - 1) // ((131072 + 16384) * 3)


def test_dsv4_page_size_patch_guard_and_revert():
    if not needs_dsv4:
        assert apply_now(REGISTRY, PAGE_SIZE_PATCH) is State.SKIPPED_VERSION
        return
    from vllm.v1.core import kv_cache_utils
    from vllm_ascend.patch.platform import patch_kv_cache_utils

    shipped = patch_kv_cache_utils._get_kv_cache_config_deepseek_v4
    assert kv_cache_utils._get_kv_cache_config_deepseek_v4 is shipped  # vllm-ascend's own redirect
    state = apply_now(REGISTRY, PAGE_SIZE_PATCH)
    try:
        assert state is State.APPLIED
        # Both the vllm-ascend attribute and vLLM's binding (the one its caller uses) are ours.
        assert kv_cache_utils._get_kv_cache_config_deepseek_v4 is patch_kv_cache_utils._get_kv_cache_config_deepseek_v4
        assert apply_now(REGISTRY, PAGE_SIZE_PATCH) is State.APPLIED  # no double apply
    finally:
        REGISTRY.revert(PAGE_SIZE_PATCH)
    assert REGISTRY.state(PAGE_SIZE_PATCH) is State.REVERTED
    assert patch_kv_cache_utils._get_kv_cache_config_deepseek_v4 is shipped
    assert kv_cache_utils._get_kv_cache_config_deepseek_v4 is shipped
    assert "full_mla_spec.get_page_sizes()" in inspect.getsource(kv_cache_utils._get_kv_cache_config_deepseek_v4)
