"""lmcache-ascend: version-gated patches for LMCache on vLLM and vllm-ascend.

Importing the package activates it (unless the import is on the way to the package's
own command, ``python -m lmcache_ascend.patches`` or ``lmcache-ascend-patches``, which
decides for itself).  Activation validates every flag and registers post-import hooks;
each patch is applied when its target module is imported, or at once if it already is.

`activate` raises on a bad flag.  The ways in that nobody calls by hand (this import,
the wheel's start-up hook, vLLM's plugin entry point: `activate_on_start`) follow one
rule instead, so that a process that never uses LMCache is not stopped by a flag it
does not need, and one that uses LMCache never runs without the overlay:

- a bad lmcache-ascend flag: the overlay stays off in this process, one warning says
  why, and the first import of LMCache (the ``lmcache`` package, or vLLM's LMCache
  connector modules) raises the error, naming the flag, its value and what is allowed;
  where LMCache is already imported, it is raised at once;
- LMCache's configuration file (``LMCACHE_CONFIG_FILE``, LMCache's variable) that
  can't be read: the file only holds values for LMCache-facing patches, so the overlay
  activates without it, warns, and the same first import of LMCache raises the error.

vLLM's plugin loader swallows any exception raised while it imports an entry point's
module, but not one raised by the entry point's function: the import of this package
never raises, and `lmcache_ascend._plugin.register` is where the error surfaces.
"""

from __future__ import annotations

import sys
import threading

__version__ = "0.1.0"
__all__ = ["activate", "deactivate", "__version__"]

_activation_lock = threading.Lock()

# The installed listing command ([project.scripts] in pyproject.toml) and the modules that run it.
CLI_SCRIPT = "lmcache-ascend-patches"
CLI_MODULES = frozenset({"lmcache_ascend.patches", "lmcache_ascend.patches.__main__"})

# The error that keeps LMCache from running in this process, or None (see the module's docstring).
_refusal: Exception | None = None


def activate(source: str = "explicit") -> None:
    """Validate the flags and arm every patch; idempotent and thread-safe.

    Raises `lmcache_ascend.flags.FlagError` naming any flag with a bad value; warns once
    about each set ``LMCACHE_ASCEND_*`` variable that is no flag (a misspelt one).
    """
    from lmcache_ascend import flags

    with _activation_lock:
        _arm(flags.validate_all(), source)
        _refuse_lmcache(None)


def activate_on_start(source: str, importing: str | None = None, may_raise: bool = True) -> None:
    """Activate as the import, the start-up hook or vLLM's plugin does: by the rule of the
    module's docstring.  Raises a `FlagError` only where LMCache is in use (already imported,
    or `importing`, the module whose import is starting, is LMCache's), and `may_raise`."""
    from lmcache_ascend import flags

    with _activation_lock:
        try:
            values, file_problem = flags.values_for_activation()
            if file_problem is not None:  # the hooks that refuse LMCache come before the patches' own
                _refuse_lmcache(file_problem, active=True)
            _arm(values, source)
        except flags.FlagError as error:
            _refuse_lmcache(error, active=False)
        else:
            if file_problem is None:
                _refuse_lmcache(None)
        refusal = _refusal
        if refusal is not None and may_raise and _lmcache_in_use(importing):
            raise type(refusal)(str(refusal))


def activation_problem() -> Exception | None:
    """The error that keeps LMCache from running in this process (a bad flag, an unreadable
    LMCache configuration file), or None."""
    return _refusal


def _arm(flag_values: dict, source: str) -> None:
    from lmcache_ascend import flags
    from lmcache_ascend.patches import registry

    flags.report_unknown_variables()
    registry.process_registry().activate(flag_values, source)


def deactivate() -> None:
    """Disarm every patch hook and revert every applied patch (mainly for tests)."""
    from lmcache_ascend.patches import registry

    with _activation_lock:
        registry.process_registry().deactivate()


def lmcache_modules() -> tuple[str, ...]:
    """The modules whose import means LMCache is in use: the ``lmcache`` package, and every
    patch target that is LMCache's or one of vLLM's LMCache connector modules."""
    from lmcache_ascend.patches.catalogue import CATALOGUE

    facing = {
        entry.target for entry in CATALOGUE
        if entry.target.partition(".")[0] == "lmcache" or entry.target.rpartition(".")[2].startswith("lmcache")
    }
    return ("lmcache", *sorted(facing))


def _lmcache_in_use(importing: str | None = None) -> bool:
    modules = lmcache_modules()
    if importing is not None and (importing.partition(".")[0] == "lmcache" or importing in modules):
        return True
    return any(name in sys.modules for name in modules)


def _refuse_lmcache(error: Exception | None, active: bool = False) -> None:
    """Make `error` the one every later import of LMCache raises (None: allow LMCache again).
    The first refusal registers the hooks and logs one warning."""
    global _refusal
    first = error is not None and _refusal is None
    _refusal = error
    if not first:
        return
    from lmcache_ascend.compat import import_hooks

    for name in lmcache_modules():
        if name not in sys.modules:  # an imported one is checked by the caller
            import_hooks.register_post_import_hook(name, _refuse_lmcache_import, every_execution=True)
    import logging

    state = "" if active else "not active in this process: "
    logging.getLogger("lmcache_ascend").warning(
        "lmcache-ascend: %s%s (where this process uses LMCache, it stops with this error)", state, error
    )


def _refuse_lmcache_import(module: object) -> None:
    refusal = _refusal
    if refusal is not None:
        raise type(refusal)(str(refusal))


def _started_as_cli() -> bool:
    """Whether this import is on the way to the package's own command, which checks the flags
    and activates (or not) by its own options.

    Once ``python -m`` runs a module, ``__main__`` is that module and its spec names it; while
    runpy still imports the module's parent packages (this package among them), ``__main__`` is
    the interpreter's bare one, without a spec, and runpy's frames hold the module's name.  The
    installed script runs as ``__main__`` without a spec too, under its own name."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None:
        return main_spec.name in CLI_MODULES
    from lmcache_ascend.compat import interpreter

    if interpreter.runpy_is_starting(CLI_MODULES):
        return True
    started_as = getattr(sys, "argv", [""])[:1] or [""]
    return (started_as[0] or "").rsplit("/", 1)[-1] == CLI_SCRIPT


if not _started_as_cli():
    activate_on_start("import", may_raise=False)
