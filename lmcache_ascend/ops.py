"""The kernel surface LMCache's own platform layer loads on an Ascend host.

LMCache 0.5.x resolves `NpuDeviceOps` there, whose `ensure_native()` imports this
module and binds every public callable and type of it over LMCache's torch
baseline (`DeviceOps.bind_native`). So this module exposes exactly the ops that
run on the project's transfer kernel (Triton: CUDA, Ascend via triton-ascend;
the torch reference elsewhere or with LMCACHE_ASCEND_TRANSFER_BACKEND=torch),
with LMCache's signatures and semantics, and the one type they take. Nothing
else is public here: never a re-export of LMCache's fallbacks, which would
replace LMCache's own defaults with themselves at best. Importing it is cheap
(torch and the project's kernel descriptions; Triton is imported on first use)
and needs no NPU; it imports nothing from LMCache, which imports it.
"""

from lmcache_ascend.op_surface import transfer_ops as _surface
from lmcache_ascend.op_surface.transfer_ops import *  # noqa: F403 - exactly the surface's __all__

__all__ = list(_surface.__all__)
