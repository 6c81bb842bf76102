"""Whether every tensor of a call has one described layout, checked in one C++ call (`SameLayout`).

A call of LMCache's block op, or a request of the connector, hands over tens of
buffers that must all look alike (shape, strides, dtype, device) for one launch to
move them. Reading those four properties from Python costs about a microsecond a
tensor on a GPU host: of a repeated call's host time, the part that grows with the
buffer count (67 of 147 us for 64 objects on one H100 host). torch ships a
C++ check of exactly these properties for a list of tensors, the one that guards
compiled graphs (`torch._C._dynamo.guards.TensorGuards`): it compares each tensor's
Python type, dispatch keys (device type and layout), device index, dtype,
requires-grad flag, sizes and strides with what it was built from, several times
faster. It is private to torch, so it is used only where it passes a self-test of
these semantics when first needed (else the Python check runs), and only ever to
say yes: a tensor it refuses is looked at again in Python, so a stricter verdict
(another autograd or inference state) costs time, never a wrong answer.

Pure logic: torch only.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SameLayout"]


def _description(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def _guard_class():
    """torch's tensor-list guard where it behaves as `SameLayout` needs, else None (checked once)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except (ImportError, AttributeError):
        return None
    try:
        example = torch.empty(2, 3)
        guard = _build(TensorGuards, example, 2)
        accepted = guard.check(torch.empty(2, 3), example)
        refused = [
            guard.check(example, torch.empty(3, 2).t()),  # the same shape, other strides
            guard.check(example, torch.empty(2, 4)),
            guard.check(example, torch.empty(2, 3, dtype=torch.float64)),
            guard.check(example, torch.empty(6)),
            guard.check(example, example.unsqueeze(0)),
            guard.check(example, [[0.0] * 3] * 2),
        ]
    except Exception:  # noqa: BLE001 - another torch: the Python check serves
        return None
    return TensorGuards if accepted is True and not any(refused) else None


def _build(guard_class, example: torch.Tensor, count: int):
    shape, strides = list(example.shape), list(example.stride())
    return guard_class(*([example] * count), dynamic_dims_sizes=[shape] * count,
                       dynamic_dims_strides=[strides] * count)


_GUARD = {"class": None, "tested": False}


class SameLayout:
    """Whether `count` tensors each have `example`'s shape, strides, dtype and device (and are plain
    `torch.Tensor`s): ``SameLayout(example, count)(tensors)``. Built once per described call and
    kept with what it guards; a call with another number of tensors is refused."""

    __slots__ = ("_described", "_count", "_guard")

    def __init__(self, example: torch.Tensor, count: int):
        if type(example) is not torch.Tensor:
            raise TypeError(f"example is a {type(example).__name__}; allowed: a torch.Tensor")
        self._described, self._count = _description(example), count
        if not _GUARD["tested"]:
            _GUARD["class"], _GUARD["tested"] = _guard_class(), True
        guard_class = _GUARD["class"]
        self._guard = None
        if guard_class is not None and count > 0:
            try:
                self._guard = _build(guard_class, example, count)
            except Exception:  # noqa: BLE001 - a tensor the guard cannot describe: the Python check serves
                self._guard = None

    def __call__(self, tensors: Sequence[object]) -> bool:
        if len(tensors) != self._count:
            return False
        guard = self._guard
        if guard is not None and guard.check(*tensors):
            return True
        described, tensor = self._described, torch.Tensor
        return all(type(t) is tensor and _description(t) == described for t in tensors)
