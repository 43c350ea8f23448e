"""The async API's request lifetimes, KV events and bounded state."""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

import anyio
import numpy as np
import pytest

from kvtier_async.api import TieredKVCache
from kvtier_async.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvtier_async.ledger import prefix_keys, split_offload_key

pytestmark = pytest.mark.anyio
BLOCK = 256


def cfg(slots: int = 64, **extra: Any) -> dict[str, Any]:
    return {
        "block_bytes": BLOCK,
        "num_slots": slots,
        "secondary_tiers": [{"type": "memory", "name": "mem"}],
        **extra,
    }


def blocks_for(keys: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer(key[:8] * (BLOCK // 8), dtype=np.uint8).copy() for key in keys]


def idle_state(cache: TieredKVCache) -> tuple[int, int, int, int]:
    stats = cache.stats()
    return stats.requests, stats.probes, stats.ledger.pinned, stats.ledger.writing


async def test_anonymous_calls_leave_nothing_behind() -> None:
    async with TieredKVCache(cfg()) as cache:
        for doc in range(20):
            keys = prefix_keys(range(doc * 1000, doc * 1000 + 64))
            hits = await cache.lookup(keys)
            await cache.load(keys[:hits], blocks_for(keys[:hits]))
            await cache.store(keys[hits:], blocks_for(keys[hits:]))
        await cache.drain()
        assert idle_state(cache) == (0, 0, 0, 0)
        assert cache.ledger.primary._events == []  # nobody listens: nothing recorded
        assert cache.ledger._events == []


async def test_a_request_scope_finishes_its_request() -> None:
    async with TieredKVCache(cfg()) as cache:
        keys = prefix_keys(range(64))
        async with cache.request("r1") as r:
            assert await r.lookup(keys) == 0
            await r.store(keys, blocks_for(keys))
            assert cache.stats().requests == 1  # alive while the block runs
            assert await r.lookup(keys) == 4
            out = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert await r.load(keys, out) == 4
        assert cache.stats().requests == 0
        await cache.drain()
        assert idle_state(cache) == (0, 0, 0, 0)


async def test_named_requests_are_released_by_request_finished() -> None:
    async with TieredKVCache(cfg()) as cache:
        for r in range(5):
            keys = prefix_keys(range(r, r + 32))
            await cache.lookup(keys, req=r)
            await cache.store(keys, blocks_for(keys), req=r)
        await cache.drain()
        assert cache.stats().requests == 5
        for r in range(5):
            cache.request_finished(r)
        assert idle_state(cache) == (0, 0, 0, 0)


async def test_a_request_needs_an_id() -> None:
    async with TieredKVCache(cfg()) as cache:
        with pytest.raises(ValueError, match="req: a request id is needed"):
            cache.request(None)


async def collect(stream: Any, into: list[KVEvent]) -> None:
    async for event in stream:
        into.append(event)


async def test_events_reach_a_listener_in_order() -> None:
    async with TieredKVCache(cfg(slots=4)) as cache:
        got: list[KVEvent] = []
        async with cache.events() as stream:
            keys = prefix_keys(range(64))  # 4 blocks: the CPU tier is full
            await cache.store(keys, blocks_for(keys))
            await cache.drain()  # cascaded to the memory tier
            more = prefix_keys(range(100, 132))  # 2 more: 2 evicted
            await cache.store(more, blocks_for(more))
            await cache.drain()
            await cache.reset()
            while True:
                try:
                    got.append(stream.receive_nowait())
                except anyio.WouldBlock:
                    break
        hashes = [split_offload_key(k)[0] for k in keys]
        assert got[0] == BlockStored(tuple(hashes), 0, "CPU")
        assert got[1] == BlockStored(tuple(hashes), 0, "STORAGE", "mem")
        evicted = [e for e in got if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        assert len(evicted[0].block_hashes) == 2
        assert any(isinstance(e, (BlockRemoved, AllBlocksCleared)) for e in got[-1:])
        assert cache.stats().events_dropped == 0
        # nobody listens any more: nothing is recorded
        await cache.store(prefix_keys(range(500, 516)), blocks_for(prefix_keys(range(500, 516))))
        assert cache.ledger.primary._events == []


async def test_a_slow_listener_loses_events_and_they_are_counted() -> None:
    async with TieredKVCache(cfg()) as cache, cache.events(buffer=1) as stream:
        for doc in range(3):
            keys = prefix_keys(range(doc * 100, doc * 100 + 16))
            await cache.store(keys, blocks_for(keys))
        await cache.drain()
        assert isinstance(stream.receive_nowait(), BlockStored)
        assert cache.stats().events_dropped >= 4  # 3 CPU + 3 STORAGE stores, 1 kept


async def test_a_block_a_tier_deletes_is_announced_and_forgotten(tmp_path: Any) -> None:
    config = {
        "block_bytes": 4096,
        "num_slots": 4,
        "secondary_tiers": [{"type": "fs", "name": "disk", "root_dir": str(tmp_path)}],
    }
    async with TieredKVCache(config) as cache:
        keys = prefix_keys(range(64))
        await cache.store(keys, [np.full(4096, i, np.uint8) for i in range(4)])
        await cache.drain()
        await cache.reset()  # the CPU tier forgets them: a lookup must promote from disk
        victim = next(
            os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".bin")
        )
        with open(victim, "r+b") as f:  # flip one payload byte
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0xFF]))
        got: list[KVEvent] = []
        async with cache.events() as stream:
            hits = await cache.lookup(keys)
            while True:
                try:
                    got.append(stream.receive_nowait())
                except anyio.WouldBlock:
                    break
        removed = [e for e in got if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
        assert len(removed) == 1 and removed[0].tier == "disk"
        assert hits < 4
        assert cache.stats().tiers[0].state.removed_damaged == 1  # type: ignore[attr-defined]


# --- soak --------------------------------------------------------------------------------------

SOAK_CALLS = 100_000
SOAK_REQUESTS = 10_000
GROWTH_BOUND = 512 * 1024  # bytes traced after warm-up that may still be held at the end


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the state is the same on trio
async def test_soak_has_no_unbounded_state() -> None:
    """100,000 lookup/load/store calls over 10,000 request ids with the CPU tier evicting:
    after warm-up, memory does not grow (beyond a small bound), and nothing leaks."""
    async with TieredKVCache(cfg(slots=128, secondary_tiers=[])) as cache:
        calls, req = 0, 0
        warm = SOAK_CALLS // 10
        out = [np.zeros(BLOCK, np.uint8) for _ in range(8)]
        src = blocks_for(prefix_keys(range(8 * 16)))
        while calls < SOAK_CALLS:
            if calls >= warm and not tracemalloc.is_tracing():
                tracemalloc.start()
                start = tracemalloc.get_traced_memory()[0]
            doc = req % 400  # shared prefixes: hits, misses and eviction
            keys = prefix_keys(range(doc * 50, doc * 50 + 128))[:8]
            named = req % 2 == 0
            scope = cache.request(f"req-{req % SOAK_REQUESTS}-{req}") if named else None
            for _turn in range(2):  # 10 calls per request: 2 x (lookup, load, store) + more
                if scope is not None:
                    hits = await scope.lookup(keys)
                    await scope.load(keys[:hits], out[:hits])
                    await scope.store(keys[hits:], src[hits:])
                else:
                    hits = await cache.lookup(keys)
                    await cache.load(keys[:hits], out[:hits])
                    await cache.store(keys[hits:], src[hits:])
                calls += 3
            if scope is not None:
                cache.request_finished(scope.req)
            req += 1
        await cache.drain()
        held = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.stop()
        assert idle_state(cache) == (0, 0, 0, 0)
        assert held < GROWTH_BOUND, f"{held} bytes allocated after warm-up are still held"
