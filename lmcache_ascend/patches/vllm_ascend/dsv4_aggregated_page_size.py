"""``_get_kv_cache_config_deepseek_v4`` (vllm-ascend's layout, which it installs over
vLLM's function of that name) is replaced by one that plans the tensors with
`lmcache_ascend.prefix_cache.dsv4_tensor_layout`: every group's layers bucketed by
page size over the union of all groups' page sizes, no tensor with an empty
``shared_by``, ``num_blocks`` sized by the tensors it plans.  Both bindings are
replaced: vllm-ascend's module attribute and the one in ``vllm.v1.core.kv_cache_utils``
that ``get_kv_cache_config_from_groups`` calls.  A replacement, not a wrapper: the
original's plan is what is wrong."""

from __future__ import annotations

import inspect

from lmcache_ascend.patches import Patch, PatchKind, UpstreamGuard

_ORIGINAL = "_get_kv_cache_config_deepseek_v4"
_VLLM_BINDING = "vllm.v1.core.kv_cache_utils._get_kv_cache_config_deepseek_v4"
# vllm-ascend 0.23.0.post1's layout: the canonical page sizes come from group 0 only.
_FIRST_GROUP_ONLY = "page_sizes = sorted(full_mla_spec.get_page_sizes())"


def _aggregates_page_sizes(module) -> bool | None:
    source = inspect.getsource(getattr(module, _ORIGINAL))
    if _FIRST_GROUP_ONLY in source:
        return False
    if "if not shared_by" in source or "if shared_by" in source:
        return True
    return None


def get_kv_cache_config_deepseek_v4(vllm_config, kv_cache_groups, available_memory):
    from vllm.v1.core.kv_cache_utils import may_override_num_blocks
    from vllm.v1.kv_cache_interface import KVCacheTensor, UniformTypeKVCacheSpecs

    from lmcache_ascend.prefix_cache.dsv4_tensor_layout import LayerPage, plan_dsv4_kv_tensors

    layer_pages_by_group = []
    for index, group in enumerate(kv_cache_groups):
        bundle = group.kv_cache_spec
        if not isinstance(bundle, UniformTypeKVCacheSpecs):
            raise TypeError(
                f"kv_cache_groups[{index}].kv_cache_spec is {type(bundle).__name__}; "
                "the DeepSeek-V4 layout needs UniformTypeKVCacheSpecs in every group"
            )
        specs = bundle.kv_cache_specs
        layer_pages_by_group.append([LayerPage(name, specs[name].page_size_bytes) for name in group.layer_names])
    plan = plan_dsv4_kv_tensors(layer_pages_by_group)
    num_blocks = may_override_num_blocks(vllm_config, plan.num_blocks_for(available_memory))
    tensors = [
        KVCacheTensor(size=tensor.page_size_bytes * num_blocks, shared_by=list(tensor.shared_by))
        for tensor in plan.tensors
    ]
    return num_blocks, tensors


PATCH = Patch(
    name="vllm-ascend-dsv4-aggregated-page-size",
    target="vllm_ascend.patch.platform.patch_kv_cache_utils",
    attributes=(_ORIGINAL, _VLLM_BINDING),
    kind=PatchKind.REPLACE,
    # DeepSeek-V4 support (and this target) first shipped in vllm-ascend 0.23.
    requires={"vllm-ascend": ">=0.23.0rc1"},
    guard=UpstreamGuard(
        probe=_aggregates_page_sizes,
        unfixed_if_source_contains=(_FIRST_GROUP_ONLY,),
    ),
    build=lambda ctx: {
        _ORIGINAL: get_kv_cache_config_deepseek_v4,
        _VLLM_BINDING: get_kv_cache_config_deepseek_v4,
    },
    summary="DSv4 KV-cache tensors planned from the page sizes of all groups; empty shared_by tensors skipped",
    why="vllm-ascend plans from group 0's page sizes only, so smaller compressed blocks leave layers without a tensor",
    mirrors="vllm-ascend #10193 (patch_kv_cache_utils: page size aggregated across all KV groups)",
    delete_when="vllm-ascend's _get_kv_cache_config_deepseek_v4 aggregates page sizes over every group itself",
    # Fingerprints of the targets as shipped in vllm-ascend 0.23.0.post1 (vLLM's binding
    # is vllm-ascend's function there, so both attributes have the same source).
    tested_fingerprints={_ORIGINAL: ("41fe29bc2a4d",), _VLLM_BINDING: ("41fe29bc2a4d",)},
)
