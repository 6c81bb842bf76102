"""LMCache 0.5.6's torch baseline of the KV ops, and our ops, behind one call interface.

In the test stacks the baseline is LMCache itself. On the GPU machine (no LMCache
there) `load_from_sources(folder)` runs LMCache's own baseline files
(`torch_ops/mem_kernels.py`, `mp_mem_kernels.py`, `_tensor_from_ptr.py`, copied
unmodified from the wheel) over a stand-in for the few LMCache modules they
import: enums with LMCache's values and format facts from
`lmcache_ascend.layouts` (which `test_format_facts_match_lmcache`
checks against LMCache's spec classes).
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types

import torch

from lmcache_ascend.layouts import paged_layer_shape
from lmcache_ascend.op_surface.formats import FORMATS


class Adapter:
    """`fmt(value)` gives the format enum the ops take; the ops are attributes."""

    def __init__(self, module, fmt, desc_type):
        self._module = module
        self.fmt = fmt
        self.PageBufferShapeDesc = desc_type

    def __getattr__(self, name):
        return getattr(self._module, name)


def ours(fmt=None) -> Adapter:
    import lmcache_ascend.ops as ops

    return Adapter(ops, fmt or (lambda value: value), ops.PageBufferShapeDesc)


def lmcache_baseline() -> Adapter:
    from lmcache.lmcache_native import EngineKVFormat, PageBufferShapeDesc
    from lmcache.v1.platform import torch_ops

    return Adapter(torch_ops, EngineKVFormat, PageBufferShapeDesc)


def _spec_class(facts):
    class Spec:
        is_cross_layer = facts.cross_layer
        is_kv_list = facts.kv_list
        is_layer_list = not (facts.cross_layer or facts.kv_list)
        is_mla = facts.mla
        is_hnd = facts.hnd
        is_fused_packed = facts.fused
        is_two_major = facts.two_major
        is_pbs_fused = facts.pbs_fused
        is_kv_second_tuple = facts.kv_tuple
        is_single_kv = facts.single_kv

        @classmethod
        def paged_layer_shape(cls, nb, bs, nh, hs):
            return paged_layer_shape(facts, nb, bs, nh, hs)

    return Spec


def load_from_sources(folder: str) -> Adapter:
    """LMCache's baseline files from `folder`, over stand-ins for the LMCache modules they import."""
    def module(name, **attributes):
        created = types.ModuleType(name)
        created.__path__ = []
        created.__dict__.update(attributes)
        sys.modules[name] = created
        return created

    engine_format = enum.IntEnum("EngineKVFormat", {facts.name: value for value, facts in FORMATS.items()})
    direction = enum.IntEnum("TransferDirection", {"H2D": 0, "D2H": 1})

    class PageBufferShapeDesc:
        def __init__(self):
            self.kv_size = self.nl = self.nb = self.bs = self.nh = self.hs = self.element_size = 0
            self.block_stride_elems = 0
            self.dtype = None

    class PointerOps:
        @staticmethod
        def tensor_from_ptr(ptr, shape, dtype, device):
            numel = 1
            for size in shape:
                numel *= size
            if device.index is None and device.type != "cpu":
                device = torch.device(device.type, getattr(torch, device.type).current_device())
            storage = torch._C._construct_storage_from_data_pointer(ptr, device, numel * dtype.itemsize)
            return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)

    module("lmcache")
    module("lmcache.lmcache_native", EngineKVFormat=engine_format, TransferDirection=direction,
           PageBufferShapeDesc=PageBufferShapeDesc)
    module("lmcache.v1")
    module("lmcache.v1.platform", resolve_device_ops=lambda device_type: PointerOps)
    module("lmcache.v1.platform.ops_types", PageBufferShapeDesc=PageBufferShapeDesc)
    module("lmcache.v1.platform.torch_ops")
    specs = {value: _spec_class(facts) for value, facts in FORMATS.items()}
    module("lmcache.v1.platform.torch_ops._kv_format", _format_spec=lambda fmt: specs[int(fmt)])
    loaded = {}
    for name in ("_tensor_from_ptr", "mem_kernels", "mp_mem_kernels"):
        full = f"lmcache.v1.platform.torch_ops.{name}"
        spec = importlib.util.spec_from_file_location(full, f"{folder}/{name}.py")
        loaded[name] = importlib.util.module_from_spec(spec)
        sys.modules[full] = loaded[name]
        spec.loader.exec_module(loaded[name])
    merged = types.SimpleNamespace(**{k: v for m in loaded.values() for k, v in vars(m).items()})
    return Adapter(merged, engine_format, PageBufferShapeDesc)
