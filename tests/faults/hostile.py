"""Hostile neighbours (issue 23): what another local user, or a careless one, can plant.

Four families, each against the real parts:

- special files at a block's name: a FIFO, a link to ``/dev/zero``, a link to a readable
  file outside the root, a directory; every such block must be a miss (never bytes), and no
  call may block (a FIFO opened for reading waits forever for a writer).
- links below an fs root: a rank directory and a fan-out directory that are links to an
  outside directory full of ``*.bin`` files; the tier's own ``max_bytes`` GC and ``kvtier gc``
  run beside them. Any outside file deleted fails the row.
- a second cache with the first one's ``instance_id`` (same process): each try must be
  refused, and the first cache keeps serving its own bytes, checked byte for byte.
- loads into destinations that may not be written (a read-only buffer, arrays and tensors
  over immutable ``bytes``): each must be refused before a copy, and the immutable objects
  keep their bytes (a mutation counts as wrong bytes). A tensor over a read-only mapping
  crashed the process before: here it would kill the scenario's process, and the row with it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from faults._common import (
    DISK,
    LOCAL_BOUNDS,
    Calls,
    Row,
    Watched,
    cache_config,
    content,
    deadline,
    fs_tier,
    guard,
    keys_of,
    load_one,
    private_dir,
    store,
)
from kvtier_async.cli import main as kvtier
from kvtier_async.memory import RegionClaimedError
from kvtier_async.tiers.blockfile import block_relpath

BLOCK = 64 << 10
TIER = "fs[0]"
BOUND_S = 5.0
OUTER_S = 60.0
TRIES = 20


def run(seed: int) -> Iterator[Row]:
    trials: list[tuple[str, Callable[[Row, str], Awaitable[None]]]] = [
        ("hostile: FIFO, /dev/zero link, outside link, directory at a block's name", special_files),
        ("hostile: rank and fan-out dirs linked outside, tier GC and kvtier gc",
         links_below_the_root),
        ("hostile: a second cache with a live cache's instance_id", same_instance_id),
        ("hostile: loads into read-only buffers, bytes and read-only mappings", read_only_loads),
    ]  # fmt: skip
    for fault, trial in trials:
        row = Row(fault, bound_s=BOUND_S, bounds=[LOCAL_BOUNDS])
        with guard(row):
            anyio.run(trial, row, f"{seed}-{trial.__name__}")
        yield row


# -- special files at a block's name ---------------------------------------------------------


def _plant(kind: str, path: Path, outside: Path) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "link outside the root":
        path.symlink_to(outside)
    else:  # a directory
        path.mkdir(mode=0o700)


KINDS = ("fifo", "link to /dev/zero", "link outside the root", "directory")


async def special_files(row: Row, seed: str) -> None:
    root = private_dir(DISK, "hostile")
    outside = root.parent / f"{root.name}-outside.bin"
    try:
        outside.write_bytes(b"\x00" * (BLOCK + 4096))
        calls = Calls(row)
        async with Watched(cache_config(BLOCK, 8, fs_tier(root))) as cache:
            keys = keys_of(f"{seed}-special", 2 * len(KINDS))
            await store(cache, keys)
            await cache.drain()
            await cache.reset()  # every load now comes from the fs tier
            ctx = cache.tiers[0].ctx
            for number, key in enumerate(keys):
                kind = KINDS[number % len(KINDS)]
                _plant(kind, root / block_relpath(ctx, key), outside)
                with deadline(row, f"a load of a block replaced by a {kind}", OUTER_S):
                    wrong = await load_one(cache, key, calls)
                if wrong is not None:
                    row.problems.append(f"a {kind} at a block's name was served as a block")
                    row.wrong_bytes += wrong
                row.trials += 1
        if outside.read_bytes() != b"\x00" * (BLOCK + 4096):
            row.problems.append("the file outside the root was changed")
    finally:
        outside.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)


# -- links below the root --------------------------------------------------------------------


async def links_below_the_root(row: Row, seed: str) -> None:
    base = private_dir(DISK, "hostile-links")
    try:
        root, outside = base / "root", base / "outside"
        root.mkdir(mode=0o700)
        outside.mkdir(mode=0o700)
        planted = {f"{i:02x}.bin": os.urandom(256) for i in range(10)} | {"firmware.bin": b"fw"}
        for name, data in planted.items():
            (outside / name).write_bytes(data)
        calls = Calls(row)
        tier = fs_tier(root, max_bytes=4 * (BLOCK + 4096))
        for number in range(TRIES // 4):
            async with Watched(cache_config(BLOCK, 8, tier)) as cache:
                ctx = cache.tiers[0].ctx
                rank_dir = root / ctx.namespace / "r0"
                if number == 0:
                    (rank_dir / "fff").symlink_to(outside)  # a fan-out directory
                    (root / ctx.namespace / "r1").symlink_to(outside)  # a rank directory
                keys = keys_of(f"{seed}-links-{number}", 6)
                with deadline(row, "stores past max_bytes", OUTER_S):
                    await calls("store", cache.store, keys, [content(k, BLOCK) for k in keys])
                    await calls("drain", cache.drain)
            row.trials += 1
            with deadline(row, "kvtier gc", OUTER_S):
                status = await anyio.to_thread.run_sync(
                    kvtier, ["gc", str(root), "--max-bytes", "0"]
                )
            if status != 0:
                row.problems.append(f"kvtier gc exited {status}")
            row.trials += 1
        left = {p.name: p.read_bytes() for p in outside.iterdir()}
        if left != planted:
            gone = sorted(set(planted) - set(left))
            row.problems.append(f"files outside the root were deleted or changed: {gone}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- a second cache with the same instance_id ------------------------------------------------


async def same_instance_id(row: Row, seed: str) -> None:
    config = cache_config(BLOCK, 8, instance_id=f"hostile-{os.getpid()}")
    calls = Calls(row)
    async with Watched(config) as first:
        keys = keys_of(f"{seed}-same", 4)
        await store(first, keys)
        for _ in range(TRIES):
            try:
                async with Watched(config):
                    row.problems.append("a second cache with the same instance_id opened")
            except RegionClaimedError:
                pass
            for key in keys:
                wrong = await load_one(first, key, calls)
                if wrong is None:
                    row.problems.append("the first cache lost a block")
                row.wrong_bytes += wrong or 0
            row.trials += 1


# -- loads into destinations that may not be written -----------------------------------------


def _destinations(data: bytes) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [
        ("bytes", data),
        ("memoryview of bytes", memoryview(data)),
        ("numpy over bytes", np.frombuffer(data, dtype=np.uint8)),
    ]
    try:
        import torch
    except ImportError:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        out.append(("tensor over bytes", torch.frombuffer(data, dtype=torch.uint8)))
        import mmap

        read_only = mmap.mmap(-1, BLOCK, prot=mmap.PROT_READ)
        out.append(
            ("tensor over a read-only mapping", torch.frombuffer(read_only, dtype=torch.uint8))
        )
    return out


async def read_only_loads(row: Row, seed: str) -> None:
    calls = Calls(row)
    async with Watched(cache_config(BLOCK, 8)) as cache:
        key = keys_of(f"{seed}-ro", 1)[0]
        await store(cache, [key])
        for _ in range(TRIES // 5):
            immutable = bytes([0x5A]) * BLOCK
            for what, destination in _destinations(immutable):
                try:
                    await calls("load", cache.load, [key], [destination])
                    row.problems.append(f"a load into {what} was not refused")
                except ValueError as exc:
                    if "blocks[0]" not in str(exc):
                        row.problems.append(f"the refusal of {what} names no block: {exc}")
                row.trials += 1
            row.wrong_bytes += sum(1 for b in immutable if b != 0x5A)
            wrong = await load_one(cache, key, calls)  # the cache still serves it
            if wrong is None:
                row.problems.append("the block was lost after a refused load")
            row.wrong_bytes += wrong or 0
