"""The sync face: the engine on its own event-loop thread, for a synchronous owner.

vLLM's scheduler thread owns the ledger and must never wait on I/O. It hands jobs over with
`ThreadedEngine.submit`, which only appends to a thread-safe inbox and writes one byte to a
socket pair; a pump task in the loop wakes on that byte (``anyio.wait_readable``, so any
anyio backend works) and queues the jobs with ``submit_nowait``. A full queue answers "not
now": the job comes back from `poll` as `Deferred` and the owner offers it again next step.
Every job's result lands in a thread-safe outbox that the owner drains with `poll` at the
points of its step where it applies results. Only `drain` and `close` block, for resets and
shutdown.

(``BlockingPortal.start_task_soon`` was not used for submission: it waits for the loop to
run the spawn, so a busy loop would stall the scheduler thread.)
"""

from __future__ import annotations

import contextlib
import queue
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvtier_async._log import get_logger

from .engine import Engine, EngineClosed
from .jobs import Job, JobResult

__all__ = ["Deferred", "ThreadedEngine"]

log = get_logger(__name__)


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
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stack = contextlib.ExitStack()
        self._portal: BlockingPortal | None = None
        self.engine: Engine | None = None

    def __enter__(self) -> ThreadedEngine:
        with contextlib.ExitStack() as stack:
            stack.callback(self._close_sockets)
            portal = stack.enter_context(start_blocking_portal(self._backend))
            engine = portal.call(self._make_engine)
            stack.enter_context(portal.wrap_async_context_manager(engine))
            pump = portal.start_task_soon(self._pump, engine)
            stack.callback(pump.cancel)
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

    def _close_sockets(self) -> None:
        self._wake_r.close()
        self._wake_w.close()

    # --- owner's side (any one thread) ------------------------------------------------

    def submit(self, jobs: Iterable[Job], *, wake: bool = True) -> None:
        """Hand jobs to the engine without waiting; each one's result comes out of `poll`
        (its ``on_done`` is replaced). With ``wake=False`` they wait in the inbox for the
        next `wake`: a scheduler queues during its step and wakes the loop once at the end,
        when it is about to wait for the model anyway (waking the loop mid-step makes the
        two threads fight for the GIL)."""
        batch = list(jobs)
        if not batch:
            return
        if self._portal is None:
            raise EngineClosed("the threaded engine is not running")
        for job in batch:
            job.on_done = self._outbox.put
        self._inbox.put(batch)
        if wake:
            self.wake()

    def wake(self) -> None:
        """Make the loop take the inbox now."""
        if self._inbox.empty():
            return
        with contextlib.suppress(BlockingIOError):  # a byte is waiting already
            self._wake_w.send(b"\0")

    def poll(self) -> list[JobResult | Deferred]:
        """Results (and deferred jobs) that arrived since the last call; never blocks."""
        out: list[JobResult | Deferred] = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._outbox.get_nowait())
        return out

    def has_pending_work(self) -> bool:
        engine = self.engine
        return not self._inbox.empty() or (engine is not None and engine.has_pending_work())

    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every job handed over so far ended (resets, shutdown)."""
        portal = self._portal
        if portal is None:
            return
        portal.call(self._drain, timeout_s)

    async def _drain(self, timeout_s: float | None) -> None:
        assert self.engine is not None
        with anyio.fail_after(timeout_s):
            self._take_inbox(self.engine)
            await self.engine.drain()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (sync or async) in the loop and wait for it (start-up, tests)."""
        if self._portal is None:
            raise EngineClosed("the threaded engine is not running")
        return self._portal.call(fn, *args)

    # --- loop's side ------------------------------------------------------------------

    async def _pump(self, engine: Engine) -> None:
        while True:
            await anyio.wait_readable(self._wake_r)
            with contextlib.suppress(BlockingIOError):
                self._wake_r.recv(4096)
            self._take_inbox(engine)

    def _take_inbox(self, engine: Engine) -> None:
        while True:
            try:
                batch = self._inbox.get_nowait()
            except queue.Empty:
                return
            for job in batch:
                self._submit(engine, job)

    def _submit(self, engine: Engine, job: Job) -> None:
        try:
            engine.submit_nowait(job)
        except anyio.WouldBlock:
            self._outbox.put(Deferred(job))
        except EngineClosed as exc:
            self._outbox.put(JobResult.failure(job, exc))
