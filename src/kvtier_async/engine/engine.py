"""The engine: every tier's lanes inside one anyio task group.

``async with Engine(...)`` opens the tiers, starts each lane's workers with
``await tg.start(...)`` and, on exit, cancels the task group: a running job ends as a
cancelled result at its next checkpoint (a thread call finishes first: anyio does not
abandon threads), every queued job ends as cancelled, and each result reaches
``on_result``, so the ledger's owner releases every pin and reservation. Call `drain` first
for a graceful close that lets the work in flight finish.

Tiers are `TierBackend`s (every `kvtier_async.tiers` tier is one): the engine never
imports the tiers package. The engine never touches a ledger. It runs jobs and hands each
`JobResult`, once, in the event loop's thread, to one sink: ``on_result``. The sink only hands
the result over (the async API queues it for its owner task, `ThreadedEngine` puts it in its
outbox); the owner applies it with `kvtier_async.engine.runner.TaskRunner.apply`, never in a
lane's worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from types import TracebackType

import anyio
import anyio.lowlevel

from kvtier_async import defaults
from kvtier_async._log import get_logger
from kvtier_async.ledger import DeviceCounters

from .backend import TierBackend
from .jobs import Job, JobHandle, JobKind, JobResult
from .lane import Executor, Lane, LaneStatistics

__all__ = ["Engine", "EngineClosed"]

log = get_logger(__name__)

BlockView = Callable[[int], memoryview]
"""Primary-tier memory of one slot (page-aligned), by slot id."""


class EngineClosed(RuntimeError):
    """The engine is not running (not entered yet, or closed)."""


class Engine:
    """Runs jobs on per-tier lanes (I/O and lookups) and a device lane (GPU<->CPU copies)."""

    def __init__(
        self,
        tiers: Sequence[TierBackend],
        block_view: BlockView,
        *,
        device: Executor | None = None,
        device_workers: int = defaults.DEVICE_WORKERS,
        queue_depth: int = defaults.QUEUE_DEPTH,
        on_result: Callable[[JobResult], None] | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self.on_result = on_result  # every job's result, once (must only hand it over)
        self._block_view = block_view
        self._device = device
        self._device_workers = device_workers
        # The device lane's copies (each tier's lanes feed the tier's own `counters`).
        self.device_counters = DeviceCounters()
        self._depth = queue_depth
        self._lanes: dict[tuple[int, bool], Lane] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._closed = False
        self._inflight = 0
        self._idle = anyio.Event()
        self._idle.set()

    # --- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self._close_tiers)
            for tier in self.tiers:
                await tier.open()
                log.info("tier opened", tier=tier.name, kind=tier.kind)
            stack.callback(self._cancel_queued)  # runs after the task group ended
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)
            stack.callback(self._close_lanes)
            await self._start_lanes(tg)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        stack, self._stack = self._stack, None
        if stack is None:
            return None
        try:
            await stack.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The body ran inside the task group, which wrapped the body's own exception:
            # let it propagate as it was raised.
            if exc is None or group.split(lambda e: e is exc)[1] is not None:
                raise
        return None

    async def _start_lanes(self, tg: anyio.abc.TaskGroup) -> None:
        if self._device is not None:
            self._lanes[(-1, False)] = Lane(
                "device",
                self._device,
                workers=self._device_workers,
                depth=self._depth,
                counters=self.device_counters,
            )
        for index, tier in enumerate(self.tiers):
            io = Lane(
                tier.name,
                self._tier_io(tier),
                workers=tier.read_workers + tier.write_workers,
                depth=self._depth,
                counters=tier.counters,
            )
            lookups = Lane(
                f"{tier.name}:lookup",
                self._tier_lookup(tier),
                workers=1,
                depth=self._depth,
                counters=tier.counters,
            )
            self._lanes[(index, False)] = io
            self._lanes[(index, True)] = lookups
        for lane in self._lanes.values():
            for _ in range(lane.workers):
                await tg.start(lane.run_worker)

    def _close_lanes(self) -> None:
        self._closed = True
        for lane in self._lanes.values():
            lane.close()

    def _cancel_queued(self) -> None:
        cancelled = sum(lane.cancel_queued() for lane in self._lanes.values())
        if cancelled:
            log.info("engine closed with queued jobs cancelled", count=cancelled)

    async def _close_tiers(self) -> None:
        with anyio.CancelScope(shield=True):
            for tier in self.tiers:
                try:
                    await tier.aclose()
                except Exception as exc:
                    log.warning("tier close failed", tier=tier.name, error=repr(exc))

    # --- executors ---------------------------------------------------------------------

    def _tier_io(self, tier: TierBackend) -> Executor:
        async def run(job: Job) -> tuple[Sequence[bool], int]:
            blocks = [self._block_view(int(slot)) for slot in job.payload]
            if job.kind is JobKind.PROMOTE:
                ok = await tier.load(job.keys, blocks)
            else:
                ok = await tier.store(job.keys, blocks)
            return ok, sum(len(block) for block, good in zip(blocks, ok) if good)

        return run

    @staticmethod
    def _tier_lookup(tier: TierBackend) -> Executor:
        async def run(job: Job) -> tuple[Sequence[bool], int]:
            return await tier.lookup(job.keys), 0

        return run

    # --- submission --------------------------------------------------------------------

    def submit_nowait(self, job: Job) -> JobHandle:
        """Queue a job now, or raise `anyio.WouldBlock` ("not now": its queue is full).
        Raises `EngineClosed` when the engine is not running; nothing is queued then."""
        lane, handle = self._lane(job), JobHandle(job, self._job_done)
        try:
            lane.submit_nowait(handle)
        except anyio.ClosedResourceError:
            raise EngineClosed("the engine is closed") from None
        self._job_started()
        return handle

    async def submit(self, job: Job) -> JobHandle:
        """Queue a job, waiting for room in its queue. Cancelled while waiting, or on
        `EngineClosed`, nothing was queued. A checkpoint first, room or not (as trio asks
        of every async call: a caller looping on it lets other tasks and deadlines in)."""
        await anyio.lowlevel.checkpoint()
        lane, handle = self._lane(job), JobHandle(job, self._job_done)
        try:
            await lane.submit(handle)
        except anyio.ClosedResourceError:
            raise EngineClosed("the engine is closed") from None
        self._job_started()
        return handle

    def _lane(self, job: Job) -> Lane:
        if self._stack is None or self._closed:
            raise EngineClosed("the engine is not running")
        lane = self._lanes.get((job.tier, job.kind is JobKind.LOOKUP))
        if lane is None:
            raise ValueError(f"no lane for a {job.kind.value} job on tier {job.tier}")
        return lane

    def _job_started(self) -> None:
        if self._inflight == 0:
            self._idle = anyio.Event()
        self._inflight += 1

    def _job_done(self, result: JobResult) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()
        if self.on_result is not None:
            self.on_result(result)

    # --- state -------------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        return self._inflight > 0

    async def drain(self) -> None:
        """Wait until every job submitted so far (and any submitted meanwhile) ended; a
        checkpoint even when idle."""
        await anyio.lowlevel.checkpoint()
        while self._inflight:
            await self._idle.wait()

    def statistics(self) -> list[LaneStatistics]:
        return [lane.statistics() for lane in self._lanes.values()]

    def queue_depths(self) -> list[int]:
        """Per tier, in tier order: jobs queued or running in its lanes (I/O and lookups)."""
        depths = [0] * len(self.tiers)
        for (tier, _), lane in list(self._lanes.items()):
            if tier >= 0:
                stats = lane.statistics()
                depths[tier] += stats.queued_reads + stats.queued_writes + stats.running
        return depths
