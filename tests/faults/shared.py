"""Two processes on one fs root, and two on one bucket, with a third reading every byte.

Two writer children (`faults._workers`) store the same stream of blocks at once, one in
order and one shuffled, so they race on the same names; each prints the keys its cache
confirmed stored. A reader child, on the same root or bucket with a cache of its own, loads
random blocks of the stream (its CPU tier cleared every few loads, so they come from the
shared tier) and checks every byte, until the writers are done. Then every key either
writer confirmed must load here, byte for byte. How many loads the reader got in while the
writers ran is noted, not judged: it depends on how busy the machine is.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

from faults._common import (
    DISK,
    Calls,
    Child,
    Row,
    Watched,
    audit,
    cache_config,
    fs_tier,
    guard,
    keys_of,
)
from faults._common import private_dir as make_dir
from kvtier_async.bench.s3server import MotoS3Server

BLOCK = 64 << 10
BATCH = 8
BATCHES = 12  # per writer: 96 blocks, the same 96 for both
TRIALS = 3
BOUND_S = 10.0  # a reader's lookup or load beside two writers on a busy 2-core machine
CHILD_S = 120.0
BOUNDS = "two writers and a reader: 10 s per reader call (three processes on a busy 2-core machine)"


def run(seed: int) -> Iterator[Row]:
    on_root = Row(
        f"2 writers + 1 reader on one fs root ({TRIALS}x)", bound_s=BOUND_S, bounds=[BOUNDS]
    )
    on_bucket = Row(
        f"2 writers + 1 reader on one S3 bucket ({TRIALS}x)", bound_s=BOUND_S, bounds=[BOUNDS]
    )
    loads: list[str] = []
    for trial in range(TRIALS):
        root = make_dir(DISK, "shared")
        try:
            with guard(on_root):
                loads.append(share(on_root, fs_tier(root), f"{seed}-root-{trial}", root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    yield noted(on_root, loads)
    loads = []
    with MotoS3Server() as server:
        for trial in range(TRIALS):
            bucket = f"shared-{uuid.uuid4().hex[:12]}"
            server.create_bucket(bucket)
            stop = make_dir(DISK, "shared-stop")
            try:
                with guard(on_bucket):
                    tier = server.tier_config(bucket)
                    loads.append(share(on_bucket, tier, f"{seed}-bucket-{trial}", stop))
            finally:
                shutil.rmtree(stop, ignore_errors=True)
    yield noted(on_bucket, loads)


def noted(row: Row, loads: list[str]) -> Row:
    row.notes.append(f"the reader checked {' + '.join(loads)} loads while the writers ran")
    return row


def share(row: Row, tier: dict[str, Any], stream: str, scratch: Path) -> str:
    """One trial; how many loads the reader checked while the writers ran."""
    tiers = json.dumps([tier])
    common = ["--tiers", tiers, "--seed", stream, "--block-bytes", str(BLOCK)]
    stop = scratch / "stop"
    reader = Child("reader", *common, "--keys", str(BATCH * BATCHES), "--stop", str(stop))
    writers = [
        Child("writer", *common, "--batch", str(BATCH), "--batches", str(BATCHES), *shuffle)
        for shuffle in ([], ["--shuffle"])
    ]
    durable: set[bytes] = set()
    try:
        reader.expect("ready", CHILD_S)
        for writer in writers:
            writer.expect("ready", CHILD_S)
        for writer in writers:
            for _ in range(BATCHES):
                line = writer.expect("durable", CHILD_S)
                durable.update(bytes.fromhex(h) for h in line.split()[1:])
            if writer.wait(CHILD_S) != 0:
                row.problems.append(f"{stream}: a writer failed")
        stop.touch()
        _, loads, wrong, longest = reader.expect("read", CHILD_S).split()
        if reader.wait(CHILD_S) != 0:
            row.problems.append(f"{stream}: the reader failed")
    finally:
        for child in (reader, *writers):
            child.kill()
    row.wrong_bytes += int(wrong)
    Calls(row).record("reader's lookup/load/reset", float(longest))
    # How many loads overlapped the writers depends on the machine's speed (on a loaded one
    # the writers may finish first): a figure for the note, never a failure. The outcomes
    # are what fail a row: a wrong byte, a durable block lost, a call past its bound.
    anyio.run(final_check, row, tier, stream, durable)
    row.trials += 1
    return loads


async def final_check(row: Row, tier: dict[str, Any], stream: str, durable: set[bytes]) -> None:
    calls = Calls(row)
    async with Watched(cache_config(BLOCK, 128, tier)) as cache:
        found = await audit(cache, keys_of(stream, BATCH * BATCHES), calls)
    row.wrong_bytes += found.wrong_bytes
    row.durable_lost += found.lost(durable)
    if len(durable) != BATCH * BATCHES:
        row.problems.append(f"{stream}: the writers confirmed {len(durable)} of {BATCH * BATCHES}")
