"""The S3 endpoint refused, hung and slow, under a running `TieredKVCache` with an obj tier.

Five faults, on moto's S3 server on 127.0.0.1:

- refused: the server stopped (its port closed: connections are refused);
- hung, silent port: the server stopped and its port taken by `_s3.SilentServer`, which
  accepts connections, reads everything and never answers;
- hung, server paused: moto in a child process, stopped with SIGSTOP (it holds its
  connections and answers nothing) and resumed with SIGCONT;
- hung on writes: moto behind a TCP proxy (`faults._net.DelayProxy`) that holds every PUT
  (lookups and loads pass: a stuck write path);
- slow: moto behind that proxy, waiting before each chunk.

Before the fault, blocks are stored and confirmed in the bucket: some stay in the CPU tier
(resident), the others are only in the bucket (remote). During the fault, each round stores
new blocks, loads resident ones (the CPU tier must keep serving, byte for byte), looks up a
remote one (a miss or the right bytes, in time) and drains; a second cache stores a block
and closes. Every call is timed against its bound and cut off at an outer deadline. After
the fault ends, the recovery is the time until a store reached the bucket again; then every
block confirmed before the fault must load from the bucket.

Bounds (the obj tier's deadlines, ``timeout_s`` = `TIMEOUT_S`): an attempt of a request ends
within ``timeout_s`` and a request with its retries within ``2 * timeout_s``; a lookup's HEAD
within ``lookup_timeout_s`` (at most 1 s); the breaker opens on timeouts and probes again
after ``breaker_open_s`` (default 5 s); closing waits at most ``timeout_s`` for the tier.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio

from _s3 import SilentServer
from faults._common import (
    Audit,
    Calls,
    Row,
    Watched,
    audit,
    cache_config,
    deadline,
    guard,
    keys_of,
    load_one,
    recover,
    store,
)
from faults._net import DelayProxy
from kvtier_async.bench.s3server import MotoS3Server
from kvtier_async.tiers.s3 import DEFAULT_BREAKER_OPEN_S

BLOCK = 16 << 10
TIER = "obj[0]"
TIMEOUT_S = 1.0
CALL_BOUND_S = 2 * TIMEOUT_S + 2.0  # a request with its retries, plus 2 s for a busy machine
CLOSE_BOUND_S = CALL_BOUND_S + TIMEOUT_S  # a drain, then the tier's close
RECOVERY_BOUND_S = DEFAULT_BREAKER_OPEN_S + CALL_BOUND_S  # the next probe, then a store
BOUNDS = (
    f"S3 outages, timeout_s = {TIMEOUT_S:g} s: a request and its retries end within "
    f"2 x timeout_s, a cache's close adds the tier's close (timeout_s): {CLOSE_BOUND_S:g} s "
    f"with 2 s for a busy machine; recovery: the breaker's next probe ({DEFAULT_BREAKER_OPEN_S:g}"
    f" s) and a store, {RECOVERY_BOUND_S:g} s"
)
OUTER_S = 15.0  # calls still running then are cancelled, and the row fails
ROUNDS = 2
SLOW_DELAY_S = 0.25  # per chunk each way: a request takes about 2-4 chunks


class Outage:
    """A fault to `begin` and `end` (once; `end` does nothing if it did not begin)."""

    name = ""

    def __init__(self) -> None:
        self.active = False

    def begin(self) -> None:
        self._begin()
        self.active = True

    def end(self) -> None:
        if self.active:
            self.active = False
            self._end()

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError


class ServerOutage(Outage):
    """A fault of an S3 server; ``endpoint`` is what the tier uses."""

    def __init__(self, server: MotoS3Server) -> None:
        super().__init__()
        self.server = server

    @property
    def endpoint(self) -> str:
        return self.server.endpoint


class Refused(ServerOutage):
    name = "S3 refused (server stopped)"

    def _begin(self) -> None:
        self.server.stop()

    def _end(self) -> None:
        self.server.start()


class SilentPort(ServerOutage):
    name = "S3 hung (a port that never answers)"

    def _begin(self) -> None:
        self.server.stop()
        self._silent = SilentServer(self.server.port).__enter__()

    def _end(self) -> None:
        self._silent.__exit__(None, None, None)
        self.server.start()


class Paused(ServerOutage):
    name = "S3 hung (server paused, SIGSTOP)"

    def _begin(self) -> None:
        self.server.pause()

    def _end(self) -> None:
        self.server.resume()


class Proxied(ServerOutage):
    """A fault of the proxy between the tier and the server."""

    def __init__(self, server: MotoS3Server, proxy: DelayProxy) -> None:
        super().__init__(server)
        self.proxy = proxy

    @property
    def endpoint(self) -> str:
        return self.proxy.endpoint


class Slow(Proxied):
    name = f"S3 slow (proxy: +{SLOW_DELAY_S:g} s per chunk)"

    def _begin(self) -> None:
        self.proxy.delay_s = SLOW_DELAY_S

    def _end(self) -> None:
        self.proxy.delay_s = 0.0


class WritesHang(Proxied):
    name = "S3 hung on writes (PUTs never answered)"

    def _begin(self) -> None:
        self.proxy.hold_puts = True

    def _end(self) -> None:
        self.proxy.hold_puts = False


def run(seed: int) -> Iterator[Row]:
    for make in (Refused, SilentPort, Paused, WritesHang, Slow):
        with outage(make) as fault:
            row = Row(
                fault.name, bound_s=CLOSE_BOUND_S, recovery_bound_s=RECOVERY_BOUND_S,
                bounds=[BOUNDS],
            )  # fmt: skip
            bucket = f"outage-{uuid.uuid4().hex[:12]}"
            fault.server.create_bucket(bucket)
            tier = fault.server.tier_config(bucket, timeout_s=TIMEOUT_S)
            tier["endpoint_override"] = fault.endpoint
            with guard(row):
                anyio.run(trial, row, fault, tier, f"{seed}-{make.__name__}")
        yield row


@contextlib.contextmanager
def outage(make: type[ServerOutage]) -> Iterator[ServerOutage]:
    with MotoS3Server(in_process=make is not Paused) as server:
        if issubclass(make, Proxied):
            with DelayProxy(server.port) as proxy:
                yield make(server, proxy)
        else:
            yield make(server)


async def trial(row: Row, fault: ServerOutage, tier: dict[str, Any], seed: str) -> None:
    calls = Calls(row)
    closing: list[float] = []
    try:
        with deadline(row, "closing the cache", 4 * OUTER_S):  # the others run out first
            async with Watched(cache_config(BLOCK, 64, tier)) as cache:
                await around(row, calls, fault, cache, tier, seed)
                closing.append(time.monotonic())
    finally:
        if closing:
            calls.record("close", time.monotonic() - closing[0])


async def around(
    row: Row, calls: Calls, fault: ServerOutage, cache: Watched, tier: dict[str, Any],
    seed: str,
) -> None:  # fmt: skip
    """Before the fault, during it (`window`), the recovery, and the check after it."""
    remote, resident = keys_of(f"{seed}-remote", 8), keys_of(f"{seed}-resident", 8)
    durable = await before(cache, remote, resident)
    if durable != set(remote) | set(resident):
        row.problems.append("the blocks stored before the fault were not all confirmed")
    try:
        with deadline(row, "the calls during the fault", OUTER_S):
            await window(row, calls, fault, cache, tier, seed, remote, resident)
    finally:
        fault.end()
    ended = time.monotonic()
    with deadline(row, "recovery", OUTER_S):
        row.recovery_s = await recover(cache, TIER, calls, seed, ended)
    found = Audit()
    with deadline(row, "the check after the fault", OUTER_S) as scope:
        await audit(cache, [*remote, *resident], calls, found)
    row.wrong_bytes += found.wrong_bytes
    if not scope.cancelled_caught:  # a check cut short says so, and lost nothing
        row.durable_lost += found.lost(durable)


async def before(cache: Watched, remote: list[bytes], resident: list[bytes]) -> set[bytes]:
    """Store both sets and confirm them in the bucket; only ``resident`` stays in the CPU."""
    await store(cache, remote)
    await cache.drain()
    await cache.reset()
    await store(cache, resident)
    await cache.drain()
    return cache.take_durable(TIER)


async def window(
    row: Row,
    calls: Calls,
    fault: Outage,
    cache: Watched,
    tier: dict[str, Any],
    seed: str,
    remote: list[bytes],
    resident: list[bytes],
) -> None:
    """The fault, and the calls made during it; a second cache opened before it stores a
    block and closes during it."""
    async with Watched(cache_config(BLOCK, 8, tier)) as other:
        fault.begin()
        await during(row, calls, cache, seed, remote, resident)
        await store(other, keys_of(f"{seed}-other", 4), calls)
        closing = time.monotonic()
    calls.record("close", time.monotonic() - closing)


async def during(
    row: Row,
    calls: Calls,
    cache: Watched,
    seed: str,
    remote: list[bytes],
    resident: list[bytes],
) -> None:
    for number in range(ROUNDS):
        await store(cache, keys_of(f"{seed}-during", 8, start=8 * number), calls)
        for key in resident:
            wrong = await load_one(cache, key, calls)
            if wrong is None:
                row.problems.append("the CPU tier did not serve a resident block")
            row.wrong_bytes += wrong or 0
        wrong = await load_one(cache, remote[number], calls)  # a miss, or the right bytes
        row.wrong_bytes += wrong or 0
        await calls("drain", cache.drain)
        row.trials += 1
