"""Start-up hook of lmcache-ascend, imported by ``lmcache_ascend_autoload.pth``.

Python runs ``.pth`` import lines while ``site`` is still setting up, so this
module does almost nothing then: it uses the standard library only, imports
neither vLLM, LMCache, torch nor ``lmcache_ascend``, and installs one
meta-path finder.  That finder waits for the first import of a package the
overlay patches; only then, when ``site`` has long finished and ``sys.path``
is final, does it import ``lmcache_ascend`` and call ``activate()``, which in
turn registers post-import hooks for the patch targets.

``LMCACHE_ASCEND_AUTOLOAD=0`` turns the hook off.  Anything that goes wrong is
printed to stderr and never stops the interpreter or the user's import, with one
exception: a bad lmcache-ascend flag where the process uses LMCache (the import
that fired the hook is LMCache's, or LMCache is loaded already).  That import
then raises the flag error, as `lmcache_ascend.activate_on_start` decides: LMCache
must not run silently without the overlay.
"""

import os
import sys

_TRIGGER_PACKAGES = frozenset({"vllm", "lmcache", "vllm_ascend"})
_DISABLED_VALUES = frozenset({"0", "false", "no", "off"})


class _ActivateOnFirstImport:
    """Meta-path finder that activates the overlay once, then does nothing.

    It stays in ``sys.meta_path`` afterwards: removing a finder while the import
    system is looping over that list would make it skip the next finder.
    """

    done = False

    def find_spec(self, fullname, path=None, target=None):
        if self.done or fullname.partition(".")[0] not in _TRIGGER_PACKAGES:
            return None
        _ActivateOnFirstImport.done = True
        try:
            import lmcache_ascend

            lmcache_ascend.activate_on_start("autoload", importing=fullname)
        except Exception as error:  # never break the user's import, but for LMCache without the overlay
            flags = sys.modules.get("lmcache_ascend.flags")
            if flags is not None and isinstance(error, flags.FlagError):
                raise
            print(f"lmcache-ascend: autoload did not activate: {error}", file=sys.stderr)
        return None  # let the regular finders import the package


def install():
    """Called from the .pth line; cheap and idempotent."""
    if os.environ.get("LMCACHE_ASCEND_AUTOLOAD", "1").strip().lower() in _DISABLED_VALUES:
        return
    if any(isinstance(f, _ActivateOnFirstImport) for f in sys.meta_path):
        return
    if any(name.partition(".")[0] in _TRIGGER_PACKAGES for name in list(sys.modules)):
        # A target package is already loaded (an unusual start-up): activate now.
        _ActivateOnFirstImport().find_spec("vllm")
        return
    sys.meta_path.insert(0, _ActivateOnFirstImport())
