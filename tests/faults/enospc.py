"""A full file system (ENOSPC) under the fs tier, on a small tmpfs mounted for the purpose.

The fs root is an 8 MiB tmpfs (test_tier_fs's `tiny_tmpfs`; where mounting is not allowed
the row says SKIPPED and why). Blocks are stored and confirmed first; then a ballast file
takes every free byte. During the fault each round stores new blocks, loads the resident ones
(the CPU tier must keep serving, byte for byte) and drains (the cascades fail). No partial
file may be left. Then the ballast goes, and the recovery is the time until a store reached
the fs tier again; every block confirmed before the fault must still load.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from faults._common import (
    FS_RECOVERY,
    LOCAL_BOUNDS,
    Calls,
    Row,
    Watched,
    audit,
    cache_config,
    deadline,
    fs_tier,
    guard,
    keys_of,
    load_one,
    recover,
    store,
)
from kvtier_async.tiers.fs import HEADER_BYTES
from test_tier_fs import tiny_tmpfs

BLOCK = 256 << 10
TIER = "fs[0]"
SIZE = "8m"
ROUNDS = 3
BOUND_S = 5.0  # local file I/O of a few 256 KiB blocks on a busy 2-core machine
RECOVERY_BOUND_S = BOUND_S  # the fs tier has no breaker: the next store may succeed
OUTER_S = 30.0


def run(seed: int) -> Iterator[Row]:
    row = Row(
        f"ENOSPC: fs root on a full {SIZE} tmpfs", bound_s=BOUND_S,
        recovery_bound_s=RECOVERY_BOUND_S, bounds=[LOCAL_BOUNDS, FS_RECOVERY],
    )  # fmt: skip
    try:
        with tiny_tmpfs(SIZE) as root, guard(row):
            anyio.run(trial, row, root, f"{seed}-enospc")
    except pytest.skip.Exception as skipped:
        row.skipped = str(skipped.msg)
    yield row


async def trial(row: Row, root: Path, seed: str) -> None:
    calls = Calls(row)
    before = keys_of(f"{seed}-before", 8)
    async with Watched(cache_config(BLOCK, 64, fs_tier(root))) as cache:
        await store(cache, before)
        await cache.drain()
        durable = cache.take_durable(TIER)
        if durable != set(before):
            row.problems.append("the blocks stored before the fault were not all confirmed")
        ballast = root / "ballast"
        fill(ballast)
        try:
            with deadline(row, "the calls during the fault", OUTER_S):
                await during(row, calls, cache, seed, before)
            check_files(row, root, ballast)
        finally:
            ballast.unlink()
        ended = time.monotonic()
        with deadline(row, "recovery", OUTER_S):
            row.recovery_s = await recover(cache, TIER, calls, seed, ended)
        found = await audit(cache, before, calls)
        row.wrong_bytes += found.wrong_bytes
        row.durable_lost += found.lost(durable)


def fill(path: Path) -> None:
    """Write ``path`` until the file system has no byte left."""
    chunk = b"\xff" * (64 << 10)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk = chunk[: len(chunk) // 2]
                if not chunk:
                    return


async def during(row: Row, calls: Calls, cache: Watched, seed: str, resident: list[bytes]) -> None:
    for number in range(ROUNDS):
        stored = await store(cache, keys_of(f"{seed}-full", 4, start=4 * number), calls)
        if len(stored.stored) != 4:
            row.problems.append("a store into the CPU tier failed while the disk was full")
        for key in resident:
            wrong = await load_one(cache, key, calls)
            if wrong is None:
                row.problems.append("the CPU tier did not serve a resident block")
            row.wrong_bytes += wrong or 0
        await calls("drain", cache.drain)
        if cache.take_durable(TIER):
            row.problems.append("a store reached a full file system")
        row.trials += 1
    if not cache.ledger.counters[0].cascade_failed:
        row.problems.append("no store failed: the file system was not full")


def check_files(row: Row, root: Path, ballast: Path) -> None:
    """Only whole block files: no temporaries, no short files."""
    for path in root.rglob("*"):
        if path == ballast or not path.is_file() or path.name == "config.json":
            continue
        if path.suffix != ".bin" or path.stat().st_size != HEADER_BYTES + BLOCK:
            row.problems.append(f"a partial file was left: {path.name} ({path.stat().st_size} B)")
