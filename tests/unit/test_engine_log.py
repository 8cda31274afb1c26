"""The engine-side parts write to one logger, which an integration points into its engine's log."""

from __future__ import annotations

import logging

import pytest

from cachexferd.integrations.engine import failures, logs


def burst_line(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    report = failures.FailureLog()
    report.note("load", "load job 1: DAEMON_LOST")
    with caplog.at_level("WARNING"):
        report.flush(force=True)
    (record,) = caplog.records
    return record


def test_lines_go_to_the_logger_the_integration_names(caplog: pytest.LogCaptureFixture) -> None:
    before = logs.log.logger
    try:
        logs.log_to(logging.getLogger("cachexferd.engine"))
        record = burst_line(caplog)
        assert record.name == "cachexferd.engine" and "the engine recomputed" in record.getMessage()
        caplog.clear()
        logs.log_to(logging.getLogger("someengine.cachexferd"))
        record = burst_line(caplog)
        assert record.name == "someengine.cachexferd"
        assert record.filename == "failures.py", "the line names the module that wrote it, not the adapter"
    finally:
        logs.log_to(before)
