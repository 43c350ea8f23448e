"""The engine's runtime: handles, lanes, priority, backpressure, cancellation, shutdown."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from kvtier_async.engine import (
    Engine,
    EngineClosed,
    Job,
    JobCancelled,
    JobError,
    JobResult,
)
from kvtier_async.ledger import JobKind
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.memory import MemoryTier

pytestmark = pytest.mark.anyio


class Device:
    """A device executor whose jobs wait for the test: ``release`` lets them finish."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.gate = anyio.Event()
        self.entered = anyio.Event()
        self.fail_with: Exception | None = None

    async def __call__(self, job: Job) -> tuple[Sequence[bool], int]:
        self.started.append(job.job_id)
        self.entered.set()
        await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return [True] * len(job.keys), 10 * len(job.keys)


def job(kind: JobKind = JobKind.STORE, n: int = 1, tier: int = -1) -> Job:
    return Job(kind, tuple(bytes([i]) * 8 for i in range(n)), tier=tier)


def engine(
    device: Device, *, workers: int = 1, depth: int = 8, results: list[JobResult] | None = None
) -> Engine:
    """An engine on ``device``; every job's result is appended to ``results``."""
    return Engine(
        [],
        lambda slot: memoryview(b""),
        device=device,
        device_workers=workers,
        queue_depth=depth,
        on_result=results.append if results is not None else None,
    )


async def test_await_handle_gives_the_result() -> None:
    device = Device()
    device.gate.set()
    results: list[JobResult] = []
    async with engine(device, results=results) as eng:
        handle = await eng.submit(job(n=3))
        result = await handle
    assert result.ok == (True, True, True) and result.nbytes == 30
    assert handle.done() and results == [result]
    assert result.run_s >= 0 and result.queued_s >= 0


async def test_a_failed_job_raises_and_reports() -> None:
    device = Device()
    device.fail_with = OSError("disk on fire")
    device.gate.set()
    results: list[JobResult] = []
    async with engine(device, results=results) as eng:
        handle = await eng.submit(job(n=2))
        with pytest.raises(JobError, match="disk on fire") as info:
            await handle
    assert info.value.result.ok == (False, False)
    assert results[0].error is not None and not results[0].cancelled


async def test_reads_go_before_writes() -> None:
    device = Device()
    async with engine(device, workers=1) as eng:
        blocker = await eng.submit(job(JobKind.STORE))
        await device.entered.wait()  # the only worker is busy
        write = await eng.submit(job(JobKind.STORE))
        read = await eng.submit(job(JobKind.LOAD))
        device.gate.set()
        for handle in (blocker, write, read):
            await handle
    assert device.started == [blocker.job.job_id, read.job.job_id, write.job.job_id]


async def test_a_full_queue_says_not_now_to_sync_callers_and_waits_async_ones() -> None:
    device = Device()
    async with engine(device, workers=1, depth=1) as eng:
        busy = eng.submit_nowait(job())
        await device.entered.wait()
        queued = eng.submit_nowait(job())
        with pytest.raises(anyio.WouldBlock):
            eng.submit_nowait(job())
        waiting = anyio.Event()
        handles = []

        async def submit_later() -> None:
            waiting.set()
            handles.append(await eng.submit(job()))

        async with anyio.create_task_group() as tg:
            tg.start_soon(submit_later)
            await waiting.wait()
            assert not handles  # still waiting for room
            device.gate.set()
        for handle in (busy, queued, *handles):
            await handle


async def test_cancel_a_queued_job() -> None:
    device = Device()
    results: list[JobResult] = []
    async with engine(device, results=results) as eng:
        busy = await eng.submit(job())
        await device.entered.wait()
        queued = await eng.submit(job())
        queued.cancel()
        assert queued.done() and results[0].cancelled
        with pytest.raises(JobCancelled):
            await queued
        device.gate.set()
        await busy
        await eng.drain()
    assert device.started == [busy.job.job_id]


