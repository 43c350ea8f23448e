"""Object damage of every kind, through `TieredKVCache` with an obj tier on moto's S3 server
(127.0.0.1, real HTTP).

Each trial stores four blocks, drains (all four confirmed in the bucket), overwrites the first
one's object through S3 with a damaged body, clears the CPU tier and loads all four back
through lookups (promotions from the bucket). An object's body is the fs tier's block file, so
the bodies come from test_tier_fs's `_craft` where it has the damage. The damaged block must
be a miss, never wrong bytes, and its object deleted; the three others must load byte for
byte; the next store of the damaged key must put a good object back.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anyio
from botocore.exceptions import ClientError

from _s3 import raw_client
from faults._common import (
    S3_BOUNDS,
    Calls,
    Row,
    Watched,
    audit,
    cache_config,
    keys_of,
    store,
)
from kvtier_async.bench.s3server import MotoS3Server
from kvtier_async.tiers.fs import HEADER_BYTES
from kvtier_async.tiers.s3 import S3Tier
from test_tier_fs import _craft

BLOCK = 4 * 4096
TIER = "obj[0]"
BOUND_S = 10.0  # a few requests to a local server, each well under its timeout

Body = Callable[[bytes, bytes, bytes], bytes]  # (key, good body, another key's body) -> body


def crafted(kind: str) -> Body:
    return lambda key, good, _other: _craft(kind, key, good[HEADER_BYTES:])


KINDS: dict[str, Body] = {
    "truncated to half": lambda _key, good, _other: good[: len(good) // 2],
    "extra bytes after it": lambda _key, good, _other: good + b"trailing",
    "zero-length": lambda _key, _good, _other: b"",
    "random bytes of the right size": lambda _key, good, _other: os.urandom(len(good)),
    "another key's object": lambda _key, _good, other: other,
    "craft: payload bit": crafted("payload bit"),
    "craft: header bit": crafted("header bit"),
    "craft: foreign magic": crafted("foreign magic"),
    "craft: short length": crafted("short length"),
    "craft: another key": crafted("another key"),
}
TRIALS = 2


def run(seed: int) -> Iterator[Row]:
    row = Row(f"S3: object damage, {len(KINDS)} kinds", bound_s=BOUND_S, bounds=[S3_BOUNDS])
    with MotoS3Server() as server:
        for number, (kind, body) in enumerate(KINDS.items()):
            for attempt in range(TRIALS):
                bucket = f"damage-{uuid.uuid4().hex[:12]}"
                server.create_bucket(bucket)
                anyio.run(trial, row, server, bucket, kind, body, f"{seed}-{number}-{attempt}")
                row.trials += 1
    row.notes = list(dict.fromkeys(row.notes))
    yield row


async def trial(
    row: Row, server: MotoS3Server, bucket: str, kind: str, body: Body, seed: str
) -> None:
    calls = Calls(row)
    keys = keys_of(seed, 4)
    config = cache_config(BLOCK, 8, server.tier_config(bucket, timeout_s=2.0))
    async with Watched(config) as cache, raw_client(server) as client:
        await store(cache, keys)
        await cache.drain()
        if cache.take_durable(TIER) != set(keys):
            row.problems.append(f"{kind}: the four blocks were not all stored")
            return
        (tier,) = cache.tiers
        assert isinstance(tier, S3Tier)
        name = tier.object_name(keys[0])
        good = await get(client, bucket, name)
        other = await get(client, bucket, tier.object_name(keys[1]))
        await client.put_object(Bucket=bucket, Key=name, Body=body(keys[0], good, other))
        found = await audit(cache, keys, calls)
        row.wrong_bytes += found.wrong_bytes
        row.durable_lost += found.lost(keys[1:])
        if keys[0] in found.present:
            row.problems.append(f"{kind}: the damaged block was served")
        if await head(client, bucket, name):
            row.problems.append(f"{kind}: the damaged object is still there")
        if cache.take_removed(TIER) != keys[:1]:
            row.problems.append(f"{kind}: the damaged object's removal was not announced")
        await store(cache, keys[:1], calls)
        await calls("drain", cache.drain)
        repaired = await audit(cache, keys[:1], calls)
        row.wrong_bytes += repaired.wrong_bytes
        if keys[0] not in repaired.present or await get(client, bucket, name) != good:
            row.problems.append(f"{kind}: a new store did not put the good object back")


async def get(client: Any, bucket: str, name: str) -> bytes:
    data: bytes = await (await client.get_object(Bucket=bucket, Key=name))["Body"].read()
    return data


async def head(client: Any, bucket: str, name: str) -> bool:
    try:
        await client.head_object(Bucket=bucket, Key=name)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True
