"""LMCache 0.4.5's MP server module with the overlay's patches, on a host without CUDA (stack A).

The server module imports cupy at module level; cupy (a CUDA library) is
replaced by a stub in a fresh interpreter so the module imports here. What is
checked is what the server checks at start: every handler's annotations
against the protocol's payload and response classes (LMCache's message queue
refuses to start otherwise), with the patches in and, as a control, with the
protocol patched but the engine not. Store and retrieve themselves need CUDA:
test_mp_server_cuda.py.
"""

from __future__ import annotations

import json

import pytest

from lmcache_ascend.compat.versions import installed_version
from tests import stack

stack.only_with_lmcache_04("the per-group MP server patch")

_CODE = """
import json, sys, types
cupy = types.ModuleType("cupy")
cupy.cuda = types.SimpleNamespace(Stream=object, ExternalStream=object)
sys.modules["cupy"] = cupy  # a CUDA library: a stub on a host without CUDA
import lmcache_ascend
from lmcache_ascend.patches import registry
from lmcache.v1.multiprocess import server
from lmcache.v1.multiprocess.mq import MessageQueueServer
from lmcache.v1.multiprocess.protocol import RequestType

def accepted():
    engine = object.__new__(server.MPCacheEngine)
    return {name: MessageQueueServer._inspect_handler_signature(None, RequestType[name], getattr(engine, method))
            for name, method in (("REGISTER_KV_CACHE", "register_kv_cache"), ("STORE", "store"),
                                 ("RETRIEVE", "retrieve"))}

from lmcache_ascend.patches.lmcache.mp_server_per_group import ENGINE
from tests.patching import apply_now
# The catalogue's patch requires cupy-cuda13x, which the stub does not install: the same patch
# without that requirement, in a registry of its own.
engine_registry = registry.Registry([ENGINE.replace(requires={"lmcache": ENGINE.requires["lmcache"]})])
names = ("lmcache-mp-server-protocol", "lmcache-mp-server-layer-groups")
process = registry.process_registry()
report = {"states": {n: process.record(n).state.value for n in names}}
report["states"][ENGINE.name] = apply_now(engine_registry, ENGINE.name).value
report["catalogue_engine"] = process.record(ENGINE.name).reason
report["patched"] = accepted()
engine_registry.revert(ENGINE.name)
report["engine_reverted"] = accepted()
print("REPORT" + json.dumps(report))
"""


CUPY = "cupy-cuda13x"  # the distribution the catalogue's engine patch requires


@pytest.fixture(scope="module")
def report():
    from tests.conftest import run_fresh_python

    result = run_fresh_python(_CODE, env={"LMCACHE_LOG_LEVEL": "ERROR"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT")]
    assert lines, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT"):])


@pytest.mark.skipif(
    installed_version(CUPY) is not None, reason=f"{CUPY} is installed here: the catalogue's patch is not missing it"
)
def test_catalogue_engine_patch_names_the_missing_cupy(report):
    assert report["catalogue_engine"] == f"{CUPY} is not installed"


def test_patched_handlers_match_the_patched_protocol(report):
    assert set(report["states"].values()) == {"applied"}, report
    assert report["patched"] == {"REGISTER_KV_CACHE": True, "STORE": True, "RETRIEVE": True}
    # Control: upstream's handlers against the per-group protocol are refused by the server.
    assert report["engine_reverted"] == {"REGISTER_KV_CACHE": False, "STORE": False, "RETRIEVE": False}
