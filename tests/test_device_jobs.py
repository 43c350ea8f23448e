"""The connector's device-job book (`DeviceJobs`): jobs done once all workers reported; a fence."""

from __future__ import annotations

import logging

import pytest

from kvtier_async.integrations.vllm.device_jobs import DeviceJobs

KEYS = (b"k" * 36, b"l" * 36)


def test_a_job_is_done_once_every_worker_reported_it() -> None:
    jobs = DeviceJobs(num_workers=3)
    store = jobs.new("a", KEYS, is_store=True, blocks=[4, 5])
    load = jobs.new("b", KEYS[:1], is_store=False, blocks=[6])
    assert store != load and len(jobs) == 2 and jobs[store].blocks == [4, 5]
    assert jobs.reported(store, 2, failed=False) is None  # one worker still to report
    done = jobs.reported(store, 1, failed=False)
    assert done is not None and (done.req_id, done.is_store, done.failed) == ("a", True, False)
    assert len(jobs) == 1 and [job.req_id for job in jobs] == ["b"]
    assert jobs.reported(store, 1, failed=False) is None  # reported again: already forgotten


def test_one_worker_failing_fails_the_job() -> None:
    jobs = DeviceJobs(num_workers=2)
    job_id = jobs.new("a", KEYS, is_store=False, blocks=[1])
    assert jobs.reported(job_id, 1, failed=True) is None
    done = jobs.reported(job_id, 1, failed=False)
    assert done is not None and done.failed


def test_a_reset_fences_until_every_flushed_job_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier_async.integrations.vllm.device_jobs")
    jobs = DeviceJobs(num_workers=2)
    first = jobs.new("a", KEYS, is_store=True, blocks=[1])
    second = jobs.new("b", KEYS, is_store=True, blocks=[2])
    assert jobs.reported(first, 1, failed=False) is None
    assert not jobs.fenced
    assert jobs.fence() == {first, second}
    assert jobs.fenced and len(jobs) == 0
    after = jobs.new("c", KEYS, is_store=False, blocks=[3])
    assert after > second  # ids go on: a late report of an old job is told apart
    assert jobs.reported(first, 1, failed=False) is None  # its last report: first is clear
    assert jobs.fenced  # second still has two reports due
    assert jobs.reported(second, 2, failed=True) is None  # counted down, never applied
    assert not jobs.fenced
    assert "every device job a cache reset flushed was reported" in caplog.text
    done = jobs.reported(after, 2, failed=False)
    assert done is not None and done.req_id == "c"
