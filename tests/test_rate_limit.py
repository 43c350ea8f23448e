"""`RateLimited`: one line per interval for a repeated warning, with the count of repeats."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest

from kvtier_async._log import RateLimited, get_logger
from kvtier_async.engine.jobs import Job, JobError, JobHandle, JobKind
from kvtier_async.engine.lane import Lane


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="kvtier_async.test")
    return caplog


def test_repeats_are_counted_and_reported_with_the_next_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    warn = RateLimited(get_logger("kvtier_async.test"), 10.0, clock=clock)
    assert warn("store failed", tier="obj", job=1)
    for job in range(2, 39):  # 37 repeats within the window
        clock.now += 0.2
        assert not warn("store failed", tier="obj", job=job)
    assert caplog.messages == ["store failed tier='obj' job=1"]
    assert warn.suppressed == 37
    clock.now = 110.0
    assert warn("store failed", tier="obj", job=39)
    assert caplog.messages[1] == "store failed (37 more in the last 10 s) tier='obj' job=39"
    clock.now = 125.0  # a quiet window: the next line carries no count
    assert warn("store failed", tier="obj", job=40)
    assert caplog.messages[2] == "store failed tier='obj' job=40"
    assert warn.suppressed == 37


def test_each_event_has_its_own_window(caplog: pytest.LogCaptureFixture) -> None:
    warn = RateLimited(get_logger("kvtier_async.test"), 10.0, clock=Clock())
    assert warn("store failed") and warn("load failed")
    assert not warn("store failed") and not warn("load failed")
    assert caplog.messages == ["store failed", "load failed"]


def test_the_level_and_the_callers_line(caplog: pytest.LogCaptureFixture) -> None:
    RateLimited(get_logger("kvtier_async.test"), level="info")("probe failed")
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.pathname == __file__
    assert record.funcName == "test_the_level_and_the_callers_line"


def test_threads_share_one_window(caplog: pytest.LogCaptureFixture) -> None:
    warn = RateLimited(get_logger("kvtier_async.test"), 3600.0)
    threads = [
        threading.Thread(target=lambda: [warn("disk full") for _ in range(200)]) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert caplog.messages == ["disk full"]
    assert warn.suppressed == 799


@pytest.mark.anyio
async def test_a_lane_logs_failed_jobs_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier_async.engine.lane")

    async def fail(job: Job) -> tuple[list[bool], int]:
        raise OSError(f"disk full ({job.job_id})")

    lane = Lane("fs[0]", fail, workers=1, depth=64)
    handles = [JobHandle(Job(JobKind.STORE, (bytes(4),), tier=0)) for _ in range(50)]
    async with anyio.create_task_group() as tg:
        await tg.start(lane.run_worker)
        for handle in handles:
            await lane.submit(handle)
        with anyio.fail_after(10):
            for handle in handles:
                with pytest.raises(JobError, match="disk full"):
                    await handle.wait()
        lane.close()
        lane.cancel_queued()
    failed = [r for r in caplog.records if r.name == "kvtier_async.engine.lane"]
    assert [r.getMessage().split(" lane=")[0] for r in failed] == ["job failed"]
    stats = lane.statistics()
    assert (stats.failed, stats.warnings_suppressed) == (50, 49)
