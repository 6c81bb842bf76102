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


def call_arguments(wrapped: Callable, args: tuple, kwargs: dict) -> "inspect.BoundArguments | PlainBinding":
    """The arguments of the call ``wrapped(*args, **kwargs)`` by parameter name, defaults
    applied, so a wrapper reads what it needs without restating upstream's signature.

    Edit ``.arguments`` and call ``wrapped(*bound.args, **bound.kwargs)`` to pass them on.
    """
    function = getattr(wrapped, "__func__", wrapped)
    plan = _plan(function, function is not wrapped)
    if isinstance(plan, _PlainPlan):
        return plan.bind(args, kwargs)
    bound = plan.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def call_argument(wrapped: Callable, args: tuple, kwargs: dict, name: str) -> object:
    """The value parameter `name` has in the call ``wrapped(*args, **kwargs)`` (its default if
    not passed), read where the call put it without binding the whole signature: wrappers
    that need one or two arguments call this on every scheduler step."""
    return parameter(wrapped, name).read(args, kwargs)


def parameter(wrapped: Callable, name: str) -> "Parameter":
    """Parameter `name` of `wrapped`, located once per function: its ``read(args, kwargs)``
    answers as `call_argument` does, for any call of the same function.  A wrapper on a
    per-request path keeps it (with ``function``, to tell a call of another function) rather
    than look it up by name on every call."""
    function = getattr(wrapped, "__func__", wrapped)
    key = (function, function is not wrapped, name)
    found = _PARAMETERS.get(key)
    if found is None:
        found = _PARAMETERS[key] = Parameter(function, function is not wrapped, name)
    return found


class Parameter:
    """Where one parameter of a function arrives in a call: its position among the
    positional arguments (None: keyword only), whether a keyword may carry it, its default."""

    __slots__ = ("function", "name", "position", "by_keyword", "default")

    def __init__(self, function: Callable, bound: bool, name: str) -> None:
        parameters = list(inspect.signature(function).parameters.values())[1 if bound else 0 :]
        found = next((p for p in parameters if p.name == name), None)
        if found is None:
            raise TypeError(
                f"{getattr(function, '__qualname__', function)!r} has no parameter {name!r}; "
                f"its parameters: {[p.name for p in parameters]}"
            )
        self.function, self.name, self.default = function, name, found.default
        self.by_keyword = found.kind is not inspect.Parameter.POSITIONAL_ONLY
        self.position = None
        if found.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            self.position = parameters.index(found)
        # Parameters before it are all positional ones (a `*args` ends them), so the
        # position counts the same in every call.

    def read(self, args: tuple, kwargs: dict) -> object:
        if self.position is not None and len(args) > self.position:
            return args[self.position]
        if self.by_keyword and self.name in kwargs:
            return kwargs[self.name]
        if self.default is inspect.Parameter.empty:
            raise TypeError(f"{getattr(self.function, '__qualname__', self.function)}() missing argument {self.name!r}")
        return self.default


_PARAMETERS: dict[tuple[Callable, bool, str], Parameter] = {}


class PlainBinding:
    """`call_arguments` of a signature without ``*args``, ``**kwargs`` or positional-only
    parameters: what ``inspect.BoundArguments`` gives after ``apply_defaults`` (``arguments``
    by name, ``args`` = every positional-or-keyword value in order, ``kwargs`` = the
    keyword-only ones), bound in a few dict operations: wrappers call it on every
    scheduler step, where ``Signature.bind`` cost tens of microseconds."""

    __slots__ = ("arguments", "_plan")

    def __init__(self, arguments: dict, plan: "_PlainPlan") -> None:
        self.arguments = arguments
        self._plan = plan

    @property
    def args(self) -> tuple:
        return tuple(self.arguments[name] for name in self._plan.positional)

    @property
    def kwargs(self) -> dict:
        return {name: self.arguments[name] for name in self._plan.keyword_only}


class _PlainPlan:
    __slots__ = ("name", "positional", "keyword_only", "names", "defaults")

    def __init__(self, name: str, signature: inspect.Signature) -> None:
        parameters = signature.parameters.values()
        self.name = name
        self.positional = tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.keyword_only = tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
        self.names = frozenset(self.positional + self.keyword_only)
        self.defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}

    def bind(self, args: tuple, kwargs: dict) -> PlainBinding:
        if len(args) > len(self.positional):
            raise TypeError(f"{self.name}() takes {len(self.positional)} positional arguments but {len(args)} were given")
        arguments = dict(zip(self.positional, args))
        for key, value in kwargs.items():
            if key not in self.names:
                raise TypeError(f"{self.name}() got an unexpected keyword argument {key!r}")
            if key in arguments:
                raise TypeError(f"{self.name}() got multiple values for argument {key!r}")
            arguments[key] = value
        if len(arguments) < len(self.names):
            for key, default in self.defaults.items():
                arguments.setdefault(key, default)
            missing = [key for key in self.positional + self.keyword_only if key not in arguments]
            if missing:
                raise TypeError(f"{self.name}() missing required arguments: {', '.join(map(repr, missing))}")
        return PlainBinding(arguments, self)


# Wrappers call `call_arguments` on every scheduler step: how to bind each function's
# calls (its signature, less the first parameter of a bound method) is worked out once.
_PLANS: dict[tuple[Callable, bool], "inspect.Signature | _PlainPlan"] = {}


def _plan(function: Callable, bound: bool) -> "inspect.Signature | _PlainPlan":
    plan = _PLANS.get((function, bound))
    if plan is None:
        signature = inspect.signature(function)
        if bound:  # the first parameter is taken
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        plain = all(
            p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            for p in signature.parameters.values()
        )
        plan = _PLANS[(function, bound)] = (
            _PlainPlan(getattr(function, "__qualname__", repr(function)), signature) if plain else signature
        )
    return plan
