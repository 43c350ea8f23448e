"""``kill -9`` during stores, then a restart with the same instance id on the same root.

A writer child (`faults._workers`) stores batches through `TieredKVCache` with an fs tier on
a disk directory and reports, after each drain, the keys the cache confirmed stored. The
parent waits for a random number of those reports, lets a random few milliseconds pass (so
the kill lands inside a store, a cascade or a drain), sends SIGKILL, reaps it, and opens a
cache with the same ``instance_id`` on the same root: the open must succeed (the dead
writer's /dev/shm region is reclaimed), its temporary files must be gone, every confirmed key
must load byte for byte, and any other key of the stream it finds must too.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import anyio

from faults._common import (
    DISK,
    KILL_BOUNDS,
    Calls,
    Child,
    Row,
    Watched,
    audit,
    cache_config,
    fs_tier,
    key_of,
    private_dir,
)

TRIALS = 20
BLOCK = 64 << 10
BATCH = 8
BOUND_S = 10.0  # opening a cache on a root with a crashed writer's leftovers, and audit calls
READY_S = 60.0  # a child's start-up (imports) on a busy machine


def run(seed: int) -> Iterator[Row]:
    row = Row(
        f"kill -9 during stores, restart on the same root ({TRIALS}x)",
        bound_s=BOUND_S,
        bounds=[KILL_BOUNDS],
    )
    row.recovery_bound_s = BOUND_S
    rng = random.Random(f"{seed}-kill")
    recoveries, temps = [], []
    for trial in range(TRIALS):
        root = private_dir(DISK, "kill")
        try:
            recovery, left = kill_and_restart(row, root, f"{seed}-kill-{trial}", rng)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        recoveries.append(recovery)
        temps.append(left)
        row.trials += 1
    row.recovery_s = max(recoveries)
    row.notes.append(
        f"{sum(1 for n in temps if n)} of {TRIALS} kills left temporary files ({sum(temps)} in "
        "all), each removed by the restart's open; recovery: from the kill until that open "
        "returned"
    )
    yield row


def kill_and_restart(row: Row, root: Path, stream: str, rng: random.Random) -> tuple[float, int]:
    instance = f"faults-kill-{stream}"
    tiers = json.dumps([fs_tier(root)])
    child = Child("writer", "--tiers", tiers, "--seed", stream, "--instance-id", instance,
                  "--block-bytes", str(BLOCK), "--batch", str(BATCH))  # fmt: skip
    durable: set[bytes] = set()
    try:
        child.expect("ready", READY_S)
        for _ in range(rng.randint(1, 6)):
            line = child.expect("durable", READY_S)
            durable.update(bytes.fromhex(h) for h in line.split()[1:])
        time.sleep(rng.uniform(0, 0.03))  # where the kill lands: not a check, a spread
    finally:
        child.kill()
    killed = time.monotonic()
    temps = len(list(root.rglob("*.tmp")))
    return anyio.run(restart, row, root, instance, stream, durable, killed), temps


async def restart(
    row: Row,
    root: Path,
    instance: str,
    stream: str,
    durable: set[bytes],
    killed: float,
) -> float:
    calls = Calls(row)
    config = cache_config(BLOCK, 64, fs_tier(root), instance_id=instance)
    cache = Watched(config)
    await calls("open after kill -9", cache.__aenter__)
    recovery = time.monotonic() - killed
    try:
        left = list(root.rglob("*.tmp"))
        if left:
            row.problems.append(f"{instance}: the open left {len(left)} temporary files")
        written = durable | {key_of(stream, i) for i in range(len(durable) + 2 * BATCH)}
        found = await audit(cache, sorted(written), calls)
        row.wrong_bytes += found.wrong_bytes
        row.durable_lost += found.lost(durable)
    finally:
        await calls("close", cache.__aexit__, None, None, None)
    return recovery
