"""Launching a Triton kernel with the least host work: the one module that uses Triton's private API.

A kernel's JIT entry re-derives the compiled kernel's key from every argument on every
call (tens of microseconds), which is most of a small transfer's cost. `launch` keeps
the compiled kernel under the key the caller already knows (kernel, device, constexprs,
warps, the arguments' alignments and integer widths) and, on CUDA, calls its launcher
directly with the current raw stream and plain integer addresses (elsewhere, an NPU through
triton-ascend, the compiled kernel's own runner). `relaunch_of` turns a launch made before
into a `Relaunch`: the same arguments but the data addresses, for a caller that knows the
rest has not changed. Both reach into a compiled kernel's
attributes (`run`, `function`, `packed_metadata`, `launch_metadata`) and `triton.knobs`,
which Triton does not promise; a Triton without them, or whose launcher binds
arguments otherwise, takes the compiled kernel's own runner, then the JIT entry, with
one warning (`tests/kernels/test_launcher.py` runs all three and compares every byte).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton

__all__ = ["Relaunch", "integer_type", "launch", "relaunch_of"]

logger = logging.getLogger(__name__)


def integer_type(value: int) -> str:
    """The type Triton gives an unspecialized int argument (part of the compiled kernel's key)."""
    if -(2**31) <= value < 2**31:
        return "i32"
    if 2**63 <= value < 2**64:
        return "u64"
    return "i64"


# Compiled kernels by (kernel, device, constexprs, warps, signature): the key
# Triton's JIT derives, whose entry re-derives it on every call (tens of
# microseconds); a hit launches directly.
_compiled: dict[tuple, object] = {}
_direct_launch = {"enabled": True}
# For CUDA, the compiled kernel's launcher itself, called with the current raw
# stream and plain integer addresses for the pointers (Triton's launcher takes an
# int as the address as is; a tensor costs a data_ptr() call and a driver
# pointer query per argument). Keyed like `_compiled`.
_raw_launchers: dict[tuple, "_RawLauncher"] = {}
_raw_launch = {"enabled": True}


@dataclass(frozen=True)
class _RawLauncher:
    """What a direct launch of a compiled CUDA kernel needs (as the compiled kernel's own runner passes it)."""

    compiled: object
    run: object
    function: object
    packed_metadata: object
    current_stream: object  # device index -> raw stream
    current_device: object  # () -> device index


def _raw_launcher(compiled, device: torch.device) -> _RawLauncher | None:
    """The raw launcher of a compiled CUDA kernel, or None."""
    if device.type != "cuda" or not _raw_launch["enabled"]:
        return None
    try:
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        if not hasattr(triton, "knobs") or not hasattr(compiled, "launch_metadata"):
            return None
        return _RawLauncher(compiled, compiled.run, compiled.function, compiled.packed_metadata,
                            torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice)
    except Exception:  # noqa: BLE001 - an older/newer Triton: the runner path stays
        return None


def launch(kernel, grid, arguments, pointers, signature, constexprs, num_warps, device) -> None:
    """Launch `kernel` on the 3-D `grid`; `pointers` maps argument positions to their integer addresses;
    `constexprs`: (name, value) pairs in the kernel's order."""
    key = (kernel, device, constexprs, num_warps, signature)
    raw = _raw_launchers.get(key) if _raw_launch["enabled"] else None
    if raw is not None:
        try:
            _run_raw(raw, grid, (*(pointers.get(position, value) for position, value in enumerate(arguments)),
                                 *(value for _, value in constexprs)))
            return
        except (TypeError, ValueError, AttributeError) as error:  # argument binding, before any launch
            logger.warning("raw Triton launch failed (%s); using the compiled kernel's runner", error)
            _raw_launch["enabled"] = False
            _raw_launchers.clear()
    compiled = _compiled.get(key) if _direct_launch["enabled"] else None
    if compiled is not None:
        try:
            # A compiled kernel wants all 3 grid dims and every argument, constexprs included.
            compiled[grid](*arguments, *(value for _, value in constexprs))
            return
        except (TypeError, IndexError, AttributeError) as error:  # argument binding, before any launch
            # A Triton build whose compiled-kernel call differs: use the JIT entry from now on.
            logger.warning("direct Triton launch failed (%s); using the JIT entry", error)
            _direct_launch["enabled"] = False
            _compiled.clear()
    compiled = kernel[grid](*arguments, **dict(constexprs), num_warps=num_warps)
    # The interpreter returns no compiled kernel; only a real one is cached.
    if compiled is not None and hasattr(compiled, "run") and _direct_launch["enabled"]:
        _compiled[key] = compiled
        raw = _raw_launcher(compiled, device)
        if raw is not None:
            _raw_launchers[key] = raw


def _run_raw(raw: _RawLauncher, grid: tuple[int, int, int], values) -> None:
    """Launch through the raw launcher on the current device's current stream (as Triton's own
    runner does), passing what that runner passes minus its per-call lookups. The launch metadata
    is only ever read by the launch hooks, so it is made only where a hook is set."""
    stream = raw.current_stream(raw.current_device())
    runtime = triton.knobs.runtime
    enter, leave = _set_hook(runtime.launch_enter_hook), _set_hook(runtime.launch_exit_hook)
    metadata = None if enter is None and leave is None else raw.compiled.launch_metadata(grid, stream, *values)
    raw.run(grid[0], grid[1], grid[2], stream, raw.function, raw.packed_metadata, metadata, enter, leave, *values)


def _set_hook(hook):
    """`hook`, or None where calling it would call nothing: newer Triton keeps each launch hook as a
    chain (`knobs.HookChain`) that is never None, and its launcher calls even an empty one, after
    the metadata made for it (about 3 us of a 12 us launch on an H100 host, Triton 3.6)."""
    if hook is None or getattr(hook, "calls", True):
        return hook
    return None


def relaunch_of(kernel, grid, arguments, pointers, signature, constexprs, num_warps, device, *,
                positions: tuple[tuple[int, ...], ...]) -> "Relaunch | None":
    """The launch `launch` made with these arguments, as a `Relaunch` whose addresses go to
    `positions` (per address, the arguments that carry it), or None where no compiled kernel
    was kept for it (not launched yet, the interpreter, or a Triton whose compiled kernels
    could not be called directly)."""
    key = (kernel, device, constexprs, num_warps, signature)
    raw = _raw_launchers.get(key) if _raw_launch["enabled"] else None
    compiled = _compiled.get(key) if _direct_launch["enabled"] and _runner_relaunch["enabled"] else None
    if raw is None and compiled is None:
        return None
    values = [pointers.get(position, value) for position, value in enumerate(arguments)]
    values.extend(value for _, value in constexprs)
    # The buffers whose addresses stay in the relaunch (tables) live as long as it does: a cache
    # that lets them go must not leave it pointing at memory given to something else.
    targets = {position for where in positions for position in where}
    kept = tuple(arguments[position] for position in pointers if position not in targets)
    return Relaunch(raw, None if raw is not None else compiled[grid], grid, tuple(values), positions, kept)


# A relaunch through a compiled kernel's own runner (where there is no raw launcher: an NPU
# through triton-ascend) hands it integer addresses, which its launcher takes as pointers as
# Triton's does; a build that refuses them turns these relaunches off, once.
_runner_relaunch = {"enabled": True}


class Relaunch:
    """A launch made before, made again over other buffers with nothing looked up or checked.

    Everything but the data addresses (tables, grid, compiled kernel, every scalar) is
    the original launch's, and the tensors behind its fixed addresses are kept alive with
    it; each new address goes to the arguments at its `positions`.
    So a caller may use it only where the original's checks hold for the new buffers
    by construction (same shapes, strides, dtypes, devices). An address whose alignment
    modulo 16 or integer width differs from the original's is refused (the call returns
    False and launches nothing): the kernel was compiled, and its element widths chosen,
    for those. What it saves is a call's host work (tens of microseconds), which is most
    of what a small transfer costs. On CUDA it calls the raw launcher (`launch`'s fastest
    path); elsewhere the compiled kernel's runner. A launcher that refuses the arguments
    (before launching anything) turns that kind of relaunch off with one warning and
    the call returns False: the caller then takes its whole path.
    """

    __slots__ = ("_raw", "_runner", "_grid", "_values", "_targets", "_classes", "_kept")

    def __init__(self, raw: "_RawLauncher | None", runner, grid: tuple[int, int, int], values: tuple,
                 positions: tuple[tuple[int, ...], ...], kept: tuple = ()):
        self._raw, self._runner, self._grid, self._values = raw, runner, grid, list(values)
        self._kept = kept  # what the fixed addresses point into
        self._targets = tuple((position, which) for which, where in enumerate(positions) for position in where)
        self._classes = tuple(_address_class(values[where[0]]) for where in positions)

    def fits(self, *addresses: int) -> bool:
        """Whether these addresses are aligned as the original launch's were."""
        return tuple(map(_address_class, addresses)) == self._classes

    def __call__(self, *addresses: int) -> bool:
        if tuple(map(_address_class, addresses)) != self._classes:
            return False
        return self.launch_fitting(*addresses)

    def launch_fitting(self, *addresses: int) -> bool:
        """The launch over addresses the caller has checked with `fits`."""
        values = self._values.copy()
        for position, which in self._targets:
            values[position] = addresses[which]
        raw = self._raw
        if raw is None:
            return self._run_through_runner(values)
        if not _raw_launch["enabled"]:
            return False
        try:
            _run_raw(raw, self._grid, values)
        except (TypeError, ValueError, AttributeError) as error:  # argument binding, before any launch
            logger.warning("raw Triton relaunch failed (%s); such calls take their whole path from now on", error)
            _raw_launch["enabled"] = False
            _raw_launchers.clear()
            return False
        return True

    def _run_through_runner(self, values: list) -> bool:
        if not _runner_relaunch["enabled"]:
            return False
        try:
            self._runner(*values)
        except (TypeError, ValueError, AttributeError, IndexError) as error:  # argument binding, before any launch
            logger.warning("relaunching a compiled Triton kernel with integer addresses failed (%s); such calls "
                           "take their whole path from now on", error)
            _runner_relaunch["enabled"] = False
            return False
        return True


def _address_class(address: int) -> int:
    """What a compiled launch assumed of an address: its alignment modulo 16 and the integer type Triton
    gives it (`integer_type`: i32 below 2**31, i64 below 2**63, u64 above), as one number."""
    return (address & 15) | (0 if address < 2**31 else 16 if address < 2**63 else 32)
