"""Let vLLM's CPU platform decide for DeepSeek-V4 as it decides on a CPU with AMX tiles.

``CpuPlatform.check_and_update_config`` keeps prefix caching (and chunked
prefill) on for DeepSeek-V4 only where ``torch.cpu._is_amx_tile_supported()``:
its sparse-MLA, indexer and compressor kernels are AMX-backed there. Where
the engine-test spec sets ``LMCACHE_ASCEND_TEST_DSV4_AMX_DECISION=1``, the
platform sees AMX tiles while it decides, and only then: every kernel still
dispatches on the CPU it runs on (reporting AMX to the kernels themselves
stops the engine with an illegal instruction on a CPU without it). The tests
that use it first check that vLLM's own prefix reuse gives the cold prefill's
outputs on the CPU at hand, so that nothing they conclude rests on kernels
that do not support a cached prefix there.
"""

from __future__ import annotations

import os

ENV = "LMCACHE_ASCEND_TEST_DSV4_AMX_DECISION"


def patch(module) -> None:
    if os.environ.get(ENV) != "1":
        return
    import torch

    platform = module.CpuPlatform
    plain = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        tiles = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return plain(cls, vllm_config)
        finally:
            torch.cpu._is_amx_tile_supported = tiles

    platform.check_and_update_config = classmethod(check_and_update_config)
