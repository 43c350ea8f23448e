"""Jobs: one type for every transfer, cascade, promotion and lookup, with an awaitable handle.

A `Job` is plain data plus the callback that applies its result (``on_done``). The engine
runs it on a lane and resolves its `JobHandle` exactly once, with a `JobResult` that lists
per key whether it succeeded. ``await handle`` returns that result, or raises `JobError`
when the job failed as a whole (its error, or `JobCancelled`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from kvtier_async.ledger import JobKind

__all__ = [
    "CancelledJobError",
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
    """Work for one lane. ``payload`` is the lane executor's business (specs, slot ids)."""

    kind: JobKind
    keys: tuple[bytes, ...]
    payload: Any = None
    tier: int = -1  # secondary tier index; -1 for device transfers
    on_done: Callable[[JobResult], None] | None = None
    job_id: int = field(default_factory=_job_ids.__next__)
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class JobResult:
    """How a job ended. ``ok[i]`` says whether ``keys[i]`` succeeded (for a lookup: whether
    the key is present). ``error`` is set when the whole job failed; then ``ok`` is all False."""

    job_id: int
    kind: JobKind
    keys: tuple[bytes, ...]
    ok: tuple[bool, ...]
    nbytes: int = 0
    queued_s: float = 0.0
    run_s: float = 0.0
    error: BaseException | None = None
    cancelled: bool = False

    @property
    def succeeded(self) -> list[bytes]:
        return [key for key, ok in zip(self.keys, self.ok) if ok]

    @property
    def failed(self) -> list[bytes]:
        return [key for key, ok in zip(self.keys, self.ok) if not ok]

    @classmethod
    def failure(cls, job: Job, error: BaseException, *, cancelled: bool = False) -> JobResult:
        return cls(
            job.job_id,
            job.kind,
            job.keys,
            (False,) * len(job.keys),
            error=error,
            cancelled=cancelled,
            queued_s=time.perf_counter() - job.submitted_at,
        )

    @classmethod
    def cancelled_result(cls, job: Job) -> JobResult:
        return cls.failure(
            job, CancelledJobError(f"job {job.job_id} was cancelled"), cancelled=True
        )


class CancelledJobError(Exception):
    """The ``error`` of a cancelled job's result."""


class JobError(Exception):
    """The job failed as a whole; ``result`` tells which job."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"{result.kind.value} job {result.job_id} failed: {result.error!r}")
        self.result = result


class JobCancelled(JobError):
    """The job was cancelled (by `JobHandle.cancel` or because the engine closed)."""


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
        Either way it ends as a cancelled result whose ``on_done`` releases what it held."""
        if self._scope is not None:
            self._scope.cancel()
        elif self._result is None:
            self._resolve(JobResult.cancelled_result(self.job))

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

    def _resolve(self, result: JobResult) -> bool:
        """Record the result and run ``on_done``; False if it was resolved already."""
        if self._result is not None:
            return False
        self._result = result
        if self._event is not None:
            self._event.set()
        if self.job.on_done is not None:
            self.job.on_done(result)
        if self._notify is not None:
            self._notify(result)
        return True
