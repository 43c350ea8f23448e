"""The sync face: a synchronous owner drives the engine on its loop thread."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from kvtier_async.engine import Deferred, Engine, Job, JobResult, ThreadedEngine
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
        await anyio.to_thread.run_sync(self.release.wait)
        return [True] * len(job.keys), 0


def wait_for_results(threaded: ThreadedEngine, n: int) -> list[JobResult | Deferred]:
    out: list[JobResult | Deferred] = []
    while len(out) < n:
        threaded.drain(timeout_s=10)
        out += threaded.poll()
    return out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_results_come_back_through_poll(backend: str) -> None:
    device = BlockingDevice()
    device.release.set()

    def make() -> Engine:
        return Engine([], lambda s: memoryview(b""), device=device)

    with ThreadedEngine(make, backend=backend) as threaded:
        jobs = [Job(JobKind.STORE, (b"k" * 8,)) for _ in range(5)]
        threaded.submit(jobs)
        results = wait_for_results(threaded, 5)
    assert sorted(r.job_id for r in results if isinstance(r, JobResult)) == sorted(
        j.job_id for j in jobs
    )


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
    key = b"\x01" * 12

    def make() -> Engine:
        return Engine([tier], lambda slot: memoryview(memory[slot]))

    def step(threaded: ThreadedEngine) -> None:
        tasks = {t.task_id: t for t in ledger.take_tasks()}
        jobs = {}
        for task in tasks.values():
            jobs[task.task_id] = Job(task.kind, task.keys, task.slot_ids, tier=task.tier)
        threaded.submit(jobs.values())
        threaded.drain(timeout_s=10)
        by_job = {job.job_id: task_id for task_id, job in jobs.items()}
        for result in threaded.poll():
            assert isinstance(result, JobResult)
            ledger.apply(by_job[result.job_id], result.ok)

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
