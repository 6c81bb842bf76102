"""`kernels.launcher`: the direct launches give the JIT entry's bytes, and a relaunch moves new buffers.

`launch` keeps a compiled kernel under the caller's key and, on CUDA, calls its launcher
directly; a Triton whose private API differs falls back to the compiled kernel's runner,
then to the JIT entry. Each path copies a poisoned buffer here and every element is
compared; `relaunch_of` makes the same launch over other buffers and refuses addresses
aligned otherwise. The direct launches exist on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the launcher is Triton's")
from lmcache_ascend.kernels import launcher  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches are made on CUDA only")
POISON = -1234567


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(source, target, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < count
        tl.store(target + offsets, tl.load(source + offsets, mask=mask) + 1, mask=mask)

    return copy


def _launch(kernel, source, target):
    count = source.numel()
    arguments = (source, target, count)
    signature = (source.data_ptr() % 16 == 0, target.data_ptr() % 16 == 0, launcher.integer_type(count))
    pointers = {0: source.data_ptr(), 1: target.data_ptr()}
    launch = (kernel, (-(-count // 128), 1, 1), arguments, pointers, signature, (("BLOCK", 128),), 4, source.device)
    launcher.launch(*launch)
    return launch


@cuda
def test_every_launch_path_moves_every_element():
    kernel = _copy_kernel()
    source = torch.arange(1000, dtype=torch.int64, device="cuda")
    try:
        for paths in ({"raw": True, "direct": True}, {"raw": False, "direct": True}, {"raw": False, "direct": False}):
            launcher._raw_launch["enabled"], launcher._direct_launch["enabled"] = paths["raw"], paths["direct"]
            for _ in range(3):  # the first call compiles through the JIT entry; later ones take the path
                target = torch.full_like(source, POISON)
                _launch(kernel, source, target)
                assert torch.equal(target, source + 1), paths
    finally:
        launcher._raw_launch["enabled"] = launcher._direct_launch["enabled"] = True


@cuda
@pytest.mark.parametrize("raw", [True, False], ids=["raw launcher", "compiled kernel's runner (as on an NPU)"])
def test_a_relaunch_moves_other_buffers_and_refuses_other_alignments(raw):
    kernel = _copy_kernel()
    source = torch.arange(1000, dtype=torch.int64, device="cuda")
    launch = _launch(kernel, source, torch.empty_like(source))
    launch = _launch(kernel, source, torch.empty_like(source))  # the first compiled it through the JIT entry
    launcher._raw_launch["enabled"] = raw
    try:
        relaunch = launcher.relaunch_of(*launch, positions=((0,), (1,)))
        assert relaunch is not None and (relaunch._raw is not None) == raw
        other_source = torch.arange(5000, 6000, dtype=torch.int64, device="cuda")
        other_target = torch.full_like(other_source, POISON)
        assert relaunch(other_source.data_ptr(), other_target.data_ptr())
        assert torch.equal(other_target, other_source + 1)
        # 8 bytes past a 16-byte boundary: the kernel was compiled for aligned pointers
        backing = torch.full((1001,), POISON, dtype=torch.int64, device="cuda")
        assert not relaunch(other_source.data_ptr(), backing[1:].data_ptr())
        torch.cuda.synchronize()
        assert (backing == POISON).all(), "a refused relaunch launched"
    finally:
        launcher._raw_launch["enabled"] = True


@cuda
def test_a_runner_that_refuses_integer_addresses_turns_runner_relaunches_off(caplog):
    kernel = _copy_kernel()
    source = torch.arange(1000, dtype=torch.int64, device="cuda")
    launch = _launch(kernel, source, torch.empty_like(source))
    launch = _launch(kernel, source, torch.empty_like(source))
    launcher._raw_launch["enabled"] = False
    try:
        relaunch = launcher.relaunch_of(*launch, positions=((0,), (1,)))

        def refusing(*values):
            raise TypeError("Pointer argument must be either uint64 or have data_ptr method")

        relaunch._runner = refusing
        target = torch.full_like(source, POISON)
        assert not relaunch(source.data_ptr(), target.data_ptr())
        assert not launcher._runner_relaunch["enabled"]
        assert "whole path" in caplog.text
        assert launcher.relaunch_of(*launch, positions=((0,), (1,))) is None
        torch.cuda.synchronize()
        assert (target == POISON).all()
    finally:
        launcher._raw_launch["enabled"] = launcher._runner_relaunch["enabled"] = True


def test_nothing_launched_directly_has_no_relaunch():
    kernel = object()  # never launched: no compiled kernel under any key
    assert launcher.relaunch_of(kernel, (1, 1, 1), (), {}, (), (), 4, torch.device("cpu"), positions=()) is None


def test_integer_types_are_tritons():
    assert [launcher.integer_type(v) for v in (0, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63)] == [
        "i32", "i32", "i64", "i32", "i64", "i64", "u64"]


@cuda
def test_launch_hooks_set_by_the_user_see_raw_launches_with_their_metadata():
    import triton

    runtime = triton.knobs.runtime
    if not hasattr(runtime.launch_enter_hook, "add"):
        pytest.skip("this Triton keeps a launch hook as one function, not a chain")
    kernel = _copy_kernel()
    source = torch.arange(1000, dtype=torch.int64, device="cuda")
    _launch(kernel, source, torch.empty_like(source))  # compiled through the JIT entry
    seen = []

    def entered(metadata):
        seen.append(("enter", metadata))

    def left(metadata):
        seen.append(("exit", metadata))

    runtime.launch_enter_hook.add(entered)
    runtime.launch_exit_hook.add(left)
    try:
        target = torch.full_like(source, POISON)
        _launch(kernel, source, target)
    finally:
        runtime.launch_enter_hook.remove(entered)
        runtime.launch_exit_hook.remove(left)
    assert torch.equal(target, source + 1)
    assert [which for which, _ in seen] == ["enter", "exit"]
    assert all(metadata is not None for _, metadata in seen)
    seen.clear()
    _launch(kernel, source, torch.empty_like(source))
    assert seen == []  # removed hooks are not called


def test_a_hook_chain_with_nothing_in_it_is_no_hook():
    class Chain:  # the shape of triton.knobs.HookChain
        def __init__(self, calls):
            self.calls = calls

    def hook(metadata):
        return None

    assert launcher._set_hook(None) is None
    assert launcher._set_hook(Chain([])) is None
    chain = Chain([hook])
    assert launcher._set_hook(chain) is chain
    assert launcher._set_hook(hook) is hook  # an older Triton's single function
