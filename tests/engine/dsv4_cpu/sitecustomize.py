"""What the engine tests add to every process of a DeepSeek-V4 engine on vLLM's CPU build.

The harness puts this folder on the ``PYTHONPATH`` of an engine run whose spec
names it (``engine_hooks``), after tests/engine/ipc_record, whose
sitecustomize runs this one. vLLM's CPU worker processes are spawned, so each
process patches for itself, as each module loads: the torch stand-ins for the
Triton kernels of DeepSeek-V4's attention-metadata builders
(`tests.engine.dsv4_cpu.triton_stand_ins`), the seeded-weight model loader
(`tests.engine.dsv4_cpu.seeded_weights`) and, where the spec asks, the CPU
platform's AMX decision (`tests.engine.dsv4_cpu.amx_decision`).
"""

from __future__ import annotations

from tests.engine.after_import import run_after_import


def _hooks() -> dict:
    from tests.engine.dsv4_cpu import amx_decision, seeded_weights, triton_stand_ins

    hooks = dict(triton_stand_ins.PATCHED_MODULES)
    hooks["vllm.model_executor.model_loader"] = lambda module: seeded_weights.register()
    hooks["vllm.platforms.cpu"] = amx_decision.patch
    return hooks


run_after_import(_hooks())
