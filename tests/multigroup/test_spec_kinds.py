"""Every KV-cache spec type of the installed vLLM (and vllm-ascend's published source) is classified.

A spec type upstream adds fails `test_every_vllm_spec_type_is_classified`, naming
it: the overlay must decide whether it is KV to move, state to skip, or state that
makes reuse impossible, never guess.
"""

from __future__ import annotations

import ast
import inspect
import logging
from pathlib import Path

import pytest
import torch
from vllm.v1 import kv_cache_interface
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from lmcache_ascend.multigroup.reuse_verdict import VLLM_REUSE_OFF_KEY, record_vllm_reuse_off, reuse_blocker
from lmcache_ascend.multigroup.spec_kinds import (
    BUNDLE_SPEC_NAMES,
    SPEC_KINDS,
    SpecKind,
    UnknownSpecError,
    classify,
    names_of_kind,
)
from lmcache_ascend.multigroup.specs import kv_groups_from_config
from lmcache_ascend.multigroup.state_skip import StateGroupPolicy
from tests.fixtures.sdists import sdists_dir

ABSTRACT_BASES = {"KVCacheSpec", "AttentionSpec"}


def _vllm_spec_types() -> list[type]:
    return [
        value
        for _, value in inspect.getmembers(kv_cache_interface, inspect.isclass)
        if issubclass(value, KVCacheSpec) and value.__module__ == kv_cache_interface.__name__
    ]


def test_every_vllm_spec_type_is_classified():
    types = _vllm_spec_types()
    assert len(types) >= 10, [t.__name__ for t in types]  # the enumeration itself found the specs
    unclassified = sorted(
        t.__name__ for t in types if t.__name__ not in SPEC_KINDS and t.__name__ not in BUNDLE_SPEC_NAMES | ABSTRACT_BASES
    )
    assert not unclassified, f"vLLM spec types with no classification: {unclassified}"


def _ascend_sdists() -> list[Path]:
    return sorted(sdists_dir().glob("vllm-ascend-*/vllm_ascend"))


def test_every_vllm_ascend_spec_type_is_classified():
    """Classes of vllm-ascend's published source that derive from a vLLM spec type (read, not imported)."""
    roots = _ascend_sdists()
    if not roots:
        pytest.skip("no vllm-ascend sdist unpacked (scripts/fetch-vllm-ascend)")
    spec_names = {t.__name__ for t in _vllm_spec_types()}
    found: dict[str, str] = {}
    for root in roots:
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(errors="replace"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    bases = {ast.unparse(base).split(".")[-1].lstrip("_") for base in node.bases}
                    if bases & spec_names:
                        found[node.name] = str(path.relative_to(root.parent))
    assert found, "no spec type found in vllm-ascend's source: the enumeration is broken"
    unclassified = {name: where for name, where in found.items() if name not in SPEC_KINDS}
    assert not unclassified, f"vllm-ascend spec types with no classification: {unclassified}"


def test_classify_by_class_then_ancestors_and_refuse_unknown():
    assert classify("MambaSpec").kind is SpecKind.NO_REUSE
    assert classify("FullAttentionSpec").kind is SpecKind.MOVE
    inherited = classify("MyMLA", ["MLAAttentionSpec", "FullAttentionSpec", "AttentionSpec", "KVCacheSpec"])
    assert (inherited.kind, inherited.classified_as) == (SpecKind.MOVE, "MLAAttentionSpec")
    with pytest.raises(UnknownSpecError, match="'NewSpec'.*not classified"):
        classify("NewSpec", ["AttentionSpec", "KVCacheSpec"])


def test_only_deepseek_v4_compressor_states_may_be_skipped():
    """SKIP names exactly the six compressor-state specs the skip flag may leave out; encoder-only
    attention, which keeps nothing between steps, is no reuse rather than something to skip."""
    assert names_of_kind(SpecKind.SKIP) == (
        "C128AttnKVState", "C128AttnScoreState", "C4AttnKVState", "C4AttnScoreState", "C4IndexerKVState",
        "C4IndexerScoreState",
    )
    assert classify("EncoderOnlyAttentionSpec").kind is SpecKind.NO_REUSE


def _config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(layer_names=[f"layers.{i}"], kv_cache_spec=spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def _mamba(block_size: int = 2048) -> MambaSpec:
    fields = {f for f in inspect.signature(MambaSpec).parameters}
    kwargs = dict(block_size=block_size, shapes=((4, 8), (8, 16)), dtypes=(torch.float32, torch.float32))
    if "mamba_type" in fields:
        kwargs["mamba_type"] = "mamba2"
    return MambaSpec(**kwargs)


def _full(block_size: int = 128) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)


def test_mamba_groups_are_never_moved_and_block_reuse():
    kv_groups = kv_groups_from_config(_config(_mamba(), _full()), 128, StateGroupPolicy())
    mamba, full = kv_groups.groups
    assert (mamba.transferred, mamba.no_reuse is not None, full.transferred, full.no_reuse) == (False, True, True, None)
    assert kv_groups.no_reuse_groups == (mamba,)
    # Declaring Mamba a state group, or turning state skipping off, changes nothing.
    for policy in (StateGroupPolicy(True, frozenset({"MambaSpec"})), StateGroupPolicy(False)):
        again = kv_groups_from_config(_config(_mamba(), _full()), 128, policy)
        assert again.transferred == (False, True)
    pure = kv_groups_from_config(_config(_mamba()), 2048, StateGroupPolicy())
    assert pure.transferred == (False,)
    why = reuse_blocker(pure, None)
    assert "group 0 (MambaSpec: a state-space layer keeps one recurrent state" in why


def test_attention_models_may_reuse():
    for specs in ((_full(),), (SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                                 sliding_window=64), _full())):
        kv_groups = kv_groups_from_config(_config(*specs), 128, StateGroupPolicy())
        assert reuse_blocker(kv_groups, None) is None


