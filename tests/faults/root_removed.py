"""The fs root, its namespace directory or a rank directory removed (``rm -rf``) while a
`TieredKVCache` stores into it.

A task stores and drains batch after batch; at a random point of that stream another thread
removes the directory. Stores must resume: the recovery is the time from the end of the
removal until a block stored after it reached the fs tier. Blocks confirmed before the
removal are gone by the operator's hand and are not counted as lost; every block confirmed
after it must load byte for byte, and nothing loaded may be wrong.
"""

from __future__ import annotations

import itertools
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread

from faults._common import (
    DISK,
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
    private_dir,
    store,
)
from kvtier_async.tiers.fs import FsTier

BLOCK = 64 << 10
BATCH = 4
TIER = "fs[0]"
TRIALS = 2  # per directory
BOUND_S = 5.0  # local file I/O of a few 64 KiB blocks on a busy 2-core machine
OUTER_S = 30.0


def run(seed: int) -> Iterator[Row]:
    rng = random.Random(f"{seed}-rm")
    row = Row(
        f"fs root / namespace / rank dir removed while storing ({3 * TRIALS}x)",
        bound_s=BOUND_S, recovery_bound_s=BOUND_S, bounds=[LOCAL_BOUNDS, FS_RECOVERY],
    )  # fmt: skip
    recoveries: list[float] = []
    for number in range(TRIALS):
        for level in ("root", "namespace", "rank"):
            parent = private_dir(DISK, "rm")
            try:
                with guard(row):
                    recovery = anyio.run(
                        trial, row, parent / "root", level, f"{seed}-{level}-{number}", rng
                    )
                    if recovery is None:
                        row.problems.append(f"no store reached the tier after the {level} went")
                    else:
                        recoveries.append(recovery)
            finally:
                shutil.rmtree(parent, ignore_errors=True)
            row.trials += 1
    row.recovery_s = max(recoveries, default=None)
    yield row


def target(tier: FsTier, level: str) -> Path:
    root = Path(tier.root_dir)
    namespace = root / tier.ctx.namespace
    return {"root": root, "namespace": namespace, "rank": namespace / f"r{tier.ctx.rank}"}[level]


async def trial(row: Row, root: Path, level: str, seed: str, rng: random.Random) -> float | None:
    calls = Calls(row)
    async with Watched(cache_config(BLOCK, 64, fs_tier(root))) as cache:
        (tier,) = cache.tiers
        assert isinstance(tier, FsTier)
        doomed = target(tier, level)
        removed: list[float] = []  # when the removal ended
        after: set[bytes] = set()  # confirmed from batches stored after it
        written: list[bytes] = []
        recovery = None

        async def remove() -> None:
            await anyio.sleep(rng.uniform(0.0, 0.2))
            await anyio.to_thread.run_sync(shutil.rmtree, doomed, True)
            removed.append(time.monotonic())

        with deadline(row, f"storing while the {level} goes", OUTER_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(remove)
                for number in itertools.count():
                    began_after = bool(removed)
                    keys = keys_of(f"{seed}-stream", BATCH, start=BATCH * number)
                    written += keys
                    await store(cache, keys, calls)
                    await calls("drain", cache.drain)
                    durable = cache.take_durable(TIER)
                    if began_after and durable:
                        after |= durable
                        recovery = time.monotonic() - removed[0]
                        break
        found = await audit(cache, written, calls)
        row.wrong_bytes += found.wrong_bytes
        row.durable_lost += found.lost(after)
    return recovery
