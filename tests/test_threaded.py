"""The sync face: a synchronous owner drives the engine on its loop thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from kvtier_async.engine import Deferred, Engine, Job, JobResult, TaskRunner, ThreadedEngine
from kvtier_async.ledger import JobKind, LookupResult, PrimaryLedger, TieringLedger
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.memory import MemoryTier


class BlockingDevice:
    """Device jobs wait on a threading.Event the test controls."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()

    async def __call__(self, job: Job) -> tuple[Sequence[bool], int]:
        import anyio

        self.started.set()
        await anyio.to_thread.run_sync(self.release.wait, 10.0)  # bounded, even if a test fails
        return [True] * len(job.keys), 0


def releasing_engine() -> Callable[[], Engine]:
    """``make_engine`` for an engine whose device jobs end at once."""
    device = BlockingDevice()
    device.release.set()
    return lambda: Engine([], lambda s: memoryview(b""), device=device)


def wait_for_results(threaded: ThreadedEngine, n: int) -> list[JobResult | Deferred]:
    out: list[JobResult | Deferred] = []
    while len(out) < n:
        threaded.drain(timeout_s=10)
        out += threaded.poll()
    return out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_results_come_back_through_poll(backend: str) -> None:
    with ThreadedEngine(releasing_engine(), backend=backend) as threaded:
        jobs = [Job(JobKind.STORE, (b"k" * 8,)) for _ in range(5)]
        threaded.submit(jobs)
        results = wait_for_results(threaded, 5)
    assert sorted(r.job_id for r in results if isinstance(r, JobResult)) == sorted(
        j.job_id for j in jobs
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_job_no_lane_takes_fails_and_the_rest_go_on(backend: str) -> None:
    before = set(threading.enumerate())
    with ThreadedEngine(releasing_engine(), backend=backend) as threaded:
        bad = Job(JobKind.LOAD, (b"k" * 8,), tier=3)  # the engine has no tier 3
        good = Job(JobKind.STORE, (b"k" * 8,))
        threaded.submit([bad, good])
        results = {r.job_id: r for r in wait_for_results(threaded, 2) if isinstance(r, JobResult)}
        threaded.submit([later := Job(JobKind.STORE, (b"k" * 8,))])  # still taking jobs
        [after] = wait_for_results(threaded, 1)
    assert isinstance(results[bad.job_id].error, ValueError)
    assert "no lane" in str(results[bad.job_id].error)
    assert results[good.job_id].error is None
    assert isinstance(after, JobResult) and after.job_id == later.job_id and after.error is None
    # Closing stopped the engine's bell thread.
    assert not [t for t in set(threading.enumerate()) - before if t.name == "kvtier-bell"]


def test_wait_returns_when_a_result_arrives_and_poll_rearms_it() -> None:
    device = BlockingDevice()

    def make() -> Engine:
        return Engine([], lambda s: memoryview(b""), device=device)

    with ThreadedEngine(make) as threaded:
        assert threaded.wait(0.0) is False  # nothing out, nothing back
        job = Job(JobKind.STORE, (b"k" * 8,))
        threaded.submit([job])
        assert device.started.wait(10)
        assert threaded.wait(0.0) is False  # running: no result yet
        releaser = threading.Thread(target=device.release.set)
        releaser.start()
        started = time.monotonic()
        assert threaded.wait(60.0) is True
        # The wait ended with the result, not at its timeout (which would take 60 s).
        assert time.monotonic() - started < 30.0
        releaser.join()
        [result] = threaded.poll()
        assert isinstance(result, JobResult) and result.job_id == job.job_id
        assert threaded.wait(0.0) is False  # taken: the next wait waits again


def test_a_full_queue_defers_instead_of_blocking() -> None:
    device = BlockingDevice()

    def make() -> Engine:
        return Engine([], lambda s: memoryview(b""), device=device, device_workers=1, queue_depth=1)

    with ThreadedEngine(make) as threaded:
        first, second, third = (Job(JobKind.STORE, (bytes([i]) * 8,)) for i in range(3))
        threaded.submit([first])
        device.started.wait(10)
        threaded.submit([second, third])  # second fills the queue, third is deferred
        polled = threaded.poll()
        while not polled:  # the pump answers at once; nothing here waits on the device
            polled = threaded.poll()
        assert [type(r) for r in polled] == [Deferred] and polled[0].job is third  # type: ignore[union-attr]
        device.release.set()
        threaded.drain(timeout_s=10)
        assert {r.job_id for r in threaded.poll() if isinstance(r, JobResult)} == {
            first.job_id,
            second.job_id,
        }


def test_close_cancels_jobs_in_flight() -> None:
    device = BlockingDevice()
    threaded = ThreadedEngine(lambda: Engine([], lambda s: memoryview(b""), device=device))
    with threaded:
        threaded.submit([Job(JobKind.STORE, (b"k" * 8,))])
        device.started.wait(10)
        device.release.set()  # the thread returns; the close cancels the job at its end
    results = threaded.poll()
    assert len(results) == 1 and isinstance(results[0], JobResult)


def test_a_scheduler_thread_owns_the_ledger() -> None:
    """The vLLM adapter's pattern: ledger on this thread, tier I/O on the loop thread."""
    tier = MemoryTier("mem", TierContext(block_bytes=4096))
    memory = [bytearray(4096) for _ in range(4)]
    ledger = TieringLedger(PrimaryLedger(4), ["mem"])
    runner = TaskRunner(ledger, [tier])
    key = b"\x01" * 12

    def make() -> Engine:
        return Engine([tier], lambda slot: memoryview(memory[slot]))

    def step(threaded: ThreadedEngine) -> None:
        threaded.submit(runner.take_jobs())
        threaded.drain(timeout_s=10)
        results = threaded.poll()
        assert all(isinstance(result, JobResult) for result in results)
        runner.collect(results)

    with ThreadedEngine(make) as threaded:
        out = ledger.prepare_store([key], "r")
        assert out is not None
        memory[int(out.store_spec.slot_ids[0])][:] = b"\x09" * 4096
        ledger.complete_store([key])
        step(threaded)  # cascade
        ledger.reset()
        assert ledger.lookup(key, "r") is LookupResult.RETRY
        step(threaded)  # batched lookup
        assert ledger.lookup(key, "r") is LookupResult.HIT_PENDING
        step(threaded)  # promotion
        assert ledger.lookup(key, "r") is LookupResult.HIT
        slot = int(ledger.prepare_load([key])[0])
    assert memory[slot] == b"\x09" * 4096


class CountingDevice(BlockingDevice):
    """A `BlockingDevice` that counts the runs of each job."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[int, int] = {}

    async def __call__(self, job: Job) -> tuple[Sequence[bool], int]:
        self.runs[job.job_id] = self.runs.get(job.job_id, 0) + 1
        return await super().__call__(job)


def one_slot_engine(device: BlockingDevice) -> ThreadedEngine:
    """A device lane of one worker and one queue place per direction."""
    return ThreadedEngine(
        lambda: Engine(
            [], lambda s: memoryview(b""), device=device, device_workers=1, queue_depth=1
        )
    )


def store_jobs(n: int) -> list[Job]:
    return [Job(JobKind.STORE, (bytes([i]) * 8,)) for i in range(n)]


def poll_until(threaded: ThreadedEngine, job_ids: set[int]) -> list[JobResult]:
    """Poll until the results of ``job_ids`` came out (10 s at most); fails on a Deferred."""
    deadline = time.monotonic() + 10
    results: list[JobResult] = []
    while {r.job_id for r in results} != job_ids:
        assert time.monotonic() < deadline, f"results of {job_ids} did not come"
        for item in threaded.poll():
            assert isinstance(item, JobResult), f"{item} came out of poll"
            results.append(item)
    return results


def wait_for_outbox(threaded: ThreadedEngine, n: int) -> None:
    """Wait (10 s at most) until ``n`` items wait in the outbox, without taking them."""
    deadline = time.monotonic() + 10
    while threaded._outbox.qsize() < n:
        assert time.monotonic() < deadline, "the pump did not answer"
        time.sleep(0.001)


def test_a_flush_covers_deferred_and_unsubmitted_jobs() -> None:
    """The flushed jobs are waited for wherever they were: running, queued, deferred and
    polled by the owner, deferred and still in the outbox, never handed over; none comes
    back deferred and none runs twice."""
    device = CountingDevice()
    with one_slot_engine(device) as threaded:
        jobs = running, queued, polled, unpolled, _new = store_jobs(5)
        threaded.submit([running])
        assert device.started.wait(10)
        threaded.submit([queued, polled])
        wait_for_outbox(threaded, 1)
        assert [d.job for d in threaded.poll() if isinstance(d, Deferred)] == [polled]
        threaded.submit([unpolled])
        wait_for_outbox(threaded, 1)  # its Deferred waits in the outbox
        device.release.set()
        assert threaded.flush(jobs, timeout_s=10) == []
        assert device.runs == {job.job_id: 1 for job in jobs}
        results = poll_until(threaded, {job.job_id for job in jobs})
        assert all(r.error is None for r in results)
        assert threaded.poll() == []


def test_a_flush_past_its_deadline_cancels_and_reports_when_ended() -> None:
    """At the deadline the flush returns the jobs it abandons instead of raising: the ones
    not started end cancelled at once and never run; the running one is reported only once
    its call really ended."""
    device = CountingDevice()
    with one_slot_engine(device) as threaded:
        running, queued, deferred = store_jobs(3)
        threaded.submit([running])
        assert device.started.wait(10)
        threaded.submit([queued, deferred])
        wait_for_outbox(threaded, 1)  # the Deferred of the third
        abandoned = threaded.flush([running, queued, deferred], timeout_s=0.05)
        assert {j.job_id for j in abandoned} == {running.job_id, queued.job_id, deferred.job_id}
        early = poll_until(threaded, {queued.job_id, deferred.job_id})
        assert all(r.cancelled for r in early)
        assert threaded.poll() == []  # the running call has not returned
        device.release.set()
        (late,) = poll_until(threaded, {running.job_id})
        assert late.cancelled
        assert device.runs == {running.job_id: 1}
