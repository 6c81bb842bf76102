"""The LMCache MP adapter API vLLM's builtin MP connector speaks, on LMCache's newer one (import-free).

vLLM's builtin fallback (``LMCacheMPConnectorUpstream``, vLLM 0.19 - 0.33) builds
LMCache's MP adapters the way LMCache 0.4.x took them: a seven-field
``ParallelStrategy(use_mla, kv_world_size, kv_worker_id, actual_world_size,
actual_worker_id, tp_size, pp_size)``, ``LMCacheMPSchedulerAdapter(server_url=...)``
and, on the worker, ``adapter.use_mla`` / ``adapter.is_first_rank_of_pp_group``.
LMCache 0.5.6 takes ``ParallelStrategy(mla_only, vllm_world_size,
vllm_worker_id, tp_size, pp_size, n_servers, dcp_size)`` (the KV world size and
rank are derived), ``server_urls: list[str]``, and names the MLA store rule
``is_kv_writer``. Read positionally, vLLM's seven values land in the wrong
fields; the scheduler adapter refuses ``server_url``.

The translations below take vLLM's call as it is and build LMCache's objects;
the KV world size and rank vLLM computed must equal those LMCache derives, or
the translation refuses, naming both.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

__all__ = ["OLD_STRATEGY_FIELDS", "new_parallel_strategy", "one_server_url", "worker_adapter_with_old_names"]

OLD_STRATEGY_FIELDS = (
    "use_mla", "kv_world_size", "kv_worker_id", "actual_world_size", "actual_worker_id", "tp_size", "pp_size",
)
_OLD_STRATEGY = inspect.Signature(
    [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in OLD_STRATEGY_FIELDS]
)


def new_parallel_strategy(strategy_cls: type, args: tuple, kwargs: dict) -> Any:
    """LMCache's ``ParallelStrategy`` for a call written for the seven-field layout (one server)."""
    try:
        old = _OLD_STRATEGY.bind(*args, **kwargs).arguments
    except TypeError as error:
        raise TypeError(
            f"ParallelStrategy{args + tuple(kwargs.items())!r}: expected the fields {OLD_STRATEGY_FIELDS} "
            f"of vLLM's builtin MP connector ({error})"
        ) from None
    strategy = strategy_cls(
        mla_only=bool(old["use_mla"]),
        vllm_world_size=int(old["actual_world_size"]),
        vllm_worker_id=int(old["actual_worker_id"]),
        tp_size=int(old["tp_size"]),
        pp_size=int(old["pp_size"]),
        n_servers=1,
    )
    derived = (strategy.kv_world_size, strategy.kv_worker_id)
    given = (int(old["kv_world_size"]), int(old["kv_worker_id"]))
    if derived != given:
        raise ValueError(
            f"vLLM's MP connector computed KV world size / rank {given} but LMCache derives {derived} "
            f"from {old}; refusing a strategy that would address other KV pieces"
        )
    return strategy


def one_server_url(adapter_cls: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``adapter_cls(..., server_urls=[url])`` for a call that passes ``server_url=url``."""
    if "server_url" in kwargs:
        kwargs = dict(kwargs)
        kwargs["server_urls"] = [kwargs.pop("server_url")]
    return adapter_cls(*args, **kwargs)


def worker_adapter_with_old_names(adapter_cls: type) -> type:
    """A subclass of LMCache's worker adapter that also answers the old names vLLM reads.

    ``use_mla and not is_first_rank_of_pp_group`` (vLLM: skip the store) is
    ``not is_kv_writer`` (LMCache: with MLA only the first TP rank of a stage stores).
    """
    return type(
        adapter_cls.__name__,
        (adapter_cls,),
        {
            "__module__": __name__,
            "__doc__": f"{adapter_cls.__qualname__} answering use_mla / is_first_rank_of_pp_group (lmcache-ascend).",
            "use_mla": property(lambda self: self.parallel_strategy.mla_only),
            "is_first_rank_of_pp_group": property(lambda self: self.is_kv_writer),
        },
    )
