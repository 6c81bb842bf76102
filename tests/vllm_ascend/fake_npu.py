"""Stand-ins for the Ascend hardware modules, so vllm-ascend's real source imports on CPU.

Only hardware is faked: ``torch_npu`` (and the CANN-side packages it brings),
``torch.npu``, and ``vllm_ascend._build_info`` (written at build time from
the SoC found by CANN). Every attribute of a fake is another fake; names
that look like classes are real (empty) classes so annotations such as
``torch.npu.Stream | None`` and subclassing work. Nothing here computes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

HARDWARE_PACKAGES = ("torch_npu", "acl", "tbe", "te", "atb", "mindie_turbo", "triton_ascend", "torchair")


class FakeHardwareModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value: object = type(name, (), {"__init__": lambda self, *args, **kwargs: None, "__module__": self.__name__})
        else:
            value = FakeHardwareModule(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return FakeHardwareModule(f"{self.__name__}()")


class _FakeHardwareFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HARDWARE_PACKAGES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = FakeHardwareModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        if module.__name__ == "torch_npu":
            import torch

            # The real torch_npu registers the "npu" device module on torch.
            if not hasattr(torch, "npu"):
                torch.npu = FakeHardwareModule("torch.npu")


_FINDER = _FakeHardwareFinder()


def install(sdist_root: str, device_type: str = "A3") -> None:
    """Put vllm-ascend's unpacked source first on sys.path and install the fakes."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    if sdist_root not in sys.path:
        sys.path.insert(0, sdist_root)
    build_info = types.ModuleType("vllm_ascend._build_info")
    build_info.__device_type__ = device_type
    build_info.__soc_version__ = "ASCEND910_9391"
    sys.modules.setdefault("vllm_ascend._build_info", build_info)
    import torch

    if not hasattr(torch, "npu"):
        torch.npu = FakeHardwareModule("torch.npu")