async def test_cancel_a_running_job() -> None:
    device = Device()
    results: list[JobResult] = []
    async with engine(device, results=results) as eng:
        running = await eng.submit(job())
        await device.entered.wait()
        running.cancel()
        with pytest.raises(JobCancelled):
            await running
        assert results[0].cancelled and not eng.has_pending_work()


async def test_closing_the_engine_ends_every_job_as_cancelled() -> None:
    device = Device()
    results: list[JobResult] = []
    async with engine(device, workers=1, results=results) as eng:
        running = await eng.submit(job())
        await device.entered.wait()
        queued = [await eng.submit(job()) for _ in range(3)]
    assert all(h.done() for h in (running, *queued))
    assert len(results) == 4 and all(r.cancelled for r in results)
    with pytest.raises(EngineClosed):
        eng.submit_nowait(job())


async def test_a_submitter_waiting_for_room_is_released_by_close() -> None:
    device = Device()
    outcome: list[BaseException] = []
    async with anyio.create_task_group() as tg, engine(device, workers=1, depth=1) as eng:
        eng.submit_nowait(job())
        await device.entered.wait()
        eng.submit_nowait(job())
        waiting = anyio.Event()

        async def submit() -> None:
            waiting.set()
            try:
                await eng.submit(job())
            except EngineClosed as exc:
                outcome.append(exc)

        tg.start_soon(submit)
        await waiting.wait()
    assert len(outcome) == 1


async def test_drain_waits_for_everything_in_flight() -> None:
    device = Device()
    async with engine(device, workers=2) as eng:
        handles = [await eng.submit(job()) for _ in range(4)]
        assert eng.has_pending_work()
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.drain)
            await device.entered.wait()
            device.gate.set()
        assert all(h.done() for h in handles) and not eng.has_pending_work()


async def test_tier_jobs_run_on_the_tier_lanes() -> None:
    tier = MemoryTier("mem", TierContext(block_bytes=4096))
    memory = [bytearray(4096) for _ in range(2)]
    memory[0][:] = b"\x07" * 4096
    async with Engine([tier], lambda slot: memoryview(memory[slot])) as eng:
        key = b"k" * 12
        stored = await (await eng.submit(Job(JobKind.CASCADE, (key,), [0], tier=0)))
        found = await (await eng.submit(Job(JobKind.LOOKUP, (key, b"x" * 12), tier=0)))
        loaded = await (await eng.submit(Job(JobKind.PROMOTE, (key,), [1], tier=0)))
        names = [s.name for s in eng.statistics()]
    assert stored.ok == (True,) and found.ok == (True, False) and loaded.ok == (True,)
    assert memory[1] == memory[0] and loaded.nbytes == 4096
    assert names == ["mem", "mem:lookup"]


async def test_a_tier_that_fails_to_open_is_closed() -> None:
    closed = []

    class Broken(MemoryTier):
        async def open(self) -> None:
            raise ConnectionError("no such endpoint")

        async def aclose(self) -> None:
            closed.append(True)

    with pytest.raises(ConnectionError, match="no such endpoint"):
        async with Engine([Broken("b", TierContext(block_bytes=1))], lambda s: memoryview(b"")):
            pass
    assert closed == [True]


async def test_a_job_for_a_missing_lane_is_refused() -> None:
    async with Engine([], lambda s: memoryview(b"")) as eng:
        with pytest.raises(ValueError, match="no lane"):
            eng.submit_nowait(job(JobKind.STORE))


async def test_a_long_queue_of_jobs_that_never_await_all_complete() -> None:
    """Workers run queued jobs in batches between checkpoints; none may be left behind."""
    results: list[JobResult] = []

    async def noop(job: Job) -> tuple[Sequence[bool], int]:
        return (True,) * len(job.keys), 0

    async with Engine(
        [],
        lambda s: memoryview(b""),
        device=noop,
        device_workers=1,
        queue_depth=512,
        on_result=results.append,
    ) as eng:
        for _ in range(300):
            await eng.submit(job())
        with anyio.fail_after(10):
            await eng.drain()
    assert len(results) == 300 and all(r.ok == (True,) for r in results)
