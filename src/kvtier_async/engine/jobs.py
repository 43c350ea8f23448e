"""Jobs: one type for every transfer, cascade, promotion and lookup, with an awaitable handle.

A `Job` is plain data: what to move, and for a tier job the ledger tasks it carries
(``tasks``, made by `kvtier_async.engine.runner.TaskRunner`). The engine runs it on a lane
and resolves its `JobHandle` exactly once, with a `JobResult` that lists per key whether it
succeeded and carries the tasks back. The result then takes one path: the engine's
``on_result`` sink (`Engine`), which hands it to the ledger's owner; nothing here applies
it. ``await handle`` returns that result, or raises `JobError` when the job failed as a
whole (its error, or `JobCancelled`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from kvtier_async.ledger import JobKind, TierTask

__all__ = [
    "Job",
    "JobCancelled",
    "JobError",
    "JobHandle",
    "JobKind",
    "JobResult",
]

_job_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Job:
    """Work for one lane. ``payload`` is the lane executor's business (specs, slot ids).
    ``tasks``: the ledger tasks a tier job carries, their keys in ``keys``' order."""

    kind: JobKind
    keys: tuple[bytes, ...]
    payload: Any = None
    tier: int = -1  # secondary tier index; -1 for device transfers
    tasks: tuple[TierTask, ...] = ()
    job_id: int = field(default_factory=_job_ids.__next__)
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class JobResult:
    """How a job ended. ``ok[i]`` says whether ``keys[i]`` succeeded (for a lookup: whether
    the key is present). ``error`` is set when the whole job failed; then ``ok`` is all False
    (a cancelled job's error is a `JobCancelled`, unless it never found a place to run).
    ``tasks``: the job's ledger tasks, for the owner that applies the result."""

    job_id: int
    kind: JobKind
    keys: tuple[bytes, ...]
    ok: tuple[bool, ...]
    nbytes: int = 0
    queued_s: float = 0.0
    run_s: float = 0.0
    error: BaseException | None = None
    cancelled: bool = False
    tasks: tuple[TierTask, ...] = ()

    @property
    def succeeded(self) -> list[bytes]:
        return [key for key, ok in zip(self.keys, self.ok) if ok]

    @property
    def failed(self) -> list[bytes]:
        return [key for key, ok in zip(self.keys, self.ok) if not ok]

    @classmethod
    def failure(
        cls, job: Job, error: BaseException | None, *, cancelled: bool = False
    ) -> JobResult:
        """``job`` failed whole with ``error``; None: it was cancelled (the error is then
        a `JobCancelled` naming this result)."""
        result = cls(
            job.job_id,
            job.kind,
            job.keys,
            (False,) * len(job.keys),
            error=error,
            cancelled=cancelled or error is None,
            queued_s=time.perf_counter() - job.submitted_at,
            tasks=job.tasks,
        )
        if error is None:
            result.error = JobCancelled(result)
        return result

    @classmethod
    def cancelled_result(cls, job: Job) -> JobResult:
        return cls.failure(job, None)


class JobError(Exception):
    """The job failed as a whole; ``result`` tells which job."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"{result.kind.value} job {result.job_id} failed: {result.error!r}")
        self.result = result


class JobCancelled(JobError):
    """The job was cancelled (by `JobHandle.cancel` or because the engine closed): raised by
    the handle, and the ``error`` of the cancelled job's result."""

    def __init__(self, result: JobResult) -> None:
        Exception.__init__(self, f"{result.kind.value} job {result.job_id} was cancelled")
        self.result = result


class JobHandle:
    """Awaitable outcome of one job; resolved exactly once, in the engine's event loop."""

    __slots__ = ("_event", "_notify", "_result", "_scope", "job")

    def __init__(self, job: Job, notify: Callable[[JobResult], None] | None = None) -> None:
        self.job = job
        self._event: anyio.Event | None = None  # made when someone waits
        self._result: JobResult | None = None
        self._scope: anyio.CancelScope | None = None
        self._notify = notify

    def done(self) -> bool:
        return self._result is not None

    def result(self) -> JobResult:
        """The result; raises `JobError` if the job failed, RuntimeError if it is running."""
        if self._result is None:
            raise RuntimeError(f"job {self.job.job_id} has not finished")
        if self._result.error is not None:
            raise (JobCancelled if self._result.cancelled else JobError)(self._result)
        return self._result

    def cancel(self) -> None:
        """Cancel the job: a queued job ends now, a running one at its next checkpoint.
        Either way it ends as a cancelled result, which the owner applies like any other
        (releasing what the job held)."""
        if self._scope is not None:
            self._scope.cancel()
        elif self._result is None:
            self.settle(JobResult.cancelled_result(self.job))

    async def wait(self) -> JobResult:
        """The result, once the job ended; raises `JobError` if it failed."""
        await self.wait_ended()
        return self.result()

    async def wait_ended(self) -> JobResult:
        """The result, once the job ended, whatever the outcome (never raises `JobError`):
        after `cancel`, this is how a caller knows the job let go of what it used."""
        if self._result is None:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        else:
            await anyio.lowlevel.checkpoint()
        assert self._result is not None
        return self._result

    def __await__(self) -> Generator[Any, None, JobResult]:
        return self.wait().__await__()

    def started(self, scope: anyio.CancelScope) -> None:
        """Called by the lane that runs the job, as it starts it inside ``scope``: `cancel`
        then cancels the scope, and the lane settles the handle when the work stops."""
        self._scope = scope

    def settle(self, result: JobResult) -> bool:
        """Record the result and hand it to ``notify`` (the engine, which passes it on to
        its ``on_result``); False if it was settled already. Called by whoever ends the
        job (its lane, or the engine for a job no lane took), never by a waiter."""
        self._scope = None
        if self._result is not None:
            return False
        self._result = result
        if self._event is not None:
            self._event.set()
        if self._notify is not None:
            self._notify(result)
        return True
