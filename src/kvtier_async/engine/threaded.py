"""The sync face: the engine on its own event-loop thread, for a synchronous owner.

vLLM's scheduler thread owns the ledger and must never wait on I/O. It hands jobs over with
`ThreadedEngine.submit`, which only appends to a thread-safe inbox and rings a bell: it
releases a `threading.Lock` that the engine's bell thread waits on. The bell thread then
schedules a callback in the loop (the backend's own thread-safe ``call_soon``: asyncio's
``call_soon_threadsafe``, trio's ``run_sync_soon``) that queues the jobs with
``submit_nowait``, and goes back to the bell without waiting for it.
A full queue answers "not now": the job comes back from `poll` as `Deferred` and the owner
offers it again next step. Every job's result lands in a thread-safe outbox (the engine's
``on_result``) that the owner drains with `poll` at the points of its step where it applies
results (`kvtier_async.engine.runner.TaskRunner.collect`). Only `flush`, `drain` and
`close` block.

*Why a lock, not a socket.* Releasing a lock does not release the GIL; a ``send`` on a
socket (any system call made through Python) does, and the loop thread, woken by that very
byte, takes the GIL and runs its whole burst (taking the inbox, starting the jobs) while the
owner waits to get it back: measured in the sched benchmark, about 0.6 ms of vLLM's
``schedule()`` per step with an fs tier. With the bell the loop runs when the owner next
gives the GIL up, which vLLM's engine core does right after scheduling, while it waits for
the model (a busy owner gives it up at the interpreter's switch interval at the latest).

*Why a thread of our own.* Each thread wake-up costs tens of microseconds of CPU on a small
VM (measured: a ``call_soon_threadsafe`` round trip takes the loop thread 66 us), and in
vLLM's engine-core process that CPU is taken from the scheduler. A pump task waiting on the
bell through ``anyio.to_thread`` paid for three wake-ups per ring (the worker thread, the
loop, the worker thread again for the next wait) plus anyio's per-call machinery; the bell
thread pays for two (itself, the loop).

*Flushes.* Some jobs must end before the owner goes on (a store reading GPU blocks that the
next forward pass overwrites; every tier job before a cache reset frees the slots they
use). `flush` takes exactly those jobs, wherever they are: not handed over yet, waiting in
the inbox, deferred (in the outbox or held by the owner), queued or running. In the loop it
submits each one that has no place in a queue, waiting for room (``await engine.submit``),
and waits for them all, up to a deadline; while it runs, the pump defers none of them. At
the deadline, a job that has not started is cancelled (its cancelled result is in the
outbox at once) and a running one is cancelled at its next checkpoint: its result comes
when it really ended (a copy in a thread, or on a CUDA stream, finishes first; see
`kvtier_async.transfer.handlers`), so whatever it wrote is not reused before it reports.
Either way the job never runs later, and `flush` returns it as abandoned instead of
raising. The loop keeps every accepted job's handle until `poll` hands out its result, so
a flush knows a job that ended but was not polled yet from one never submitted.

*Idle waits.* An owner that spins (vLLM's engine core steps again at once when it scheduled
nothing, say while a request waits for a lookup) gives the GIL up only at the switch
interval, 5 ms, and the loop and its workers need it several times per job: measured in a
real engine, a tier lookup took 30 ms and a 7.5 MB promotion 40-60 ms that way. `wait` lets
such an owner block, GIL released, until a result arrives (a short timeout at most).

(``BlockingPortal.start_task_soon`` was not used for submission: it waits for the loop to
run the spawn, so a busy loop would stall the scheduler thread.)
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvtier_async._log import get_logger

from .engine import Engine, EngineClosed
from .jobs import Job, JobError, JobHandle, JobResult

sniffio: ModuleType | None
try:
    import sniffio
except ImportError:  # anyio does without it on asyncio
    sniffio = None

__all__ = ["Deferred", "ThreadedEngine"]

log = get_logger(__name__)

_BELL_CHECK_S = 1.0
_BELL_JOIN_S = 5.0  # how long close waits for the bell thread (it checks every _BELL_CHECK_S)

Soon = Callable[[Callable[[], None]], None]


@dataclass(frozen=True)
class Deferred:
    """A job the engine could not take now (its queue was full): offer it again later."""

    job: Job


class ThreadedEngine:
    """An `Engine` running on a background event loop, driven from one other thread."""

    def __init__(self, make_engine: Callable[[], Engine], *, backend: str = "asyncio") -> None:
        self._make_engine = make_engine
        self._backend = backend
        self._inbox: queue.SimpleQueue[list[Job]] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[JobResult | Deferred] = queue.SimpleQueue()
        self._arrived = threading.Event()  # set with each item put in the outbox
        self._bell = threading.Lock()  # released: the inbox has jobs to take
        self._bell.acquire()
        self._closing = False
        self._stack = contextlib.ExitStack()
        self._portal: BlockingPortal | None = None
        self.engine: Engine | None = None
        # Loop side: the handle of every job the engine accepted, until `poll` hands out its
        # result; the jobs a running flush owns (the pump defers none of them).
        self._accepted: dict[int, JobHandle] = {}
        self._flushing: dict[int, Job] = {}

    def __enter__(self) -> ThreadedEngine:
        with contextlib.ExitStack() as stack:
            portal = stack.enter_context(start_blocking_portal(self._backend))
            engine = portal.call(self._make_engine)
            if engine.on_result is not None:
                raise ValueError("make_engine: its results go to the outbox; set no on_result")
            engine.on_result = self._deliver
            stack.enter_context(portal.wrap_async_context_manager(engine))
            soon: Soon = portal.call(_loop_callbacks, self._backend)
            bell = threading.Thread(
                target=self._ring_loop, args=(soon, engine), name="kvtier-bell", daemon=True
            )
            bell.start()
            stack.callback(self._stop_bell, bell)  # first: before the loop stops
            self._portal, self.engine = portal, engine
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine (jobs in flight end as cancelled results in `poll`)."""
        self._portal = None
        self._stack.close()

    def _stop_bell(self, bell: threading.Thread) -> None:
        self._closing = True
        self._ring()
        bell.join(_BELL_JOIN_S)
        if bell.is_alive():  # a daemon thread: it cannot keep the process alive
            log.warning("the engine's bell thread did not stop", timeout_s=_BELL_JOIN_S)

    # --- owner's side (any one thread) ------------------------------------------------

    def submit(self, jobs: Iterable[Job], *, wake: bool = True) -> None:
        """Hand jobs to the engine without waiting; each one's result comes out of `poll`.
        With ``wake=False`` they wait in the inbox for the
        next `wake`: a scheduler queues during its step and wakes the loop once at the end,
        when it is about to wait for the model anyway (waking the loop mid-step makes the
        two threads fight for the GIL)."""
        batch = list(jobs)
        if not batch:
            return
        if self._portal is None:
            raise EngineClosed("the threaded engine is not running")
        self._inbox.put(batch)
        if wake:
            self.wake()

    def wake(self) -> None:
        """Make the loop take the inbox (without giving the GIL up: see the docstring)."""
        if not self._inbox.empty():
            self._ring()

    def _ring(self) -> None:
        with contextlib.suppress(RuntimeError):  # released already: a ring is pending
            self._bell.release()

    def poll(self) -> list[JobResult | Deferred]:
        """Results (and deferred jobs) that arrived since the last call; never blocks."""
        if self._outbox.empty():  # the common case, without raising queue.Empty
            return []
        self._arrived.clear()  # before taking: an item put from now on sets it again
        out: list[JobResult | Deferred] = []
        accepted = self._accepted
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._outbox.get_nowait()
                if accepted and isinstance(item, JobResult):
                    accepted.pop(item.job_id, None)
                out.append(item)
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until an item is in the outbox for `poll`, ``timeout_s`` at most; whether
        one is (it may have been there already). For an owner with nothing else to do: while
        it waits, its thread holds no GIL, so the loop and its workers run without waiting
        for it (see the module docstring)."""
        return self._arrived.wait(timeout_s) or not self._outbox.empty()

    def has_pending_work(self) -> bool:
        engine = self.engine
        return not self._inbox.empty() or (engine is not None and engine.has_pending_work())

    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every job the engine took ended; raises `TimeoutError` past
        ``timeout_s``. Jobs deferred meanwhile come back through `poll` and are not waited
        for: to make sure given jobs ended, `flush` them."""
        portal = self._portal
        if portal is None:
            return
        portal.call(self._drain, timeout_s)

    async def _drain(self, timeout_s: float | None) -> None:
        assert self.engine is not None
        with anyio.fail_after(timeout_s):
            self._take_inbox(self.engine)
            await self.engine.drain()

    def flush(self, jobs: Iterable[Job], timeout_s: float, *, grace_s: float = 0.0) -> list[Job]:
        """Block until each of ``jobs`` ended, or ``timeout_s`` passed; never raises a timeout.

        ``jobs`` may be anywhere short of having had their result polled: not handed over
        yet, in the inbox, deferred, queued or running (see the module docstring). Returns
        the jobs abandoned at the deadline: cancelled, so that none runs later; the result
        of each comes out of `poll`, at once for one that had not started, once it really
        ended for one that was running. ``grace_s`` is how long to wait for those after
        the deadline (a reset needs them ended; a worker's hook does not wait for them)."""
        batch = list(jobs)
        if not batch:
            return []
        portal = self._portal
        if portal is None:
            raise EngineClosed("the threaded engine is not running")
        abandoned: list[Job] = portal.call(self._flush, batch, timeout_s, grace_s)
        return abandoned

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (sync or async) in the loop and wait for it (start-up, tests)."""
        if self._portal is None:
            raise EngineClosed("the threaded engine is not running")
        return self._portal.call(fn, *args)

    # --- loop's side ------------------------------------------------------------------

    def _ring_loop(self, soon: Soon, engine: Engine) -> None:
        """The bell thread: each ring schedules `_take_inbox` in the loop, without waiting
        for it; ends when the engine closes (checked every `_BELL_CHECK_S` too)."""
        take = lambda: self._take_inbox(engine)  # noqa: E731
        while not self._closing:
            if not self._bell.acquire(timeout=_BELL_CHECK_S) or self._closing:
                continue
            try:
                soon(take)
            except RuntimeError:  # the loop has ended (trio's RunFinishedError is one)
                return

    def _take_inbox(self, engine: Engine) -> None:
        while True:
            try:
                batch = self._inbox.get_nowait()
            except queue.Empty:
                return
            for job in batch:
                self._submit(engine, job)

    def _deliver(self, item: JobResult | Deferred) -> None:
        """Any thread: put ``item`` in the outbox for `poll`, waking a `wait`."""
        self._outbox.put(item)
        self._arrived.set()

    def _submit(self, engine: Engine, job: Job) -> None:
        try:
            self._accepted[job.job_id] = engine.submit_nowait(job)
        except anyio.WouldBlock:
            if job.job_id not in self._flushing:  # a flush submits it, waiting for room
                self._deliver(Deferred(job))
        except Exception as exc:  # closed, or a job no lane takes: it fails, the rest go on
            self._fail(job, exc)

    def _fail(self, job: Job, error: BaseException, *, cancelled: bool = False) -> None:
        """End a job the engine never took: its failure goes out through an ended handle,
        so that a flush sees it ended."""
        handle = JobHandle(job, self._deliver)
        self._accepted[job.job_id] = handle
        handle.settle(JobResult.failure(job, error, cancelled=cancelled))

    async def _flush(self, jobs: list[Job], timeout_s: float, grace_s: float) -> list[Job]:
        assert self.engine is not None
        engine = self.engine
        wanted = {job.job_id: job for job in jobs}
        self._flushing = wanted
        try:
            self._take_inbox(engine)  # jobs handed over earlier go first, in order
            self._drop_deferrals(wanted)
            with anyio.move_on_after(timeout_s):
                for job in jobs:
                    if job.job_id not in self._accepted:
                        await self._submit_waiting(engine, job)
                for job in jobs:  # each one has a handle now
                    await _ended(self._accepted[job.job_id])
        finally:
            self._flushing = {}
        abandoned = self._abandon(jobs)
        if abandoned and grace_s > 0:
            with anyio.move_on_after(grace_s):
                for job in abandoned:
                    await _ended(self._accepted[job.job_id])
        return abandoned

    def _drop_deferrals(self, wanted: dict[int, Job]) -> None:
        """Take out of the outbox the `Deferred` items of jobs a flush now owns. The owner
        is blocked in `flush` and everything else that fills the outbox runs in this
        thread, so the other items go back in their order."""
        kept: list[JobResult | Deferred] = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._outbox.get_nowait()
                if not (isinstance(item, Deferred) and item.job.job_id in wanted):
                    kept.append(item)
        for item in kept:
            self._deliver(item)

    async def _submit_waiting(self, engine: Engine, job: Job) -> None:
        try:
            self._accepted[job.job_id] = await engine.submit(job)
        except EngineClosed as exc:
            self._fail(job, exc)

    def _abandon(self, jobs: list[Job]) -> list[Job]:
        """Cancel the jobs that did not end in time; which ones."""
        abandoned = []
        for job in jobs:
            handle = self._accepted.get(job.job_id)
            if handle is None:  # it never got a place in a queue
                error = TimeoutError(f"job {job.job_id} found no room before the deadline")
                self._fail(job, error, cancelled=True)
                abandoned.append(job)
            elif not handle.done():
                handle.cancel()
                abandoned.append(job)
        return abandoned


def _loop_callbacks(backend: str) -> Soon:
    """In the loop: a function that any thread may call to have a callback run in the loop
    soon, without waiting; in the callback, anyio knows its backend as in a task."""
    schedule: Callable[..., object]
    if backend == "asyncio":
        import asyncio

        schedule = asyncio.get_running_loop().call_soon_threadsafe
    elif backend == "trio":
        import trio

        schedule = trio.lowlevel.current_trio_token().run_sync_soon
    else:
        raise ValueError(f"backend: ThreadedEngine runs on 'asyncio' or 'trio', not {backend!r}")
    context = contextvars.copy_context()
    if sniffio is not None:  # anyio asks sniffio when it is installed (trio needs it)
        context.run(sniffio.current_async_library_cvar.set, backend)

    def run(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:  # never into the loop (trio would end the run)
            log.exception("engine inbox callback failed")

    def soon(callback: Callable[[], None]) -> None:
        schedule(context.copy().run, run, callback)  # a context is entered once at a time

    return soon


async def _ended(handle: JobHandle) -> None:
    """Wait until the job of ``handle`` ended, however."""
    if not handle.done():
        with contextlib.suppress(JobError):
            await handle.wait()
