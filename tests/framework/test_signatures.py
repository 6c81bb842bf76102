"""`compat.signatures.parameter`: one argument read where the call put it."""

from __future__ import annotations

import types

import pytest

from lmcache_ascend.compat.signatures import call_arguments, parameter


def plain(tracker, block_size, chunk=256, *, load_spec=None):
    return (tracker, block_size, chunk, load_spec)


def positional_only(first, /, second=2):
    return (first, second)


def with_star_args(first, *rest, last=9):
    return (first, rest, last)


class Owner:
    def method(self, scheduler_output, extra=None):
        return (self, scheduler_output, extra)


CALLS = [
    (("t", 16), {}),
    (("t",), {"block_size": 16}),
    ((), {"tracker": "t", "block_size": 16, "chunk": 64, "load_spec": "L"}),
    (("t", 16, 128), {"load_spec": None}),
]


@pytest.mark.parametrize("args, kwargs", CALLS)
def test_reads_agree_with_a_full_binding_for_every_parameter(args, kwargs):
    bound = call_arguments(plain, args, kwargs).arguments
    for name in ("tracker", "block_size", "chunk", "load_spec"):
        assert parameter(plain, name).read(args, kwargs) == bound[name]


@pytest.mark.parametrize("args, kwargs", CALLS)
def test_a_kept_parameter_answers_as_the_lookups_by_name(args, kwargs):
    # A wrapper keeps the located parameter across calls; it is located once per function.
    block_size = parameter(plain, "block_size")
    assert parameter(plain, "block_size") is block_size and block_size.function is plain
    assert block_size.position == 1
    assert block_size.read(args, kwargs) == parameter(plain, "block_size").read(args, kwargs)
    bound = types.MethodType(Owner.method, Owner())
    assert parameter(bound, "scheduler_output").function is Owner.method
    assert parameter(bound, "scheduler_output").position == 0  # self is bound


def test_bound_methods_skip_their_first_parameter():
    owner = Owner()
    bound = types.MethodType(Owner.method, owner)
    assert parameter(bound, "scheduler_output").read(("out",), {}) == "out"
    assert parameter(bound, "scheduler_output").read((), {"scheduler_output": "kw"}) == "kw"
    assert parameter(bound, "extra").read(("out",), {}) is None


def test_positional_only_and_star_args():
    assert parameter(positional_only, "first").read((1,), {}) == 1
    assert parameter(positional_only, "second").read((1,), {"second": 5}) == 5
    # A parameter after *args is keyword-only: never read from the positional arguments.
    assert parameter(with_star_args, "last").read((1, 2, 3), {}) == 9
    assert parameter(with_star_args, "last").read((1, 2, 3), {"last": 4}) == 4


def test_unknown_parameter_and_missing_argument_are_refused_naming_them():
    with pytest.raises(TypeError, match=r"has no parameter 'block_sise'; its parameters: \['tracker', 'block_size'"):
        parameter(plain, "block_sise").read(("t", 16), {})
    with pytest.raises(TypeError, match="plain\\(\\) missing argument 'block_size'"):
        parameter(plain, "block_size").read(("t",), {})
