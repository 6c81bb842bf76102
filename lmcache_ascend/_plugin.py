"""vLLM `vllm.general_plugins` entry point: every vLLM process (API server, engine
core, workers) calls `register`, also when started with an environment in which
the .pth hook was turned off.

vLLM's loader logs and swallows an exception raised while it imports this module,
and the process then runs without the overlay; it does not catch one raised by
`register` itself.  So the package's import never raises a flag error, and
`register` raises it here where the process uses LMCache (see
`lmcache_ascend.activate_on_start`); elsewhere the first import of LMCache does.
Either way the process first says, once, in vLLM's log, what state the overlay is in
(`lmcache_ascend.start_report`).
"""


def register() -> None:
    import lmcache_ascend
    from lmcache_ascend import start_report

    start_report.join_vllm_logging()
    try:
        lmcache_ascend.activate_on_start("vllm-plugin")
    finally:
        start_report.report_once()
