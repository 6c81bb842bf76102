"""Delays every store copy of LMCache's MP server (LMCache-driven transfer) in the process that runs it.

The align-mode engine tests put this folder on the ``PYTHONPATH`` of LMCache's MP server only
(after tests/engine/ipc_record, whose sitecustomize runs this one). When
``lmcache.v1.multiprocess.modules.lmcache_driven_transfer`` loads,
``LMCacheDrivenTransferModule.store_with_chunk_mask`` (the server's copy of a store's blocks out of
the engine's KV caches; its ``store`` handler calls it) is wrapped to sleep
``LMCACHE_ASCEND_TEST_STORE_DELAY_S`` seconds first: the copy then reads the blocks that long after
the engine submitted the store, as a loaded server would.
"""

from __future__ import annotations

import functools
import os
import time

from tests.engine.after_import import run_after_import

TARGET = "lmcache.v1.multiprocess.modules.lmcache_driven_transfer"
DELAY_ENV = "LMCACHE_ASCEND_TEST_STORE_DELAY_S"


def _delay(module) -> None:
    cls = module.LMCacheDrivenTransferModule
    plain = cls.store_with_chunk_mask
    delay_s = float(os.environ.get(DELAY_ENV, "0.3"))

    @functools.wraps(plain)
    def store_with_chunk_mask(self, *args, **kwargs):
        time.sleep(delay_s)
        return plain(self, *args, **kwargs)

    cls.store_with_chunk_mask = store_with_chunk_mask


run_after_import({TARGET: _delay})
