"""Every kernel the package launches compiles for Ascend (A2 and A5) to HIVM, moving data by DMA.

Runs only where triton-ascend's backend and ascendnpu-ir import (the ascend stack). Each
launch is recorded from the package's own launch code (`launches.py`), compiled stage by
stage (`_compile.py`) up to bishengir-compile's hand-off to hivmc (CANN's, not run here), and
the HIVM module is read: a data-moving kernel must have global->UB and UB->global DMA and no
1-element view of a data argument (element-at-a-time moves).
"""

from __future__ import annotations

import pytest

from tests.ascend import _compile

pytestmark = pytest.mark.skipif(_compile.available() is not None, reason=str(_compile.available()))


def _launches():
    if _compile.available() is not None:
        return []
    from tests.ascend.launches import record_launches

    return record_launches()


_RECORDED = _launches()
_CASES = [(launch, _compile.A2) for launch in _RECORDED] + \
         [(launch, _compile.A5) for launch in _RECORDED if launch.name in _compile.A5_KEYS]


def test_every_entry_kernel_is_recorded():
    # `whole_rows_kernel` is not among them: it is never launched on an NPU (`whole_rows_layout`).
    assert {launch.kernel.__name__ for launch in _RECORDED} == {"_paged_chunk_kernel", "_paged_chunks_kernel",
                                                                "_expand_kernel"}
    assert len(_RECORDED) == 13


@pytest.mark.parametrize("launch,arch", _CASES, ids=[f"{arch}-{launch.name}" for launch, arch in _CASES])
def test_kernel_compiles_to_hivm_with_dma(launch, arch, tmp_path):
    compiled = _compile.compile_kernel(launch.kernel, launch.arguments, launch.constexprs, launch.num_warps, arch,
                                       tmp_path)
    assert compiled.reached == list(_compile.STAGES), f"{launch.name} on {arch}: {compiled.error}"
    path = _compile.data_path(compiled.hivm, compiled.kernel, compiled.pointer_params, launch.data_params)
    assert path.gm_to_ub >= 1 and path.ub_to_gm >= 1, f"{launch.name} on {arch}: no DMA ({path})"
    assert not path.scalar_data_accesses, f"{launch.name} on {arch}: element-at-a-time data moves:\n" + \
        "\n".join(path.scalar_data_accesses[:4])
