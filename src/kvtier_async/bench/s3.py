"""Benchmark ``s3``: the obj tier against raw aioboto3, on one loopback moto S3 server.

For 256 KiB and 2 MiB blocks, the tier's ``store``/``load`` and plain aioboto3
``put_object``/``get_object`` move the same number of fresh objects of the same size through
the same server, at the same concurrency, with the same client settings (timeouts, pool
size, no botocore retries, no SDK checksums). The tier does its part on top: a header page
with checksums on every PUT, a conditional PUT (``If-None-Match: *``), streaming each GET into
a page-aligned slot and verifying it; raw aioboto3 sends ``bytes`` and reads the body into
``bytes``. The server runs in a child process (moto comes with the ``bench`` extra), so it does
not share the client's GIL; moto is slow, so the bytes are modest. Its speed drifts and
jitters, and the machine may be shared, so both sides run in many short alternating rounds
(each: PUT every block, then GET it, raw and ours taking turns at going first; then the
bucket is emptied) and each side's figure is the median of its rounds' MB/s.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Final

import aioboto3
import anyio
import anyio.to_thread
from botocore.config import Config as BotoConfig  # type: ignore[import-untyped]

from kvtier_async.ledger import make_offload_key
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.s3 import S3Config, S3Tier

from .report import BenchRecord, throughput_record

__all__ = ["aligned_blocks", "run"]

BENCH: Final = "s3"
REFERENCE_NAME: Final = (
    "raw aioboto3 put_object/get_object, same server, client settings, concurrency"
)
TARGET: Final = 0.9
CONCURRENCY: Final = 8
MIB: Final = 1024 * 1024
# block size -> bytes per round, side and direction (moto moves ~25 MB/s of 256 KiB objects
# and ~100 MB/s of 2 MiB ones here); a round is a few waves of CONCURRENCY requests
SIZES: Final = {"256KiB": (256 * 1024, 8 * MIB), "2MiB": (2 * MIB, 16 * MIB)}
ROUNDS: Final = 16  # short rounds, so a busy neighbour on the machine hits both sides alike
QUICK_ROUNDS: Final = 4
BUCKET: Final = "kvtier-bench"


@dataclass
class _Side:
    """One side's MB/s in one direction, round by round."""

    rounds: list[float] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return statistics.median(self.rounds)


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """PUT and GET MB/s for each block size, ours against raw aioboto3."""
    from kvtier_async.bench.s3server import MotoS3Server  # its extra: checked by `load`

    note = progress or (lambda _: None)
    with MotoS3Server(in_process=False) as server:
        note(f"s3: moto server at {server.endpoint} (child process)")
        records: list[BenchRecord] = []
        for label, (size, per_round) in SIZES.items():
            _empty_bucket(server)
            rounds = QUICK_ROUNDS if quick else ROUNDS
            count = max(CONCURRENCY, per_round // size)
            sides = anyio.run(_measure, server, size, count, rounds, note, backend="asyncio")
            for direction in ("put", "get"):
                ours, raw = sides[f"ours {direction}"], sides[f"raw {direction}"]
                records.append(
                    throughput_record(
                        BENCH,
                        f"{direction}_{label}",
                        "MB_per_s",
                        ours.mb_per_s,
                        reference=raw.mb_per_s,
                        reference_name=REFERENCE_NAME,
                        target=TARGET,
                        unit="MB/s",
                    )
                )
        return records


async def _measure(
    server: Any, size: int, count: int, rounds: int, note: Callable[[str], None]
) -> dict[str, _Side]:
    blocks, slots = aligned_blocks(count, size), aligned_blocks(count, size)
    payloads = [block.tobytes() for block in blocks]
    sides = {name: _Side() for name in ("ours put", "raw put", "ours get", "raw get")}
    async with AsyncExitStack() as stack:
        tier = await _open_tier(stack, server, size)
        raw = await _open_raw(stack, server)
        await _round(tier, raw, blocks, slots, payloads, "warm-up", {})  # connections, caches
        for index in range(rounds):
            await anyio.to_thread.run_sync(_empty_bucket, server)  # moto keeps all in memory
            raw_first = index % 2 == 0
            await _round(tier, raw, blocks, slots, payloads, f"r{index}", sides, raw_first)
            note(
                f"s3: {size // 1024} KiB x {count}, round {index + 1}/{rounds}: "
                + ", ".join(f"{name} {side.rounds[-1]:.1f}" for name, side in sides.items())
                + " MB/s"
            )
    return sides


async def _round(
    tier: S3Tier,
    raw: Any,
    blocks: Sequence[memoryview],
    slots: Sequence[memoryview],
    payloads: Sequence[bytes],
    tag: str,
    sides: dict[str, _Side],
    raw_first: bool = True,
) -> None:
    """One PUT and one GET of every block by each side, in the order given."""
    keys = [make_offload_key(os.urandom(32), 0) for _ in blocks]
    names = [f"raw/{tag}/{key.hex()}.bin" for key in keys]

    async def ours_put() -> None:
        if not all(await tier.store(keys, blocks)):
            raise RuntimeError("bench s3: a store failed")

    async def ours_get() -> None:
        if not all(await tier.load(keys, slots)):
            raise RuntimeError("bench s3: a load failed")

    async def raw_put() -> None:
        async def put(i: int) -> None:
            await raw.put_object(Bucket=BUCKET, Key=names[i], Body=payloads[i])

        await _bounded(put, len(names))

    async def raw_get() -> None:
        async def get(i: int) -> None:
            response = await raw.get_object(Bucket=BUCKET, Key=names[i])
            await response["Body"].read()

        await _bounded(get, len(names))

    nbytes = sum(len(block) for block in blocks)
    for direction, pair in (("put", (raw_put, ours_put)), ("get", (raw_get, ours_get))):
        order = pair if raw_first else pair[::-1]
        for call in order:
            name = f"{'raw' if call in (raw_put, raw_get) else 'ours'} {direction}"
            start = time.perf_counter()
            await call()
            if name in sides:
                sides[name].rounds.append(nbytes / (time.perf_counter() - start) / 1e6)
    if tag != "warm-up" and any(a.tobytes() != b.tobytes() for a, b in zip(blocks, slots)):
        raise RuntimeError("bench s3: a load returned other bytes")


def _empty_bucket(server: Any) -> None:
    server.reset()
    server.create_bucket(BUCKET)


async def _bounded(one: Callable[[int], Awaitable[None]], count: int) -> None:
    """``one(i)`` for every i, `CONCURRENCY` at a time (as the tier fans out)."""
    indices = iter(range(count))

    async def worker() -> None:
        for i in indices:
            await one(i)

    async with anyio.create_task_group() as tg:
        for _ in range(min(CONCURRENCY, count)):
            tg.start_soon(worker)


async def _open_tier(stack: AsyncExitStack, server: Any, size: int) -> S3Tier:
    fields = server.tier_config(BUCKET, prefix="ours", max_concurrency=CONCURRENCY)
    tier = S3Tier("obj", TierContext(block_bytes=size), S3Config.parse(fields, "obj"))
    await tier.open()
    stack.push_async_callback(tier.aclose)
    return tier


async def _open_raw(stack: AsyncExitStack, server: Any) -> Any:
    session = aioboto3.Session(
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
    )
    config = BotoConfig(  # the tier's settings
        connect_timeout=5.0,
        read_timeout=5.0,
        retries={"total_max_attempts": 1},
        max_pool_connections=CONCURRENCY + 1,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
    )
    client = session.client("s3", endpoint_url=server.endpoint, config=config)
    return await stack.enter_async_context(client)


def aligned_blocks(count: int, size: int) -> list[memoryview]:
    """``count`` page-aligned blocks (as the CPU tier's slots are) of random bytes, so their
    pages are in memory before the clock starts."""
    row = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = memoryview(mmap.mmap(-1, count * row))
    blocks = [mapping[i * row : i * row + size] for i in range(count)]
    for block in blocks:
        block[:] = os.urandom(size)
    return blocks
