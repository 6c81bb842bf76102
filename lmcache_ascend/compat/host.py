"""What kind of machine this is, for patches that serve one kind only (`Patch.host`), asked once
the target is imported (torch is loaded by then)."""

from __future__ import annotations

import importlib
import importlib.util

def not_an_npu_host() -> str | None:
    """None on an Ascend NPU host without CUDA; otherwise why not (imports an installed torch_npu)."""
    import torch

    if torch.cuda.is_available():
        return "a CUDA host: LMCache's own CUDA ops serve it"
    if getattr(torch, "npu", None) is None and importlib.util.find_spec("torch_npu") is not None:
        try:
            importlib.import_module("torch_npu")
        except Exception as error:  # noqa: BLE001 - a broken CANN install is not an NPU host
            return f"no NPU: importing torch_npu raised {type(error).__name__}: {error}"
    npu = getattr(torch, "npu", None)
    if npu is None:
        return "no NPU: torch has no npu device module (torch_npu is not installed)"
    try:
        available = bool(npu.is_available())
    except Exception as error:  # noqa: BLE001 - cannot tell means no
        return f"no NPU: torch.npu.is_available() raised {type(error).__name__}: {error}"
    return None if available else "no NPU: torch.npu.is_available() is False"


def without_cuda() -> str | None:
    """None on a host where torch has no usable CUDA device (CPU-only, NPU); otherwise why not."""
    import torch

    if torch.cuda.is_available():
        return "a CUDA host: torch.cuda serves it as upstream expects"
    return None
