"""LMCACHE_ASCEND_TRANSFER_BACKEND reaches the mover of every MultiGroupGPUConnector, however it was built.

LMCache's own ``CreateGPUConnector`` (patched by ``lmcache-gpu-connector-npu``) builds
the connector an engine starts with; the worker's install step then registers the
caches with it. Each connector's mover must run on the backend the flag names, from
the environment or from LMCache's YAML: ``triton`` on this CPU must be refused when
bytes move (proof the mover uses it; the torch reference would move them), ``torch``
must be what the mover holds, and with no flag it is ``auto``.
"""

from __future__ import annotations

import types

import pytest
import torch

from lmcache_ascend.flags import FLAGS
from tests.e2e.test_connector_contract import CHUNK, GEOMETRY, _caches, _memory_obj
from tests.fixtures.kv_caches import LATENT_DIMS
from tests.patching import apply_now

FLAG = "LMCACHE_ASCEND_TRANSFER_BACKEND"
PATCHES = ("lmcache-config-flag-keys", "lmcache-gpu-connector-npu")
PLANE_GROUPS = {"full": (0,), "compressed": (1,)}
SLOTS = [torch.arange(CHUNK, dtype=torch.int64), torch.arange(4, dtype=torch.int64)]


@pytest.fixture
def factory(monkeypatch):
    """LMCache's connector factory with the overlay's patches, and no flag set anywhere."""
    from lmcache_ascend.patches import State, registry

    for flag in FLAGS:
        monkeypatch.delenv(flag.name, raising=False)
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    patches = registry.process_registry()
    for name in PATCHES:
        assert apply_now(patches, name) is State.APPLIED, (name, patches.record(name).reason)
    from lmcache.v1 import gpu_connector

    yield gpu_connector
    for name in reversed(PATCHES):
        patches.revert(name)


def _metadata():
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name="backend-flag", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.uint8, kv_shape=(1, 1, CHUNK, 1, 1), chunk_size=CHUNK,
    )


def _built(factory, config):
    """The connector LMCache's factory builds for vLLM, registered over small two-group caches."""
    from lmcache.utils import EngineType

    from lmcache_ascend.connector.multigroup_connector import MultiGroupGPUConnector
    from lmcache_ascend.kv_worker import plan_kv_caches

    connector = factory.CreateGPUConnector(config, _metadata(), EngineType.VLLM)
    assert isinstance(connector, MultiGroupGPUConnector)  # the CPU build: LMCache has no connector of its own
    layers, planner = plan_kv_caches(_caches(), PLANE_GROUPS, GEOMETRY, CHUNK, backend_dims={"full": LATENT_DIMS})
    connector.register(layers, planner)
    return connector


def _defaults_config():
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)


def _store(connector):
    memory = _memory_obj(connector.get_shape(CHUNK))
    connector.batched_from_gpu([memory], [0], [CHUNK], slot_mappings_by_group=SLOTS)
    return memory


def test_the_environment_flag_names_the_factory_built_movers_backend(factory, monkeypatch):
    monkeypatch.setenv(FLAG, "torch")
    connector = _built(factory, _defaults_config())
    assert (connector.backend, connector.mover.backend) == ("torch", "torch")
    assert int((_store(connector).raw_tensor != 0xA5).sum()) > 0

    # triton cannot run on this CPU: a store refuses, naming it, where the reference would move.
    monkeypatch.setenv(FLAG, "triton")
    connector = _built(factory, _defaults_config())
    assert connector.mover.backend == "triton"
    with pytest.raises(Exception, match="backend 'triton' cannot run on device cpu"):
        _store(connector)


def test_without_the_flag_the_factory_built_mover_is_auto(factory):
    connector = _built(factory, _defaults_config())
    assert (connector.backend, connector.mover.backend) == ("auto", "auto")
    assert int((_store(connector).raw_tensor != 0xA5).sum()) > 0


def test_lmcache_yaml_names_the_factory_built_movers_backend(factory, tmp_path):
    from lmcache.v1.config import LMCacheEngineConfig

    path = tmp_path / "lmcache.yaml"
    path.write_text(f"chunk_size: {CHUNK}\nascend_transfer_backend: triton\n")
    connector = _built(factory, LMCacheEngineConfig.from_file(str(path)))
    assert connector.mover.backend == "triton"
    with pytest.raises(Exception, match="backend 'triton' cannot run on device cpu"):
        _store(connector)


def test_the_install_step_gives_the_engines_connector_its_backend(factory):
    """The worker's install step keeps the factory's connector and hands it the backend it read."""
    from lmcache_ascend.connector.install import plan_for_engine

    config = _defaults_config()
    connector = _built(factory, config)
    engine = types.SimpleNamespace(config=config, gpu_connector=connector, metadata=_metadata())
    installed = plan_for_engine(engine, _caches(), PLANE_GROUPS, GEOMETRY, bundle_multi_spec=False,
                                backend="torch", backend_dims={"full": LATENT_DIMS})
    assert installed is connector and connector.mover.backend == "torch"
