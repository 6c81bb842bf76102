"""`SameLayout`: one verdict for a list of tensors, equal to reading each one's shape, strides, dtype and
device in Python, whether torch's C++ tensor guard serves it or not; `chunk_buffers` on top of it.

The guard is torch's own (private) C++ check; it may only ever say yes where the Python check says
yes. Generated lists mix tensors of the example's layout (new ones, views at an offset, in inference
mode, needing grad) with ones that differ in exactly one property, and things that are no plain tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_ascend.kernels import TransferError, chunk_buffers, resolve
from lmcache_ascend.kernels import same_layout
from lmcache_ascend.kernels.same_layout import SameLayout

DTYPES = (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int64)


class _Marked(torch.Tensor):
    pass


def _reference(tensors, example) -> bool:
    described = (example.shape, example.stride(), example.dtype, example.device)
    return all(type(t) is torch.Tensor and (t.shape, t.stride(), t.dtype, t.device) == described for t in tensors)


def _variant(example: torch.Tensor, kind: str, draw_int) -> object:
    """A tensor (or not) related to `example` by `kind`."""
    shape, dtype = tuple(example.shape), example.dtype
    if kind == "new":
        return torch.empty(shape, dtype=dtype)
    if kind == "offset view":  # the same layout inside a larger buffer
        numel = example.numel()
        skip = draw_int(1, 7)
        return torch.empty(numel + skip, dtype=dtype)[skip:].view(shape)
    if kind == "inference":
        with torch.inference_mode():
            return torch.empty(shape, dtype=dtype)
    if kind == "grad":
        if not dtype.is_floating_point:
            return torch.empty(shape, dtype=dtype)
        return torch.empty(shape, dtype=dtype, requires_grad=True)
    if kind == "strides":  # the same shape, its dims laid out in reverse
        if len(shape) < 2 or all(size == 1 for size in shape[:-1]) or shape[-1] == 1:
            return torch.empty(shape, dtype=dtype)  # no other strides for this shape: alike
        return torch.empty(tuple(reversed(shape)), dtype=dtype).permute(*reversed(range(len(shape))))
    if kind == "padded rows":  # the same shape, rows further apart
        if len(shape) < 2:
            return torch.empty(shape[0] * 2, dtype=dtype)[::2] if shape[0] > 1 else torch.empty(shape, dtype=dtype)
        return torch.empty((*shape[:-1], shape[-1] + 1), dtype=dtype)[..., : shape[-1]]
    if kind == "dtype":
        other = DTYPES[(DTYPES.index(dtype) + draw_int(1, len(DTYPES) - 1)) % len(DTYPES)]
        return torch.empty(shape, dtype=other)
    if kind == "shape":
        return torch.empty((*shape[:-1], shape[-1] + 1), dtype=dtype)
    if kind == "rank":
        return example.new_empty((1, *shape))
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind == "subclass":
        return torch.empty(shape, dtype=dtype).as_subclass(_Marked)
    if kind == "number":
        return 3
    return None


KINDS = ("new", "offset view", "inference", "grad", "strides", "padded rows", "dtype", "shape", "rank", "meta",
         "subclass", "number", "none")


@st.composite
def _lists(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank)))
    example = torch.empty(shape, dtype=draw(st.sampled_from(DTYPES)))
    count = draw(st.integers(1, 6))
    # mostly alike lists, so that the guard's yes is exercised as much as its no
    alike = draw(st.booleans())
    kinds = [draw(st.sampled_from(("new", "offset view") if alike else KINDS)) for _ in range(count)]
    tensors = [_variant(example, kind, lambda low, high: draw(st.integers(low, high))) for kind in kinds]
    return example, tensors, kinds


@settings(max_examples=300, deadline=None)
@given(_lists())
def test_the_verdict_is_the_python_checks(case):
    example, tensors, kinds = case
    assert SameLayout(example, len(tensors))(tensors) == _reference(tensors, example), kinds


@settings(max_examples=300, deadline=None)
@given(_lists())
def test_the_guard_alone_never_says_yes_where_python_says_no(case):
    example, tensors, kinds = case
    guard = SameLayout(example, len(tensors))._guard
    if guard is None:
        pytest.skip("this torch has no tensor guard that passes the self-test")
    if guard.check(*tensors):
        assert _reference(tensors, example), kinds


def test_the_guard_says_yes_to_tensors_of_the_layout():
    """The C++ check is what serves an alike list (else the change buys nothing)."""
    example = torch.empty(4, 3, 8, dtype=torch.bfloat16)
    same = SameLayout(example, 16)
    if same._guard is None:
        pytest.skip("this torch has no tensor guard that passes the self-test")
    pool = torch.empty(16 * example.numel() + 5, dtype=torch.bfloat16)
    tensors = [pool[5 + i * example.numel():][: example.numel()].view(4, 3, 8) for i in range(16)]
    assert same._guard.check(*tensors)
    tensors[9] = torch.empty(4, 8, 3, dtype=torch.bfloat16).transpose(1, 2)  # (4, 3, 8), other strides
    assert not same._guard.check(*tensors)
    assert not same(tensors)


def test_another_count_is_refused():
    example = torch.empty(2, 3)
    same = SameLayout(example, 3)
    assert same([torch.empty(2, 3)] * 3)
    assert not same([torch.empty(2, 3)] * 2)
    assert not same([torch.empty(2, 3)] * 4)


def test_an_example_that_is_no_plain_tensor_is_refused():
    with pytest.raises(TypeError, match="allowed: a torch.Tensor"):
        SameLayout(torch.empty(2).as_subclass(_Marked), 1)


@settings(max_examples=150, deadline=None)
@given(_lists())
def test_without_the_guard_the_verdict_is_the_same(case):
    example, tensors, kinds = case
    saved = dict(same_layout._GUARD)
    same_layout._GUARD.update({"class": None, "tested": True})
    try:
        same = SameLayout(example, len(tensors))
        assert same._guard is None
        assert same(tensors) == _reference(tensors, example), kinds
    finally:
        same_layout._GUARD.update(saved)


class _Lenient:
    """A guard that says yes to anything of the right count (as a torch whose guard ignored strides might)."""

    def __init__(self, *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None):
        self.count = len(tensors)

    def check(self, *tensors):
        return len(tensors) == self.count and all(isinstance(t, torch.Tensor) for t in tensors)


class _StridesIgnored(_Lenient):
    def __init__(self, *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None):
        super().__init__(*tensors)
        self.described = [(t.shape, t.dtype) for t in tensors]

    def check(self, *tensors):
        return [(getattr(t, "shape", None), getattr(t, "dtype", None)) for t in tensors] == self.described


class _Failing(_Lenient):
    def __init__(self, *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None):
        raise RuntimeError("not this torch's signature")


@pytest.mark.parametrize("guard", [_Lenient, _StridesIgnored, _Failing])
def test_a_guard_that_fails_the_self_test_is_not_used(monkeypatch, guard):
    import torch._C._dynamo.guards as guards

    monkeypatch.setattr(guards, "TensorGuards", guard, raising=False)
    assert same_layout._guard_class() is None


def test_the_pinned_torch_guard_passes_the_self_test():
    import torch._C._dynamo.guards as guards

    if not hasattr(guards, "TensorGuards"):
        pytest.skip("this torch has no tensor guard")
    assert same_layout._guard_class() is guards.TensorGuards


# ---- chunk_buffers ------------------------------------------------------------------------------------


def _expected(chunks):
    addresses = [chunk.data_ptr() for chunk in chunks]
    return addresses, [chunk.numel() for chunk in chunks], int(np.gcd.reduce(np.asarray(addresses, dtype=np.int64)))


@pytest.mark.parametrize("sizes", [(96,) * 7, (96, 64, 96, 200), (1,) * 3, (96,)],
                         ids=["alike", "mixed sizes", "one byte each", "one chunk"])
@pytest.mark.parametrize("guarded", [True, False], ids=["guard", "python"])
def test_chunk_buffers_describe_every_chunk(monkeypatch, sizes, guarded):
    if not guarded:
        monkeypatch.setitem(same_layout._GUARD, "class", None)
        monkeypatch.setitem(same_layout._GUARD, "tested", True)
    resolve._alike_chunks.clear()
    pool = torch.empty(sum(sizes) + 3, dtype=torch.uint8)
    bounds = np.cumsum((3, *sizes))
    for _ in range(2):  # the second call finds the kept check
        chunks = [pool[int(start):int(end)] for start, end in zip(bounds[:-1], bounds[1:])]
        buffers = chunk_buffers(chunks)
        addresses, numels, gcd = _expected(chunks)
        assert buffers.addresses.tolist() == addresses
        assert buffers.sizes.tolist() == numels
        assert buffers.min_bytes == min(numels) and buffers.address_gcd == gcd
        assert buffers.mapped_host is False and buffers.tensors == tuple(chunks)
    resolve._alike_chunks.clear()


@pytest.mark.parametrize("bad", ["int16", "strided", "two-dimensional", "meta"])
def test_an_odd_chunk_among_alike_ones_is_named(bad):
    resolve._alike_chunks.clear()
    chunks = [torch.empty(64, dtype=torch.uint8) for _ in range(5)]
    chunk_buffers(chunks)  # keeps the check for five 64-byte chunks
    odd = {
        "int16": torch.empty(64, dtype=torch.int16),
        "strided": torch.empty(128, dtype=torch.uint8)[::2],
        "two-dimensional": torch.empty(64, dtype=torch.uint8).view(8, 8),
        "meta": torch.empty(64, dtype=torch.uint8, device="meta"),
    }[bad]
    chunks[3] = odd
    with pytest.raises(TransferError, match=r"chunks\[3\]"):
        chunk_buffers(chunks)
    resolve._alike_chunks.clear()
