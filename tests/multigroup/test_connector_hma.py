"""SupportsHMA on LMCache's and vLLM's real in-process connector classes."""

from __future__ import annotations

import importlib

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA, supports_hma
from vllm.config import KVTransferConfig
from vllm.v1.request import Request, RequestStatus

from lmcache_ascend.patches import State, registry
from tests.fixtures.kv_cache_configs import dsv4_cuda_kv_cache_config
from tests.multigroup.scheduler_driver import make_connector_impl
from tests.patching import apply_now

REGISTRY = registry.process_registry()
CASES = [
    ("lmcache-connector-supports-hma", "lmcache.integration.vllm.lmcache_connector_v1", "LMCacheConnectorV1Dynamic"),
    (
        "vllm-lmcache-connector-supports-hma",
        "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
        "LMCacheConnectorV1",
    ),
]


@pytest.mark.parametrize("patch_name, module_name, class_name", CASES)
def test_connector_becomes_supports_hma_and_reverts(patch_name, module_name, class_name):
    cls = getattr(importlib.import_module(module_name), class_name)
    original_bases = cls.__bases__
    assert not supports_hma(cls)  # upstream on both stacks lacks it
    assert apply_now(REGISTRY, patch_name) is State.APPLIED, REGISTRY.record(patch_name).reason
    try:
        assert supports_hma(cls) and issubclass(cls, SupportsHMA)
        assert cls.__bases__[: len(original_bases)] == original_bases
        assert "request_finished_all_groups" not in vars(cls)  # comes from the added base
    finally:
        assert REGISTRY.revert(patch_name) is State.REVERTED
    assert cls.__bases__ == original_bases and not supports_hma(cls)


def _vllm_accepts_under_hma(config: KVTransferConfig) -> bool:
    """The check vLLM makes before creating a connector with the hybrid manager on."""
    if hasattr(KVConnectorFactory, "supports_hma_config"):  # vLLM 0.23: config + factory
        return KVConnectorFactory.supports_hma_config(config)
    # vLLM 0.18: KVConnectorFactory.create_connector tests the class itself.
    return supports_hma(KVConnectorFactory.get_connector_class(config))


def test_vllm_factory_accepts_lmcache_connector_under_hma_once_patched():
    config = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    assert not _vllm_accepts_under_hma(config)
    assert apply_now(REGISTRY, "vllm-lmcache-connector-supports-hma") is State.APPLIED
    try:
        assert _vllm_accepts_under_hma(config)
    finally:
        REGISTRY.revert("vllm-lmcache-connector-supports-hma")


@pytest.mark.parametrize("patch_name, module_name, class_name", CASES)
def test_request_finished_all_groups_forwards_to_the_adapter(patch_name, module_name, class_name):
    cls = getattr(importlib.import_module(module_name), class_name)
    assert apply_now(REGISTRY, patch_name) is State.APPLIED
    try:
        impl = make_connector_impl(dsv4_cuda_kv_cache_config(), connector_class=cls)
        connector = impl._parent
        request = Request(request_id="done", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(), pooling_params=None)
        request.status = RequestStatus.FINISHED_STOPPED
        block_ids = ([1], [2, 3], [4], [5, 6, 7], [8])
        assert connector.request_finished_all_groups(request, block_ids) == impl.request_finished(request, [1])
        assert connector.request_finished_all_groups(request, block_ids) == (False, None)
    finally:
        REGISTRY.revert(patch_name)


def test_native_adapter_is_refused_for_multi_group_models():
    """use_native selects vLLM's bundled adapter (group 0 only): fail before anything starts."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    from lmcache_ascend.multigroup.connector_state import MultiGroupConfigError

    native = KVTransferConfig(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config={"use_native": True}
    )
    # A real VllmConfig can't be built without a device; the check reads only this field.
    vllm_config = SimpleNamespace(kv_transfer_config=native)
    assert apply_now(REGISTRY, "vllm-lmcache-connector-supports-hma") is State.APPLIED
    try:
        with pytest.raises(MultiGroupConfigError, match="use_native=True .* this model has 5 KV-cache groups"):
            LMCacheConnectorV1(
                vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config=dsv4_cuda_kv_cache_config().kv_cache_config
            )
    finally:
        REGISTRY.revert("vllm-lmcache-connector-supports-hma")
