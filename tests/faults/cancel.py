"""Every public call of `TieredKVCache` cancelled at random points, on asyncio and on trio.

A cache with an fs tier (1 MiB blocks, so a copy spans several of its cancellation checks)
runs a seeded random sequence of calls: lookup, store, load, drain, reset, and a second
cache's whole ``async with`` (open, store, exit: the exit drains). Each call is cancelled,
either by a deadline of a random few milliseconds (``move_on_after``) or by another task
that cancels its scope after a random number of scheduling points. After every call:

- ``drain`` ends (within `BOUND_S`) and then no slot is pinned or being written;
- a load that was cancelled: its destination is overwritten right after the call returned,
  and must still hold that after the drain (nothing of ours wrote it late); a load that
  finished must hold the right bytes;
- a second cache's ``async with`` cancelled anywhere leaves its region file removed and no
  temporary file under the root.

Every few calls the CPU tier is cleared and every block the cache confirmed stored in the
fs tier must load, byte for byte.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from faults._common import (
    DISK,
    LOCAL_BOUNDS,
    SENTINEL,
    Calls,
    Row,
    Watched,
    audit,
    cache_config,
    content,
    empty_block,
    fs_tier,
    guard,
    keys_of,
    private_dir,
    wrong_bytes,
)

BLOCK = 1 << 20
SLOTS = 24
TIER = "fs[0]"
CALLS = 150  # per backend
AUDIT_EVERY = 25
BOUND_S = 5.0  # a drain after a cancelled call: a few 1 MiB copies and files
POOL = 32  # keys the calls pick from
WHOLE_EVERY = 3  # a store whose number is a multiple runs uncancelled (on a quiet machine the
# random cancellations cut nearly every store, and the durability audit had nothing to check)


def run(seed: int) -> Iterator[Row]:
    for backend in ("asyncio", "trio"):
        title = f"cancellation of every public call at random points ({backend})"
        row = Row(title, bound_s=BOUND_S, bounds=[LOCAL_BOUNDS])
        root = private_dir(DISK, "cancel")
        try:
            with guard(row):
                anyio.run(trial, row, root, random.Random(f"{seed}-{backend}"), backend=backend)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        yield row


class Cancelled:
    """Runs a call under a cancellation chosen by ``rng``, timed until it returned (so a
    call slow to give up shows); whether it was cut short."""

    def __init__(self, rng: random.Random, calls: Calls) -> None:
        self.rng = rng
        self.calls = calls

    async def __call__(self, name: str, fn: Callable[[], Awaitable[Any]]) -> bool:
        started = time.monotonic()
        try:
            if self.rng.random() < 0.5:
                with anyio.move_on_after(self.rng.uniform(0, 0.005)) as scope:
                    await fn()
                return scope.cancelled_caught
            return await self._from_another_task(fn, self.rng.randrange(0, 12))
        finally:
            self.calls.record(f"{name} (cancelled)", time.monotonic() - started)

    @staticmethod
    async def _from_another_task(fn: Callable[[], Awaitable[Any]], points: int) -> bool:
        scope = anyio.CancelScope()

        async def cancel_later() -> None:
            for _ in range(points):
                await anyio.lowlevel.checkpoint()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_later)
            with scope:
                await fn()
            tg.cancel_scope.cancel()
        return scope.cancelled_caught


async def trial(row: Row, root: Path, rng: random.Random) -> None:
    calls = Calls(row)
    cancel = Cancelled(rng, calls)
    pool = keys_of(f"cancel-{rng.random()}", POOL)
    config = cache_config(BLOCK, SLOTS, fs_tier(root))
    durable: set[bytes] = set()
    cut = 0
    async with Watched(config) as cache:
        for number in range(CALLS):
            op = rng.choice(["lookup", "store", "load", "drain", "reset", "async with"])
            keys = rng.sample(pool, rng.randint(1, 6))
            if op == "store" and number % WHOLE_EVERY == 0:
                await calls("store", call(cache, op, keys))  # some stores end: blocks to audit
            elif op == "load":
                cut += await cancelled_load(row, cache, cancel, keys)
            elif op == "async with":
                cut += await cancelled_lifetime(row, config, cancel, keys)
            else:
                cut += await cancel(op, call(cache, op, keys))
            await check(row, calls, cache)
            durable |= cache.take_durable(TIER)
            if number % AUDIT_EVERY == AUDIT_EVERY - 1:
                found = await audit(cache, sorted(durable), calls)
                row.wrong_bytes += found.wrong_bytes
                row.durable_lost += found.lost(durable)
            row.trials += 1
    row.notes.append(f"{cut} of {CALLS} calls were cut short; {len(durable)} blocks confirmed")


def call(cache: Watched, op: str, keys: list[bytes]) -> Callable[[], Awaitable[Any]]:
    if op == "lookup":
        return lambda: cache.lookup(keys)
    if op == "store":
        return lambda: cache.store(keys, [content(key, BLOCK) for key in keys])
    return cache.drain if op == "drain" else cache.reset


async def cancelled_load(row: Row, cache: Watched, cancel: Cancelled, keys: list[bytes]) -> bool:
    """Load what a lookup found under a random cancellation; check what the blocks hold."""
    found = await cache.lookup(keys)
    keys = keys[:found]
    blocks = [empty_block(BLOCK) for _ in keys]
    arrived: list[int] = []

    async def load() -> None:
        arrived.append(await cache.load(keys, blocks))

    cut = await cancel("load", load)
    if cut:
        for block in blocks:  # ours from now on: nothing of the cache may write it
            block.fill(SENTINEL ^ 0xFF)
        await cache.drain()
        late = sum(int((block != SENTINEL ^ 0xFF).sum()) for block in blocks)
        if late:
            row.problems.append(f"a cancelled load wrote {late} bytes after it returned")
    elif arrived[0] != len(keys):
        row.problems.append(f"a load of {len(keys)} readable blocks loaded {arrived[0]}")
    else:
        row.wrong_bytes += sum(wrong_bytes(key, block) for key, block in zip(keys, blocks))
    return cut


async def cancelled_lifetime(
    row: Row, config: dict[str, Any], cancel: Cancelled, keys: list[bytes]
) -> bool:
    """A second cache's open, store and exit, cancelled anywhere."""
    other = Watched(config)

    async def lifetime() -> None:
        async with other:
            await other.store(keys, [content(key, BLOCK) for key in keys])

    cut = await cancel("async with", lifetime)
    region = Path(other.config.region_dir) / f"kvtier_{other.instance_id}.mmap"
    if region.exists():
        row.problems.append("a cancelled async with left its region file")
    root = Path(config["secondary_tiers"][0]["root_dir"])
    temps = list(root.rglob("*.tmp"))
    if temps:
        row.problems.append(f"a cancelled async with left {len(temps)} temporary files")
    return cut


async def check(row: Row, calls: Calls, cache: Watched) -> None:
    """Drain ends in time, and then nothing is pinned or being written."""
    with anyio.move_on_after(3 * BOUND_S) as scope:
        await calls("drain", cache.drain)
    if scope.cancelled_caught:
        row.problems.append(f"drain did not end within {3 * BOUND_S:g} s")
    stats = cache.ledger.primary.statistics()
    if stats.pinned or stats.writing:
        row.problems.append(f"after drain: {stats.pinned} pinned, {stats.writing} writing")
