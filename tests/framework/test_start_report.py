"""Each vLLM process says once, in vLLM's log and at vLLM's level, what state the overlay is in.

Python's real logging with a ``vllm`` logger set up as vLLM sets up its own (a stream
handler, propagation off); the registry is the process's real one. The engine-side
check (every engine process of a real server logs its line) is in
`tests/engine/test_engine_readme_server.py`.
"""

from __future__ import annotations

import io
import logging

import pytest

import lmcache_ascend
from lmcache_ascend import start_report


@pytest.fixture
def vllm_log(monkeypatch):
    """A stream handler on the ``vllm`` logger (as vLLM configures it), the overlay's logger as it
    is in a fresh process, and no root handler; all restored afterwards."""
    ours, vllm_logger, root = (logging.getLogger(name) for name in (start_report.LOGGER_NAME, "vllm", ""))
    saved = [(log, list(log.handlers), log.level, log.propagate) for log in (ours, vllm_logger, root)]
    for log in (ours, vllm_logger, root):
        log.handlers = []
    ours.setLevel(logging.NOTSET)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s [%(name)s] %(message)s"))
    monkeypatch.setattr(start_report, "_reported", [])
    yield stream, handler, vllm_logger
    for log, handlers, level, propagate in saved:
        log.handlers, log.propagate = handlers, propagate
        log.setLevel(level)


def _without_pytests_handlers(monkeypatch):
    """As in a vLLM process: pytest adds its capture handlers for each test's call, to the root
    logger and to a logger that does not propagate (vLLM's, once vLLM has configured it)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])


def _configure_vllm(vllm_logger, handler, level=logging.INFO):
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(level)
    vllm_logger.propagate = False


def test_the_state_line_reaches_vllms_handler_once(vllm_log, monkeypatch):
    stream, handler, vllm_logger = vllm_log
    _without_pytests_handlers(monkeypatch)
    monkeypatch.delenv("LMCACHE_ASCEND_PATCHES", raising=False)
    _configure_vllm(vllm_logger, handler)
    start_report.join_vllm_logging()
    start_report.join_vllm_logging()  # a second plugin load adds no second handler
    start_report.report_once()
    start_report.report_once()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"INFO [lmcache_ascend] lmcache-ascend {lmcache_ascend.__version__} "
                               "active in this process: "), lines
    assert "patches armed (" in lines[0] and "left out for this stack or by flags" in lines[0]


def test_with_the_master_switch_off_the_line_says_so_and_where_it_was_set(vllm_log, monkeypatch):
    stream, handler, vllm_logger = vllm_log
    _without_pytests_handlers(monkeypatch)
    monkeypatch.setenv("LMCACHE_ASCEND_PATCHES", "0")
    _configure_vllm(vllm_logger, handler)
    start_report.join_vllm_logging()
    start_report.report_once()
    assert stream.getvalue() == (
        f"INFO [lmcache_ascend] lmcache-ascend {lmcache_ascend.__version__} off in this process: "
        "LMCACHE_ASCEND_PATCHES=0 (environment); no upstream module is changed\n"
    )


def test_a_line_made_before_vllm_sets_up_its_logging_goes_out_ahead_of_the_next(vllm_log, monkeypatch):
    stream, handler, vllm_logger = vllm_log
    _without_pytests_handlers(monkeypatch)
    start_report.join_vllm_logging()
    logging.getLogger("lmcache_ascend.connector.install").info("first")
    assert stream.getvalue() == ""
    _configure_vllm(vllm_logger, handler)
    logging.getLogger("lmcache_ascend.connector.install").info("second")
    assert stream.getvalue().splitlines() == [
        "INFO [lmcache_ascend.connector.install] first",
        "INFO [lmcache_ascend.connector.install] second",
    ]


def test_vllms_level_governs_the_overlays_lines(vllm_log, monkeypatch):
    stream, handler, vllm_logger = vllm_log
    _without_pytests_handlers(monkeypatch)
    _configure_vllm(vllm_logger, handler, level=logging.WARNING)
    start_report.join_vllm_logging()
    log = logging.getLogger("lmcache_ascend.connector.install")
    log.info("quiet")
    log.warning("loud")
    assert stream.getvalue().splitlines() == ["WARNING [lmcache_ascend.connector.install] loud"]


def test_a_root_handler_gets_the_line_once_by_propagation(vllm_log, monkeypatch):
    stream, handler, vllm_logger = vllm_log
    _without_pytests_handlers(monkeypatch)
    _configure_vllm(vllm_logger, handler)
    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)
    logging.getLogger().addHandler(root_handler)
    try:
        start_report.join_vllm_logging()
        logging.getLogger("lmcache_ascend.connector.install").info("once")
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert root_stream.getvalue() == "once\n"
    assert stream.getvalue() == ""


def test_where_a_setting_stops_lmcache_its_own_warning_stands_and_no_state_line_is_added(vllm_log, monkeypatch):
    stream, handler, vllm_logger = vllm_log
    _without_pytests_handlers(monkeypatch)
    _configure_vllm(vllm_logger, handler)
    start_report.join_vllm_logging()
    problem = ValueError("LMCACHE_ASCEND_BUNDLE_MULTI_SPEC='2' is not allowed")
    monkeypatch.setattr(lmcache_ascend, "activation_problem", lambda: problem)
    start_report.report_once()
    assert stream.getvalue() == ""
