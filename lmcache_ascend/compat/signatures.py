"""Reading what a callable accepts and the arguments of a call, through third-party wrappers.

A wrapper made with ``functools.wraps`` leads to the function it wraps (``__wrapped__``); one
made without it shows only ``(*args, **kwargs)``, from which whether it takes a keyword cannot be
known: that is reported as None ("can't tell"), never guessed as "no".
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

_PARAMETER = inspect.Parameter


def accepts_keyword(function: Callable, name: str) -> bool | None:
    """True / False whether `function` takes keyword `name`; None when a wrapper hides its signature."""
    try:
        parameters = inspect.signature(inspect.unwrap(function)).parameters
    except (TypeError, ValueError):
        return None
    if name in parameters and parameters[name].kind is not _PARAMETER.POSITIONAL_ONLY:
        return True
    if any(p.kind is _PARAMETER.VAR_KEYWORD for p in parameters.values()) and not any(
        p.kind in (_PARAMETER.POSITIONAL_OR_KEYWORD, _PARAMETER.KEYWORD_ONLY)
        for p in parameters.values() if p.name != "self"
    ):
        return None  # (*args, **kwargs): an opaque wrapper
    return False


def call_arguments(wrapped: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The arguments of the call ``wrapped(*args, **kwargs)`` by parameter name, defaults applied,
    so a wrapper reads what it needs without restating upstream's signature.  Edit
    ``.arguments`` and call ``wrapped(*bound.args, **bound.kwargs)`` to pass them on."""
    function = getattr(wrapped, "__func__", wrapped)
    bound = _signature(function, function is not wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def parameter(wrapped: Callable, name: str) -> "Parameter":
    """Parameter `name` of `wrapped`, located once per function: ``.read(args, kwargs)`` is its value
    in a call (its default if not passed) without binding the whole signature; a wrapper on a
    per-request path keeps it (with ``function``, to tell a call of another function)."""
    function = getattr(wrapped, "__func__", wrapped)
    return _parameter(function, function is not wrapped, name)


class Parameter:
    """Where one parameter of a function arrives in a call (`parameter`)."""

    __slots__ = ("function", "name", "position", "by_keyword", "default")

    def __init__(self, function: Callable, bound: bool, name: str) -> None:
        parameters = list(_signature(function, bound).parameters.values())
        found = next((p for p in parameters if p.name == name), None)
        if found is None:
            raise TypeError(
                f"{getattr(function, '__qualname__', function)!r} has no parameter {name!r}; "
                f"its parameters: {[p.name for p in parameters]}"
            )
        self.function, self.name, self.default = function, name, found.default
        self.by_keyword = found.kind is not _PARAMETER.POSITIONAL_ONLY
        # Parameters before it are all positional (a `*args` ends them): the position is the same in every call.
        positional = found.kind in (_PARAMETER.POSITIONAL_ONLY, _PARAMETER.POSITIONAL_OR_KEYWORD)
        self.position = parameters.index(found) if positional else None

    def read(self, args: tuple, kwargs: dict) -> object:
        if self.position is not None and len(args) > self.position:
            return args[self.position]
        if self.by_keyword and self.name in kwargs:
            return kwargs[self.name]
        if self.default is _PARAMETER.empty:
            raise TypeError(f"{getattr(self.function, '__qualname__', self.function)}() missing argument {self.name!r}")
        return self.default


@functools.lru_cache(maxsize=None)
def _signature(function: Callable, bound: bool) -> inspect.Signature:
    """`function`'s signature, less the first parameter of a bound method (worked out once)."""
    signature = inspect.signature(function)
    if bound:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


# Keyed by the plain function, never by a bound method (a new one each call, holding its instance).
_parameter = functools.lru_cache(maxsize=None)(Parameter)
