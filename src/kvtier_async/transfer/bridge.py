"""The event bridge: a device event's completion wakes the task awaiting it, loop unblocked.

A CUDA copy records an event on its stream; `EventBridge.wait` returns once that event has
completed, without ever blocking the event loop. Two strategies sit behind the one method:

``thread`` (the default)
    One waiter thread per bridge (a bridge per device) takes events in submission order,
    calls ``event.synchronize()`` (which blocks that thread only, GIL released by CUDA) and
    hands the result back without waiting (the loop backend's ``run_sync_soon`` on the
    task's `anyio.lowlevel.EventLoopToken`), which sets an `anyio.Event` in the awaiting
    task's loop. Events are synchronised in order, so one completing early waits for those
    queued before it; handlers serialise their transfers on the device anyway, so
    completions arrive in that order.
``poll``
    The awaiting task calls ``event.query()`` and sleeps with exponential backoff between
    queries (``poll_initial_s`` doubling up to ``poll_max_s``). No thread; the price is up to
    ``poll_max_s`` of extra latency and wake-ups while waiting. The event loops sleep in
    whole milliseconds (asyncio rounds its selector's timeout up to 1 ms), so on an H200
    (``kvtier bench gpu``, 2026-12-04) a 0.1 ms copy woke its poller after 1.1-1.3 ms,
    against 80-130 us (p50) through the thread.

Which wins is measured on a GPU by ``kvtier bench gpu`` (completion latency of both).

Anything with ``query() -> bool`` and ``synchronize() -> None`` is an event here, so tests
drive the bridge with a fake whose completion they control. An exception raised by
``synchronize()`` or ``query()`` is raised by `wait`. A cancelled `wait` returns at once;
the event still completes on the device (callers that must not return before the copy
ends, like the transfer handlers, wait again under a shield).
"""

from __future__ import annotations

import enum
import queue
import threading
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

import anyio
import anyio.from_thread
import anyio.lowlevel

from kvtier_async._log import get_logger

__all__ = [
    "BridgeClosedError",
    "BridgeStatistics",
    "BridgeStrategy",
    "CompletionEvent",
    "EventBridge",
]

log = get_logger(__name__)

DEFAULT_POLL_INITIAL_S: Final = 20e-6
DEFAULT_POLL_MAX_S: Final = 1e-3


class CompletionEvent(Protocol):
    """What the bridge waits on: a ``torch.cuda.Event`` or anything shaped like one."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class BridgeStrategy(enum.StrEnum):
    THREAD = "thread"
    POLL = "poll"


class BridgeClosedError(RuntimeError):
    """The bridge was closed; no new waits are accepted."""


class BridgeStatistics(NamedTuple):
    strategy: BridgeStrategy
    waits_started: int
    waits_completed: int
    waiting: int  # events handed to the waiter thread and not yet completed


@dataclass(eq=False)
class _Waiter:
    event: CompletionEvent
    done: anyio.Event
    token: anyio.lowlevel.EventLoopToken
    error: BaseException | None = field(default=None)


_STOP: Final = None


class EventBridge:
    """Turns device-event completion into a wake-up inside the anyio loop.

    Args:
        strategy: ``"thread"`` (a waiter thread) or ``"poll"`` (``query()`` with backoff).
        name: Names the waiter thread (e.g. the device).
        poll_initial_s: First poll interval.
        poll_max_s: Longest poll interval.
    """

    def __init__(
        self,
        strategy: BridgeStrategy | str = BridgeStrategy.THREAD,
        *,
        name: str = "device",
        poll_initial_s: float = DEFAULT_POLL_INITIAL_S,
        poll_max_s: float = DEFAULT_POLL_MAX_S,
    ) -> None:
        self._strategy = BridgeStrategy(strategy)
        if not 0 < poll_initial_s <= poll_max_s:
            raise ValueError(
                f"need 0 < poll_initial_s <= poll_max_s, got {poll_initial_s}, {poll_max_s}"
            )
        self._name = name
        self._poll_initial_s = poll_initial_s
        self._poll_max_s = poll_max_s
        self._queue: queue.SimpleQueue[_Waiter | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._started = 0
        self._completed = 0
        self._waiting = 0

    @property
    def strategy(self) -> BridgeStrategy:
        return self._strategy

    @property
    def closed(self) -> bool:
        return self._closed

    async def wait(self, event: CompletionEvent) -> None:
        """Return once ``event`` has completed (always a checkpoint)."""
        if self._closed:
            raise BridgeClosedError("the event bridge is closed")
        self._started += 1
        if event.query():
            await anyio.lowlevel.checkpoint()
        elif self._strategy is BridgeStrategy.POLL:
            await self._poll(event)
        else:
            await self._wait_in_thread(event)
        self._completed += 1

    def statistics(self) -> BridgeStatistics:
        return BridgeStatistics(self._strategy, self._started, self._completed, self._waiting)

    def close(self) -> None:
        """Stop accepting waits; the waiter thread finishes what it holds, then exits.

        Never blocks (the waiter may need the event loop to deliver its last results).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._queue.put(_STOP)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the waiter thread to exit (after `close`); True if it has. Call it
        outside the event loop thread, or from a worker thread."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # -- strategies -------------------------------------------------------------------

    async def _poll(self, event: CompletionEvent) -> None:
        delay = self._poll_initial_s
        while True:
            await anyio.sleep(delay)
            if event.query():
                return
            delay = min(delay * 2, self._poll_max_s)

    async def _wait_in_thread(self, event: CompletionEvent) -> None:
        waiter = _Waiter(event, anyio.Event(), anyio.lowlevel.current_token())
        with self._lock:
            if self._closed:
                raise BridgeClosedError("the event bridge is closed")
            self._ensure_thread()
            self._waiting += 1
            self._queue.put(waiter)
        await waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kvtier-event-bridge-{self._name}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        """The waiter thread: synchronise events in order, wake their tasks."""
        while True:
            waiter = self._queue.get()
            if waiter is _STOP:
                return
            try:
                waiter.event.synchronize()
            except BaseException as exc:  # delivered to the awaiting task
                waiter.error = exc
            with self._lock:
                self._waiting -= 1
            try:
                _wake(waiter)
            except Exception as exc:  # the loop is gone: nobody is waiting any more
                log.debug("event bridge could not wake a waiter", error=repr(exc))


def _wake(waiter: _Waiter) -> None:
    """Schedule ``waiter.done.set()`` in the waiter's loop without waiting for it to run.

    The thread goes straight on to the next event, so a loop busy in a long callback holds
    up no other completion; a blocking hand-off (``anyio.from_thread.run_sync``) would, and
    could wait forever on a loop that ends before running it. Where the backend class
    lacks ``run_sync_soon`` (anyio before it had one), that blocking hand-off is used."""
    token = waiter.token
    schedule = getattr(token.backend_class, "run_sync_soon", None)
    if schedule is None:
        anyio.from_thread.run_sync(waiter.done.set, token=token)
    else:
        schedule(waiter.done.set, (), token.native_token)
