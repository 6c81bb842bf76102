"""What every vLLM process says about the overlay as it starts, at vLLM's own log level.

vLLM sets up handlers for its own ``vllm`` logger only, so the overlay's lines (the
keyed model name, a patch that failed) would reach nobody at INFO inside an engine.
`join_vllm_logging` hands the overlay's records to vLLM's handlers, at vLLM's level.
`report_once` then logs one line per process: active (how many patches are armed) or
off and why; a setting that keeps LMCache from starting has its own warning. (vLLM's
front end loads its plugins before it sets up its logging: its line goes out with the
overlay's next one there, if any.) The
worker that registers its KV caches adds the KV-cache groups moved and skipped and the
chunk key in force (`lmcache_ascend.connector.install.start_line`).
"""

from __future__ import annotations

import logging

LOGGER_NAME = "lmcache_ascend"
_reported: list[bool] = []


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers vLLM's logger has when the record is made, at vLLM's
    level. vLLM may set them up after this process loaded its plugins: an INFO record made
    before that waits (a few at most) and goes out ahead of the next record, a warning goes
    where Python puts one nobody handles. Where a root handler exists the record reaches it by
    propagation instead."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        vllm_logger = logging.getLogger("vllm")
        if not vllm_logger.handlers:
            if record.levelno >= logging.WARNING:
                if logging.lastResort is not None:
                    logging.lastResort.handle(record)
            elif len(self.waiting) < _MAX_WAITING:
                self.waiting.append(record)
            return
        waiting, self.waiting = self.waiting, []
        for held in (*waiting, record):
            if held.levelno >= vllm_logger.getEffectiveLevel():
                for handler in vllm_logger.handlers:
                    if held.levelno >= handler.level:
                        handler.handle(held)


_MAX_WAITING = 16


def join_vllm_logging() -> None:
    """Make the overlay's INFO lines reach vLLM's log in a vLLM process (once per process)."""
    ours = logging.getLogger(LOGGER_NAME)
    if any(isinstance(handler, _ToVllmHandlers) for handler in ours.handlers):
        return
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


def state_line() -> tuple[int, str]:
    """The log level and text of this process's overlay state."""
    import lmcache_ascend
    from lmcache_ascend import flags
    from lmcache_ascend.patches import State, registry

    head = f"lmcache-ascend {lmcache_ascend.__version__}"
    records = registry.process_registry().records()
    if not flags.flag_value("LMCACHE_ASCEND_PATCHES"):
        origin = flags.flag_origin("LMCACHE_ASCEND_PATCHES")
        return logging.INFO, f"{head} off in this process: LMCACHE_ASCEND_PATCHES=0 ({origin}); no upstream module is changed"
    counts = {state: 0 for state in State}
    for record in records:
        counts[record.state] += 1
    applied, pending = counts[State.APPLIED], counts[State.PENDING]
    failed = counts[State.FAILED]
    left_out = len(records) - applied - pending - failed
    text = (
        f"{head} active in this process: {applied + pending} of {len(records)} patches armed ({applied} applied, "
        f"{pending} apply as their modules load), {left_out} left out for this stack or by flags"
    )
    if failed:
        return logging.WARNING, f"{text}, {failed} failed; `lmcache-ascend-patches --import` says why"
    return logging.INFO, f"{text}; `lmcache-ascend-patches` says which and why"


def report_once() -> None:
    """Log the state line, once per process; not where a setting keeps LMCache from starting,
    whose one warning was logged when it was found."""
    import lmcache_ascend

    if _reported or lmcache_ascend.activation_problem() is not None:
        return
    _reported.append(True)
    level, text = state_line()
    logging.getLogger(LOGGER_NAME).log(level, "%s", text)
