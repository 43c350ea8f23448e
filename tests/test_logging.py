"""Library logs go through the standard library's ``logging``; the host decides the output."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from kvtier_async._log import get_logger

# A fresh interpreter with no logging or structlog configuration at all, as in a host that set
# up nothing: the library's line must not appear on stdout (unconfigured structlog prints there).
UNCONFIGURED = """
from kvtier_async._log import get_logger
get_logger("kvtier_async.test").warning("to stderr only", job_id=1)
"""


def test_a_log_line_reaches_a_logging_handler(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("kvtier_async.test")
    with caplog.at_level(logging.INFO, logger="kvtier_async.test"):
        log.info("tier ready", tier="fs", job_id=3)
    (record,) = caplog.records
    assert record.name == "kvtier_async.test"
    assert record.levelno == logging.INFO
    assert record.getMessage() == "tier ready tier='fs' job_id=3"


def test_the_record_points_at_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier_async.test"):
        get_logger("kvtier_async.test").warning("here")
    (record,) = caplog.records
    assert record.pathname == __file__
    assert record.funcName == "test_the_record_points_at_the_caller"


def test_exceptions_keep_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier_async.test"):
        try:
            raise OSError("disk gone")
        except OSError:
            get_logger("kvtier_async.test").exception("store failed", key="ab")
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], OSError)
    assert record.getMessage() == "store failed key='ab'"


def test_positional_arguments_are_formatted(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier_async.test"):
        get_logger("kvtier_async.test").info("copied %d blocks", 4)
    assert caplog.records[0].getMessage() == "copied 4 blocks"


def test_disabled_levels_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier_async.test"):
        get_logger("kvtier_async.test").debug("noise")
    assert caplog.records == []


def test_nothing_is_printed_to_stdout_when_the_host_configured_nothing() -> None:
    command = [sys.executable, "-c", UNCONFIGURED]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == ""
    # logging's last-resort handler shows WARNING and above on stderr, as for any library
    assert "to stderr only job_id=1" in done.stderr


def test_nothing_is_printed_to_stdout_in_process(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvtier_async.test"):
        get_logger("kvtier_async.test").info("quiet", n=1)
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records] == ["quiet n=1"]
