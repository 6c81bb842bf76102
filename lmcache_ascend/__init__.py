"""lmcache-ascend: version-gated patches for LMCache on vLLM and vllm-ascend.

Importing the package activates it (unless the import is only on the way to a
``python -m lmcache_ascend...`` command, which decides for itself).  Activation
validates every flag and registers post-import hooks; each patch is applied when
its target module is imported, or at once if it already is.
"""

from __future__ import annotations

import sys
import threading

__version__ = "0.1.0"
__all__ = ["activate", "deactivate", "__version__"]

_activation_lock = threading.Lock()

# The installed listing command ([project.scripts] in pyproject.toml).
CLI_SCRIPT = "lmcache-ascend-patches"


def activate(source: str = "explicit") -> None:
    """Validate the flags and arm every patch; idempotent and thread-safe.

    Raises `lmcache_ascend.flags.FlagError` naming any flag with a bad value; warns once
    about each set ``LMCACHE_ASCEND_*`` variable that is no flag (a misspelt one).
    """
    from lmcache_ascend import flags
    from lmcache_ascend.patches import registry

    with _activation_lock:
        flag_values = flags.validate_all()
        flags.report_unknown_variables()
        registry.process_registry().activate(flag_values, source)


def deactivate() -> None:
    """Disarm every patch hook and revert every applied patch (mainly for tests)."""
    from lmcache_ascend.patches import registry

    with _activation_lock:
        registry.process_registry().deactivate()


def _started_as_cli() -> bool:
    """`python -m lmcache_ascend.patches` imports this package while sys.argv[0] is still "-m",
    the installed `lmcache-ascend-patches` script while it is the script's path; the CLI then
    checks the flags and activates (or not) by its own options."""
    started_as = getattr(sys, "argv", [""])[:1] or [""]
    return started_as[0] == "-m" or started_as[0].rsplit("/", 1)[-1] == CLI_SCRIPT


if not _started_as_cli():
    activate(source="import")
