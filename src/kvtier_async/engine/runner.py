"""The task runner: ledger tasks out as engine jobs, job results back into the ledger.

The ledger decides, the engine executes, the owner applies; `TaskRunner` is the owner's
half, and `TaskRunner.apply` the one place where a result reaches the ledger.

*Tasks out.* `take_jobs` turns what the ledger decided (`TieringLedger.take_tasks`) into
jobs: one per task, or with ``batch`` one per (kind, tier) carrying all of them (the vLLM
scheduler's choice: the loop thread then handles a few jobs per step, not one per request;
a batch's blocks still move in parallel in the tier). A job carries its tasks
(`Job.tasks`) and its result carries them back (`JobResult.tasks`): a task has one id,
the ledger's ``task_id``, and no table joins it to the job's. Jobs the engine deferred
(`Deferred`: a full queue) wait here and lead the next `take_jobs`.

*Results in.* `apply` hands each task its slice of the per-key outcomes
(`TieringLedger.apply`), then reports the blocks the task's tier deleted on its own
meanwhile (`TierBackend.take_removed`: damaged blocks, GC) with
`TieringLedger.tier_removed`, so lookups ask that tier again and a removal event goes out.
A device copy's result (`apply_copy`) finishes its store or releases its load's pins. An
exception while applying is logged with the job and its tasks (rate-limited) and goes no
further: the owner's loop, a task group or vLLM's scheduler, goes on. `abandon` applies
jobs that never ran as failed, releasing what their tasks hold.

*Who applies.* Only the ledger's owner, never a lane's worker:

- A synchronous owner (vLLM's scheduler thread, with `ThreadedEngine`) gives what ``poll``
  returns to `collect` at the points of its step where it applies results.
- An async owner (`kvtier_async.api.TieredKVCache`) makes `deliver` its engine's
  ``on_result``: a lane's worker only queues the result here. The owner task
  (``async with runner``) applies what is queued, in order, in the event loop's thread. A
  caller that needs its own result applied before it goes on (a store whose blocks must be
  readable when it returns) calls `apply_delivered` once its handle ended, which applies
  the queue in the same order; whichever comes first applies, never both. The queue holds
  at most the results of jobs that ended since the owner task's last turn.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType

import anyio
import numpy as np

from kvtier_async._log import RateLimited, get_logger
from kvtier_async.ledger import JobKind, TieringLedger, TierTask

from .backend import TierBackend
from .jobs import Job, JobResult
from .threaded import Deferred

__all__ = ["TaskRunner"]

log = get_logger(__name__)

_WARN_INTERVAL_S = 10.0


class TaskRunner:
    """Ledger tasks -> jobs, and every job's result -> the ledger, for its one owner."""

    def __init__(
        self,
        ledger: TieringLedger,
        tiers: Sequence[TierBackend],
        *,
        batch: bool = False,
        on_applied: Callable[[], None] | None = None,
    ) -> None:
        """``tiers``: the secondary tiers, in the ledger's order (their removals are
        reported); ``batch``: one job per (kind, tier); ``on_applied``: called after each
        run of applied results (the async API wakes its waiters, publishes events)."""
        self.ledger = ledger
        self.tiers = list(tiers)
        self.batch = batch
        self._on_applied = on_applied
        self._in_flight: dict[int, Job] = {}  # jobs made here, result not applied yet
        self._deferred: list[Job] = []
        self._delivered: collections.deque[JobResult] = collections.deque()
        self._bell: anyio.Event | None = None  # the owner task waits on it
        self._stack: contextlib.AsyncExitStack | None = None
        self._warn = RateLimited(log, _WARN_INTERVAL_S, level="error")

    # --- tasks out ---------------------------------------------------------------------

    def take_jobs(self, *, cascades: bool = True) -> list[Job]:
        """The jobs deferred earlier, then jobs for the tasks the ledger decided since
        (``cascades`` False: not the cascades, which stay queued in the ledger)."""
        jobs, self._deferred = self._deferred, []
        tasks = self.ledger.take_tasks(cascades=cascades)
        if tasks:
            jobs += self.jobs(tasks)
        return jobs

    def jobs(self, tasks: Sequence[TierTask]) -> list[Job]:
        """Jobs carrying ``tasks`` (one each, or batched per (kind, tier))."""
        if self.batch:
            made = [_batched(group) for group in _by_kind_and_tier(tasks)]
        else:
            made = [Job(t.kind, t.keys, t.slot_ids, tier=t.tier, tasks=(t,)) for t in tasks]
        in_flight = self._in_flight
        for job in made:
            in_flight[job.job_id] = job
        return made

    def in_flight(self) -> list[Job]:
        """Jobs made here whose result was not applied yet (deferred ones included)."""
        return list(self._in_flight.values())

    def has_pending_work(self) -> bool:
        return bool(self._in_flight or self._delivered)

    # --- results in: the one place they are applied -------------------------------------

    def apply(self, result: JobResult) -> None:
        """Apply one result to the ledger (see the module docstring); never raises."""
        self._in_flight.pop(result.job_id, None)
        if not result.tasks:
            self.apply_copy(result.kind, result.keys, result.ok, job_id=result.job_id)
            return
        start = 0
        for task in result.tasks:
            end = start + len(task.keys)
            try:
                self.ledger.apply(task.task_id, result.ok[start:end])
            except Exception as exc:
                self._failed(exc, result.job_id, task.kind, tier=task.tier, task=task.task_id)
            start = end
        for tier in dict.fromkeys(task.tier for task in result.tasks):
            try:
                self.ledger.tier_removed(tier, self.tiers[tier].take_removed())
            except Exception as exc:
                self._failed(exc, result.job_id, result.kind, tier=tier, removals=True)

    def apply_copy(
        self, kind: JobKind, keys: Sequence[bytes], ok: Sequence[bool], *, job_id: int = 0
    ) -> None:
        """Apply a device copy's outcome: a STORE's keys that arrived become readable (and
        cascade), the others are freed; a LOAD's pins are released. Never raises."""
        try:
            if kind is JobKind.STORE:
                good = keys if all(ok) else [key for key, flag in zip(keys, ok) if flag]
                if good:
                    self.ledger.complete_store(good, True)
                if len(good) < len(keys):
                    self.ledger.complete_store([k for k, f in zip(keys, ok) if not f], False)
            elif kind is JobKind.LOAD:
                self.ledger.complete_load(keys)
            else:
                raise ValueError(f"a {kind.value} job carries no ledger task")
        except Exception as exc:
            self._failed(exc, job_id, kind, keys=len(keys))

    def abandon(self, jobs: Iterable[Job], error: BaseException) -> None:
        """Apply jobs that never ran (none was queued) as failed whole with ``error``."""
        for job in jobs:
            self.apply(JobResult.failure(job, error))

    def _failed(self, exc: Exception, job_id: int, kind: JobKind, **fields: object) -> None:
        self._warn(
            "applying a job result to the ledger failed",
            job_id=job_id,
            kind=kind.value,
            **fields,
            error=repr(exc),
            exc_info=exc,
        )

    # --- a synchronous owner -----------------------------------------------------------

    def collect(self, items: Iterable[JobResult | Deferred]) -> None:
        """Apply what `ThreadedEngine.poll` returned; hold deferred jobs for `take_jobs`."""
        applied = False
        for item in items:
            if isinstance(item, Deferred):
                self._deferred.append(item.job)
            else:
                self.apply(item)
                applied = True
        if applied:
            self._applied()

    # --- an async owner ----------------------------------------------------------------

    def deliver(self, result: JobResult) -> None:
        """The engine's ``on_result``: queue the result for the owner (applies nothing)."""
        self._delivered.append(result)
        if self._bell is not None:
            self._bell.set()

    def apply_delivered(self) -> None:
        """Apply every result delivered so far, in order, here (the owner's thread)."""
        delivered = self._delivered
        if not delivered:
            return
        while delivered:
            self.apply(delivered.popleft())
        self._applied()

    def _applied(self) -> None:
        if self._on_applied is not None:
            try:
                self._on_applied()
            except Exception as exc:
                self._warn("after applying job results", error=repr(exc), exc_info=exc)

    async def __aenter__(self) -> TaskRunner:
        """Start the owner task, which applies delivered results as they come."""
        async with contextlib.AsyncExitStack() as stack:
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)
            await tg.start(self._own)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the owner task, then apply what is left (the engine closed first: the
        cancelled results of its last jobs are here)."""
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                await stack.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:  # the body's own exception, wrapped: unwrap
            if exc is None or group.split(lambda e: e is exc)[1] is not None:
                raise
        finally:
            self._bell = None
            self.apply_delivered()

    async def _own(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        bell = self._bell = anyio.Event()
        task_status.started()
        while True:
            await bell.wait()
            bell = self._bell = anyio.Event()
            self.apply_delivered()


def _by_kind_and_tier(tasks: Sequence[TierTask]) -> Iterable[list[TierTask]]:
    groups: dict[tuple[JobKind, int], list[TierTask]] = {}
    for task in tasks:
        groups.setdefault((task.kind, task.tier), []).append(task)
    return groups.values()


def _batched(tasks: list[TierTask]) -> Job:
    first = tasks[0]
    keys = first.keys if len(tasks) == 1 else tuple(k for t in tasks for k in t.keys)
    slots = first.slot_ids if len(tasks) == 1 else np.concatenate([t.slot_ids for t in tasks])
    return Job(first.kind, keys, slots, tier=first.tier, tasks=tuple(tasks))
