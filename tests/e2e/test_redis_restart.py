"""A real LMCache engine over a real Redis that restarts: the engine's pooled connections are
all dead, and the first lookup after the restart must still find what the server holds.

Three chunks of the DeepSeek-V4-like caches of `tests.fixtures` are stored through LMCache's
Redis connector (no local CPU cache), the server is shut down and started again on its port
with the same keys (a server that keeps its data across a restart), and the same tokens are
looked up and retrieved into caches poisoned with 0x5A. With ``lmcache-redis-reconnect``
every chunk is found and arrives byte-exact; without it (the control) the lookup meets a
connection from before the restart and finds nothing.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_chunk_seal_stores import NEEDS_REDIS, stored_over_redis
from tests.e2e.test_engine_roundtrip import (  # noqa: F401 - fixtures
    CHUNK,
    NUM_TOKENS,
    _plan,
    _slot_mappings,
    config_and_groups,
    metadata_patch,
)
from tests.fixtures.kv_caches import assert_bytes_equal, dsv4_ascend_kv_caches, expected_after_roundtrip

pytestmark = NEEDS_REDIS
PATCH = "lmcache-redis-reconnect"  # the `patched` fixture's patch


def _restart_keeping_keys(client, port: int):
    """Shut the server down and start it again on `port` holding the same keys; the new process."""
    from tests.engine import faults

    saved = {key: client.dump(key) for key in client.keys(b"*")}
    try:
        client.shutdown(nosave=True)
    except Exception:  # the server drops the connection as it goes
        pass
    server = faults.restart({"redis": port})
    client.connection_pool.disconnect()
    for key, value in saved.items():
        client.restore(key, 0, value)
    return server


def test_after_a_restart_the_first_lookup_finds_every_chunk(patched, metadata_patch, config_and_groups):
    kv_cache_config, kv_groups = config_and_groups
    source, target = dsv4_ascend_kv_caches("random", seed=5), dsv4_ascend_kv_caches("poison")
    slot_mappings = _slot_mappings(kv_groups)
    tokens = torch.arange(NUM_TOKENS)
    restarted = None
    try:
        with stored_over_redis(config_and_groups, source, slot_mappings, tokens) as (engine, client, port):
            restarted = _restart_keeping_keys(client, port)
            assert len(client.keys(b"*kv_bytes")) == NUM_TOKENS // CHUNK
            found = engine.lookup(tokens)
            _plan(engine, target, kv_cache_config, kv_groups)
            retrieved = int(engine.retrieve(tokens, slot_mappings_by_group=slot_mappings).sum())
    finally:
        if restarted is not None:
            restarted.kill()
            restarted.wait()
    if not patched:
        assert found < NUM_TOKENS, "the control found every chunk: the lookup met no connection from before"
        return
    assert found == NUM_TOKENS, f"found {found} of {NUM_TOKENS} tokens after the restart"
    assert retrieved == NUM_TOKENS, f"retrieved {retrieved} of {NUM_TOKENS} tokens after the restart"
    assert_bytes_equal(target.storages, expected_after_roundtrip(source, dsv4_ascend_kv_caches("poison"),
                                                                 slot_mappings, kv_groups, kv_cache_config,
                                                                 NUM_TOKENS, CHUNK))
