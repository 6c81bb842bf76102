"""vLLM `vllm.general_plugins` entry point: every vLLM process (API server, engine
core, workers) calls `register`, also when started with an environment in which
the .pth hook was turned off.

vLLM's loader logs and swallows an exception raised while it imports this module,
and the process then runs without the overlay; it does not catch one raised by
`register` itself.  So the package's import never raises a flag error, and
`register` raises it here where the process uses LMCache (see
`lmcache_ascend.activate_on_start`); elsewhere the first import of LMCache does.
"""


def register() -> None:
    import lmcache_ascend

    lmcache_ascend.activate_on_start("vllm-plugin")