def test_unknown_spec_type_refused_naming_group_and_type():
    unknown = type("BrandNewSpec", (MambaSpec.__mro__[1],), {})  # directly under KVCacheSpec
    assert unknown.__mro__[1] is KVCacheSpec
    spec = object.__new__(unknown)
    object.__setattr__(spec, "block_size", 16)
    with pytest.raises(ValueError, match="KV-cache group 1: KV-cache spec type 'BrandNewSpec'"):
        kv_groups_from_config(_config(_full(), spec), 16, StateGroupPolicy())


def test_vllm_reuse_off_travels_on_the_transfer_config():
    from vllm.config import KVTransferConfig

    class Config:
        kv_transfer_config = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")

    kv_groups = kv_groups_from_config(
        _config(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)), 16,
        StateGroupPolicy(),
    )
    assert reuse_blocker(kv_groups, Config) is None
    assert record_vllm_reuse_off(Config, "MLA over a cached prefix is not supported")
    assert Config.kv_transfer_config.kv_connector_extra_config[VLLM_REUSE_OFF_KEY]
    assert "vLLM turned its own prefix caching off for this model (MLA over" in reuse_blocker(kv_groups, Config)

    class NoConnector:
        kv_transfer_config = None

    assert not record_vllm_reuse_off(NoConnector, "x")


def test_blocker_logged_once_at_start(caplog):
    from lmcache_ascend.multigroup import adapter_scheduler

    class Parent:
        _kv_cache_config = _config(_mamba(), _full())

    class Connector:
        _parent = Parent()
        _block_size = 128
        config = None
        _vllm_config = None
        _discard_partial_chunks = True
        _lmcache_chunk_size = 256

    connector = Connector()
    connector.force_skip_save = False  # as LMCache's connector starts without LMCACHE_FORCE_SKIP_SAVE
    with caplog.at_level(logging.WARNING, logger=adapter_scheduler.__name__):
        for _ in range(3):
            why = adapter_scheduler.connector_reuse_blocker(connector)
    assert "MambaSpec" in why
    assert connector.force_skip_save is True, "an engine that may not reuse must store nothing"
    warnings = [r for r in caplog.records if "supplies no prefix" in r.getMessage()]
    assert len(warnings) == 1 and "group 0 (MambaSpec" in warnings[0].getMessage()
    assert "stores nothing" in warnings[0].getMessage()

    class AttentionParent:
        _kv_cache_config = _config(_full())

    attention = Connector()
    attention._parent = AttentionParent()
    attention.force_skip_save = False
    assert adapter_scheduler.connector_reuse_blocker(attention) is None
    assert attention.force_skip_save is False


def _compressed(tokens_per_state: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                            tokens_per_state=tokens_per_state)


@pytest.mark.skipif("tokens_per_state" not in getattr(MLAAttentionSpec, "__dataclass_fields__", {}),
                    reason="this vLLM's MLA spec has no tokens_per_state (DeepSeek-V4's compression in vLLM 0.32)")
def test_compression_read_from_tokens_per_state_and_mixed_ratios_move_at_each_layer_s_ratio():
    """vLLM 0.32 bundles DeepSeek-V4's compressed caches in one group per block size: a group of
    ratio-4 caches is moved at ratio 4; one holding ratio-4 and ratio-128 caches (64 and 2 rows per
    256-token block) is moved too, each layer's rows at its own ratio under the group's one block
    table; the per-row rules of one ratio refuse that group rather than answer for one ratio."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    def bundle(*ratios):
        return UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs={
            f"model.layers.{index}.attn": _compressed(ratio) for index, ratio in enumerate(ratios)})

    (uniform,) = kv_groups_from_config(_config(bundle(4, 4)), 256, StateGroupPolicy()).groups
    assert (uniform.compress_ratio, uniform.rows_per_block, uniform.no_reuse) == (4, 64, None)
    assert uniform.layer_ratios == () and uniform.ratios == (4,)
    mixed = kv_groups_from_config(_config(bundle(4, 128, 4)), 256, StateGroupPolicy())
    assert mixed.transferred == (True,) and reuse_blocker(mixed, None) is None
    (group,) = mixed.groups
    assert group.ratios == (4, 128) and group.ratio_of("model.layers.1.attn") == 128
    assert [group.at_ratio(ratio).rows_per_block for ratio in group.ratios] == [64, 2]
    assert group.row_keys == ((0, 4), (0, 128))
    with pytest.raises(ValueError, match=r"compress at ratios \(4, 128\), so rows per block depends on the layer"):
        group.rows_per_block
    with pytest.raises(ValueError, match="layer 'model.layers.9.attn' is not one of its layers"):
        group.ratio_of("model.layers.9.attn")
    # vLLM's scheduler sees the first layer's spec of the bundle: its block ids are those the workers take.
    scheduler_config = generate_scheduler_kv_cache_config([_config(bundle(4, 128, 4))])
    scheduler = kv_groups_from_config(scheduler_config, 256, StateGroupPolicy())
    assert scheduler.groups[0].ratios == (4,) and scheduler.geometry_digest == mixed.geometry_digest
