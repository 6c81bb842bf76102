"""Reading what a callable accepts, through third-party wrappers.

Guards ask "does upstream's function take keyword X?". A wrapper made with
``functools.wraps`` leads to the function it wraps (``__wrapped__``); one made
without it shows only ``(*args, **kwargs)``, from which the answer cannot be
known: that is reported as None ("can't tell"), never guessed as "no".
"""

from __future__ import annotations

import inspect
from typing import Callable


def accepts_keyword(function: Callable, name: str) -> bool | None:
    """True / False whether `function` takes keyword `name`; None when a wrapper hides its signature."""
    try:
        signature = inspect.signature(inspect.unwrap(function))
    except (TypeError, ValueError):
        return None
    parameters = signature.parameters
    if name in parameters and parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY:
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()) and not any(
        p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        for p in parameters.values()
        if p.name != "self"
    ):
        return None  # (*args, **kwargs): an opaque wrapper
    return False


def with_keyword_only(signature: inspect.Signature, name: str, default: object) -> inspect.Signature:
    """`signature` plus a keyword-only parameter `name` (before any ``**kwargs``)."""
    parameters = list(signature.parameters.values())
    extra = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
    at = len(parameters)
    if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1
    return signature.replace(parameters=parameters[:at] + [extra] + parameters[at:])


def call_arguments(wrapped: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The arguments of the call ``wrapped(*args, **kwargs)`` by parameter name, defaults
    applied, so a wrapper reads what it needs without restating upstream's signature.

    Edit ``.arguments`` and call ``wrapped(*bound.args, **bound.kwargs)`` to pass them on.
    """
    function = getattr(wrapped, "__func__", wrapped)
    signature = _signature(function, function is not wrapped)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


# Wrappers call this on every scheduler step: the signature, less the first
# parameter of a bound method, is worked out once per function.
_SIGNATURES: dict[tuple[Callable, bool], inspect.Signature] = {}


def _signature(function: Callable, bound: bool = False) -> inspect.Signature:
    signature = _SIGNATURES.get((function, bound))
    if signature is None:
        signature = inspect.signature(function)
        if bound:  # the first parameter is taken
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        _SIGNATURES[(function, bound)] = signature
    return signature
