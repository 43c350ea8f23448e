"""EventBridge with a fake device event whose completion the test controls.

`FakeEvent` completes when the test calls ``complete()``: ``query()`` reads a
``threading.Event`` and ``synchronize()`` blocks on it, like a CUDA event. Nothing here
waits on a timer: ordering comes from ``wait_all_tasks_blocked`` and thread events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest

from kvtier_async.transfer import BridgeClosedError, BridgeStrategy, EventBridge

STRATEGIES = [BridgeStrategy.THREAD, BridgeStrategy.POLL]


class FakeEvent:
    def __init__(self, error: BaseException | None = None) -> None:
        self._done = threading.Event()
        self._error = error
        self.synchronized = threading.Event()  # set once a waiter thread blocks on it

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise self._error
        return self._done.is_set()

    def synchronize(self) -> None:
        self.synchronized.set()
        self._done.wait()
        if self._error is not None:
            raise self._error


def make_bridge(strategy: BridgeStrategy) -> EventBridge:
    # A tiny poll interval keeps the poll strategy quick; correctness never depends on it.
    return EventBridge(strategy, name="test", poll_initial_s=1e-5, poll_max_s=1e-3)


async def wait_recording(bridge: EventBridge, event: FakeEvent, done: list[str], tag: str) -> None:
    await bridge.wait(event)
    done.append(tag)


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_wait_returns_only_after_completion(strategy: BridgeStrategy) -> None:
    bridge = make_bridge(strategy)
    event, done = FakeEvent(), list[str]()
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_recording, bridge, event, done, "e")
        await anyio.wait_all_tasks_blocked()
        assert done == []
        event.complete()
    assert done == ["e"]
    stats = bridge.statistics()
    assert (stats.waits_started, stats.waits_completed, stats.waiting) == (1, 1, 0)
    bridge.close()


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_completed_event_returns_at_once(strategy: BridgeStrategy) -> None:
    bridge = make_bridge(strategy)
    event = FakeEvent()
    event.complete()
    await bridge.wait(event)
    assert bridge.statistics().waits_completed == 1
    bridge.close()


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_many_events_completed_out_of_order(strategy: BridgeStrategy) -> None:
    bridge = make_bridge(strategy)
    events = [FakeEvent() for _ in range(5)]
    done: list[str] = []
    async with anyio.create_task_group() as tg:
        for index, event in enumerate(events):
            tg.start_soon(wait_recording, bridge, event, done, str(index))
        await anyio.wait_all_tasks_blocked()
        for index in (3, 1, 4, 0, 2):
            events[index].complete()
    assert sorted(done) == ["0", "1", "2", "3", "4"]
    bridge.close()


@pytest.mark.anyio
async def test_waiter_thread_synchronizes_in_submission_order() -> None:
    bridge = make_bridge(BridgeStrategy.THREAD)
    first, second = FakeEvent(), FakeEvent()
    done: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_recording, bridge, first, done, "first")
        await anyio.to_thread.run_sync(first.synchronized.wait)
        tg.start_soon(wait_recording, bridge, second, done, "second")
        await anyio.wait_all_tasks_blocked()
        second.complete()  # the thread still blocks on `first`
        await anyio.wait_all_tasks_blocked()
        assert done == []
        assert not second.synchronized.is_set()
        first.complete()
    assert sorted(done) == ["first", "second"]  # woken together: trio orders them at random
    bridge.close()


@pytest.mark.anyio
async def test_the_waiter_thread_does_not_wait_for_a_busy_loop() -> None:
    """A completion is handed to the loop without waiting for the loop to run it: while the
    loop is busy (blocked here on purpose), the thread goes on to the next event."""
    bridge = make_bridge(BridgeStrategy.THREAD)
    first, second = FakeEvent(), FakeEvent()
    done: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_recording, bridge, first, done, "first")
        await anyio.to_thread.run_sync(first.synchronized.wait, abandon_on_cancel=True)
        tg.start_soon(wait_recording, bridge, second, done, "second")
        await anyio.wait_all_tasks_blocked()  # `second` queued behind `first`
        first.complete()
        reached = second.synchronized.wait(30.0)  # the loop blocked, as by a long callback
        second.complete()
        assert reached, "the waiter thread waited for the loop before the next event"
    assert sorted(done) == ["first", "second"]  # woken together: trio orders them at random
    bridge.close()


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_device_error_reaches_the_waiter(strategy: BridgeStrategy) -> None:
    bridge = make_bridge(strategy)
    event = FakeEvent(error=RuntimeError("CUDA error: an illegal memory access"))
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await bridge.wait(event)
        except RuntimeError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        event.complete()
    assert [str(e) for e in errors] == ["CUDA error: an illegal memory access"]
    bridge.close()


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_cancelled_wait_leaves_the_bridge_usable(strategy: BridgeStrategy) -> None:
    bridge = make_bridge(strategy)
    abandoned, later = FakeEvent(), FakeEvent()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge.wait, abandoned)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    abandoned.complete()
    later.complete()
    await bridge.wait(later)
    bridge.close()


@pytest.mark.anyio
async def test_closed_bridge_refuses_waits_and_its_thread_exits() -> None:
    bridge = make_bridge(BridgeStrategy.THREAD)
    event = FakeEvent()
    async with anyio.create_task_group() as tg:
        tg.start_soon(bridge.wait, event)
        await anyio.wait_all_tasks_blocked()
        event.complete()
    bridge.close()
    with pytest.raises(BridgeClosedError):
        await bridge.wait(FakeEvent())
    assert await anyio.to_thread.run_sync(bridge.join, 30.0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_waiter_survives_a_finished_event_loop(backend: str) -> None:
    """An event completing after its loop ended is dropped; the thread keeps serving."""
    bridge = make_bridge(BridgeStrategy.THREAD)
    orphan = FakeEvent()

    async def abandon() -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(bridge.wait, orphan)
                await anyio.to_thread.run_sync(orphan.synchronized.wait)
                scope.cancel()

    anyio.run(abandon, backend=backend)
    orphan.complete()  # the waiter thread now fails to reach the finished loop
    fresh = FakeEvent()

    async def serve(complete: Callable[[], None]) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge.wait, fresh)
            await anyio.wait_all_tasks_blocked()
            complete()

    anyio.run(serve, fresh.complete, backend=backend)
    assert bridge.statistics().waiting == 0
    bridge.close()
    assert bridge.join(30.0)


def test_bad_poll_intervals() -> None:
    with pytest.raises(ValueError, match="poll_initial_s"):
        EventBridge("poll", poll_initial_s=0.01, poll_max_s=0.001)
    with pytest.raises(ValueError):
        EventBridge("spin")
