"""Every public async call of the cache and of the engine passes a checkpoint, even when it
has nothing to wait for (all hits, no keys, all present, nothing to submit, idle).

A call that never yields starves every other task of its loop while a caller loops on it,
ignores a deadline around that loop, and keeps close from getting its turn. The checks
count turns, not time: a ticker task beside a loop of calls gets a turn per call only if
each call yields (none at all if none does, however fast the machine), and a deadline
around an endless loop of calls ends it only through a checkpoint (the loop is bounded by a
call count so that the failing case fails instead of hanging).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest

from kvtier_async.api import TieredKVCache
from kvtier_async.engine import Engine, Job
from kvtier_async.ledger import JobKind, make_offload_key

pytestmark = pytest.mark.anyio
BLOCK = 4096
CALLS_PER_CHECK = 200


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def config(slots: int = 8) -> dict[str, Any]:
    return {
        "block_bytes": BLOCK,
        "num_slots": slots,
        "secondary_tiers": [{"type": "memory"}],
    }


def held() -> list[np.ndarray]:
    return [np.full(BLOCK, i, dtype=np.uint8) for i in (1, 2)]


CacheCall = Callable[[TieredKVCache], Awaitable[object]]


async def _request_lookup(cache: TieredKVCache) -> int:
    async with cache.request("r") as request:
        return await request.lookup([k(1), k(2)])


async def _events(cache: TieredKVCache) -> None:
    async with cache.events():
        pass


# Each with nothing to wait for once keys 1 and 2 are stored and cascaded.
CACHE_CALLS: dict[str, CacheCall] = {
    "lookup all hits": lambda cache: cache.lookup([k(1), k(2)]),
    "lookup no keys": lambda cache: cache.lookup([]),
    "store all present": lambda cache: cache.store([k(1), k(2)], held()),
    "store no keys": lambda cache: cache.store([], []),
    "load no keys": lambda cache: cache.load([], []),
    "flush nothing": lambda cache: cache.flush(),
    "drain idle": lambda cache: cache.drain(),
    "request lookup": _request_lookup,
    "events": _events,
}


async def _turns_beside(calls: Callable[[], Awaitable[object]]) -> int:
    """How many turns a ticker task got while ``CALLS_PER_CHECK`` calls ran."""
    turns = 0
    running = True

    async def ticker() -> None:
        nonlocal turns
        while running:
            turns += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0)  # the ticker is running
        before = turns
        for _ in range(CALLS_PER_CHECK):
            await calls()
        seen = turns - before
        running = False
    return seen


async def _deadline_ends(calls: Callable[[], Awaitable[object]]) -> bool:
    """Whether a short deadline around a loop of calls ended it (bounded by a count)."""
    with anyio.move_on_after(0.01) as scope:
        for _ in range(200_000):
            await calls()
    return scope.cancelled_caught


async def _stored_cache(cache: TieredKVCache) -> None:
    await cache.store([k(1), k(2)], held())
    await cache.drain()
    assert await cache.lookup([k(1), k(2)]) == 2


@pytest.mark.parametrize("name", list(CACHE_CALLS))
async def test_each_cache_call_yields_with_nothing_to_wait_for(name: str) -> None:
    call = CACHE_CALLS[name]
    async with TieredKVCache(config()) as cache:
        await _stored_cache(cache)
        turns = await _turns_beside(lambda: call(cache))
        assert turns >= CALLS_PER_CHECK // 2, f"{name}: the ticker got {turns} turns"
        assert await _deadline_ends(lambda: call(cache)), f"{name}: the deadline was ignored"


async def test_close_ends_while_other_tasks_loop_on_store() -> None:
    ended: list[BaseException] = []
    looped = anyio.Event()

    async def loop(cache: TieredKVCache) -> None:
        try:
            # Bounded by a count: without checkpoints no deadline could end a livelock.
            for count in range(1, 20_000):
                await cache.store([k(1), k(2)], held())
                if count == 10:
                    looped.set()
        except RuntimeError as exc:  # the cache closed under it
            ended.append(exc)

    with anyio.fail_after(120):  # generous: the loops end by count long before
        async with anyio.create_task_group() as tg, TieredKVCache(config()) as cache:
            await _stored_cache(cache)
            for _ in range(2):
                tg.start_soon(loop, cache)
            await looped.wait()
    assert len(ended) == 2 and all("not open" in str(exc) for exc in ended)


ENGINE_CALLS: dict[str, Callable[[Engine], Awaitable[object]]] = {
    "submit with room": lambda engine: engine.submit(Job(JobKind.STORE, (b"k" * 8,))),
    "drain idle": lambda engine: engine.drain(),
}


@pytest.mark.parametrize("name", list(ENGINE_CALLS))
async def test_each_engine_call_yields(name: str) -> None:
    async def device(job: Job) -> tuple[list[bool], int]:
        return [True] * len(job.keys), 0

    call = ENGINE_CALLS[name]
    async with Engine([], lambda slot: memoryview(b""), device=device, queue_depth=1024) as engine:
        turns = await _turns_beside(lambda: call(engine))
        assert turns >= CALLS_PER_CHECK // 2, f"{name}: the ticker got {turns} turns"
        await engine.drain()


async def test_the_hits_of_a_lookup_are_still_there_for_the_load_right_after() -> None:
    """The checkpoints sit before each call's decision, never between a lookup's answer and
    the load's pins: another task storing (and evicting) all the while never makes the
    load right after a lookup fail."""
    stop = False

    async def churn(cache: TieredKVCache) -> None:
        i = 100
        while not stop:
            i += 1
            await cache.store([k(i), k(i + 1)], held())  # two slots: evicts everything else

    async with TieredKVCache(config(slots=2)) as cache, anyio.create_task_group() as tg:
        tg.start_soon(churn, cache)
        loaded = 0
        for _ in range(300):
            await cache.store([k(1)], held()[:1])
            hits = await cache.lookup([k(1)])
            loaded += await cache.load([k(1)][:hits], [np.zeros(BLOCK, np.uint8)][:hits])
        stop = True
    assert loaded > 0  # some lookups found the key before the churn evicted it
