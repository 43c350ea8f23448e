"""A lane: one tier's (or the device's) bounded queues and the worker tasks that drain them.

Reads (loads, promotions, lookups) and writes (stores, cascades) wait in two bounded memory
object streams. Every queued job also drops one token into a doorbell stream, so a worker
that takes a token always finds a job, and takes a read before any write: reads go first
when both wait. Stores are best-effort and may wait; loads are what a request waits for.

A job that fails whole is logged once per `_WARN_INTERVAL_S` per lane (`RateLimited`: while a
circuit is open every job fails, and one line per job would flood the log); the lines not
logged are counted in `LaneStatistics.warnings_suppressed`.

Each lane feeds the counter set it is given (`JobCounters`: its tier's
`kvtier_async.ledger.TierCounters`, or the device lane's `DeviceCounters`) as each job ends:
bytes moved and seconds of run time, by kind. A lookup's "not found" is an answer, not a
failure: only keys of a lookup job that failed whole count as failed. `LaneStatistics` is the
lane's own state (its queues, the jobs running, the jobs by outcome), not its tier's figures.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvtier_async._log import RateLimited, get_logger
from kvtier_async.ledger import JobKind

from .jobs import Job, JobHandle, JobResult

__all__ = ["Executor", "JobCounters", "Lane", "LaneStatistics"]

log = get_logger(__name__)

_BATCH = 32
_WARN_INTERVAL_S = 10.0

Executor = Callable[[Job], Awaitable[tuple[Sequence[bool], int]]]
"""Runs a job; returns per-key success and the bytes moved. Raises if the job failed whole."""


class JobCounters(Protocol):
    """What a lane feeds as each job ends (`kvtier_async.ledger.TierCounters`,
    `kvtier_async.ledger.DeviceCounters`)."""

    def job_ended(self, kind: JobKind, nbytes: int, seconds: float, failed_whole: int) -> None:
        """``nbytes`` moved (0 for a job that failed whole), ``seconds`` of run time, and
        ``failed_whole`` keys of a job that raised (0 otherwise)."""
        ...


@dataclass(frozen=True)
class LaneStatistics:
    name: str
    queued_reads: int
    queued_writes: int
    running: int
    completed: int
    failed: int
    cancelled: int
    warnings_suppressed: int = 0  # "job failed" lines not logged (rate-limited)


class Lane:
    """Bounded queues plus ``workers`` tasks running ``execute``."""

    def __init__(
        self,
        name: str,
        execute: Executor,
        *,
        workers: int,
        depth: int,
        counters: JobCounters | None = None,
    ) -> None:
        if workers < 1 or depth < 1:
            raise ValueError(f"lane {name!r}: workers and depth must be >= 1")
        self.name = name
        self.workers = workers
        self._execute = execute
        self._reads = anyio.create_memory_object_stream[JobHandle](depth)
        self._writes = anyio.create_memory_object_stream[JobHandle](depth)
        self._bell = anyio.create_memory_object_stream[None](2 * depth)
        self._room: anyio.Event | None = None  # set when the queues drained to low water
        self._low_water = depth // 2
        self._queued = 0
        self.closed = False
        self._running = self._completed = self._failed = self._cancelled = 0
        self._counters = counters
        self._warn = RateLimited(log, _WARN_INTERVAL_S)

    # --- submission --------------------------------------------------------------------

    def submit_nowait(self, handle: JobHandle) -> None:
        """Queue a job or raise `anyio.WouldBlock` when its queue is full
        (`anyio.ClosedResourceError` once the lane is closed)."""
        if self.closed:
            raise anyio.ClosedResourceError
        self._queue(handle).send_nowait(handle)
        self._queued += 1
        self._bell[0].send_nowait(None)

    async def submit(self, handle: JobHandle) -> None:
        """Queue a job, waiting for room. If cancelled while waiting, nothing was queued."""
        while True:
            try:
                self.submit_nowait(handle)
                return
            except anyio.WouldBlock:
                if self._room is None:
                    self._room = anyio.Event()
                await self._room.wait()

    def _queue(self, handle: JobHandle) -> MemoryObjectSendStream[JobHandle]:
        return self._reads[0] if handle.job.kind.is_read else self._writes[0]

    # --- workers -----------------------------------------------------------------------

    async def run_worker(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Take jobs until the lane's streams close. One cancel scope serves job after job
        (a scope per job costs more than a no-op job); cancelling a running job cancels the
        current scope, and the worker goes on in a fresh one."""
        task_status.started()
        bell = self._bell[1]
        while True:
            with anyio.CancelScope() as scope:
                while not scope.cancel_called:
                    try:
                        await bell.receive()  # the one checkpoint per batch
                    except (anyio.EndOfStream, anyio.ClosedResourceError):
                        return
                    await self._run_queued(scope, bell)

    async def _run_queued(
        self, scope: anyio.CancelScope, bell: MemoryObjectReceiveStream[None]
    ) -> None:
        """Run the job the bell announced, then up to `_BATCH` more already queued before
        yielding again: a job that never awaits (a no-op) must not cost a loop turn each."""
        for left in range(_BATCH - 1, -1, -1):
            handle = self._take()
            if not handle.done():  # a queued job cancelled by its handle is skipped
                await self._run(handle, scope)
            if left == 0 or scope.cancel_called:
                return
            try:
                bell.receive_nowait()  # a token taken here is a job taken next turn
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return

    def _take(self) -> JobHandle:
        self._queued -= 1
        if self._room is not None and self._queued <= self._low_water:
            # Waking submitters at low water, not per job, saves a switch per job.
            self._room.set()
            self._room = None
        try:
            return self._reads[1].receive_nowait()
        except anyio.WouldBlock:
            return self._writes[1].receive_nowait()

    async def _run(self, handle: JobHandle, scope: anyio.CancelScope) -> None:
        job, start = handle.job, time.perf_counter()
        handle.started(scope)
        self._running += 1
        try:
            ok, nbytes = await self._execute(job)
        except anyio.get_cancelled_exc_class():
            self._finish(handle, JobResult.cancelled_result(job), start)
            raise
        except Exception as exc:
            self._warn(
                "job failed",
                lane=self.name,
                job_id=job.job_id,
                kind=job.kind.value,
                error=repr(exc),
            )
            self._finish(handle, JobResult.failure(job, exc), start)
            return
        if scope.cancel_called:  # cancelled, even if the work ended before a checkpoint
            self._finish(handle, JobResult.cancelled_result(job), start)
        else:
            self._finish(handle, self._success(job, ok, nbytes, start), start)

    @staticmethod
    def _success(job: Job, ok: Sequence[bool], nbytes: int, start: float) -> JobResult:
        if len(ok) != len(job.keys):
            raise RuntimeError(
                f"{job.kind.value} job {job.job_id}: {len(ok)} outcomes for {len(job.keys)} keys"
            )
        now = time.perf_counter()
        flags = ok if isinstance(ok, tuple) else tuple(map(bool, ok))
        return JobResult(
            job.job_id,
            job.kind,
            job.keys,
            flags,
            nbytes,
            queued_s=start - job.submitted_at,
            run_s=now - start,
            tasks=job.tasks,
        )

    def _finish(self, handle: JobHandle, result: JobResult, start: float) -> None:
        self._running -= 1
        self._count(result, time.perf_counter() - start)
        handle.settle(result)

    def _count(self, result: JobResult, busy: float) -> None:
        if result.cancelled:
            self._cancelled += 1
        elif result.error is not None:
            self._failed += 1
        else:
            self._completed += 1
        if self._counters is not None:
            whole = result.error is not None
            self._counters.job_ended(
                result.kind, 0 if whole else result.nbytes, busy, len(result.ok) if whole else 0
            )

    # --- shutdown and statistics -------------------------------------------------------

    def close(self) -> None:
        """Refuse new jobs; wake submitters waiting for room (they get ClosedResourceError)."""
        self.closed = True
        if self._room is not None:
            self._room.set()

    def cancel_queued(self) -> int:
        """End every queued job as cancelled and close the streams (after the workers
        stopped); how many jobs were cancelled."""
        count = 0
        for _, receive in (self._reads, self._writes):
            while True:
                try:
                    handle = receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                if handle.settle(JobResult.cancelled_result(handle.job)):
                    self._cancelled += 1
                    count += 1
        for stream in (*self._reads, *self._writes, *self._bell):
            stream.close()
        return count

    def statistics(self) -> LaneStatistics:
        return LaneStatistics(
            self.name,
            self._reads[0].statistics().current_buffer_used,
            self._writes[0].statistics().current_buffer_used,
            self._running,
            self._completed,
            self._failed,
            self._cancelled,
            self._warn.suppressed,
        )
