"""The obj tier against a real S3 HTTP endpoint: moto's server on 127.0.0.1.

asyncio only: aiobotocore does not run under trio (one test checks the tier says so).
No test sleeps to wait: the breaker runs on a fake clock, faults are injected through
botocore's ``before-send`` event, and every wait is bounded by ``fail_after``.

A hung endpoint is a `SilentServer` (accepts, reads, never answers) or moto's server in a child
process paused with SIGSTOP. Each call against it must end within a bound computed from the
tier's config (measured, then compared), plus `SLACK_S` for a loaded machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import numpy as np
import pytest

from _s3 import (
    FakeClock,
    Injector,
    RequestLog,
    SilentServer,
    inject,
    make_blocks,
    make_keys,
    opened,
    raw_client,
)
from kvtier_async.api import TieredKVCache
from kvtier_async.bench.s3server import MotoS3Server
from kvtier_async.config import ConfigError
from kvtier_async.engine import Engine, Job, ThreadedEngine
from kvtier_async.ledger import JobKind
from kvtier_async.memory import SharedRegion
from kvtier_async.tiers.base import TierContext, make_tier
from kvtier_async.tiers.s3 import (
    AccessDeniedError,
    BucketNotFoundError,
    CircuitOpenError,
    EndpointUnreachableError,
    RequestTimeoutError,
    S3Config,
    S3Tier,
    Secret,
    TierOpenError,
)
from kvtier_async.tiers.s3.staging import Staging

pytest_plugins = ["conftest_s3"]
T = TypeVar("T")

KIB = 1024
CTX = TierContext(block_bytes=256 * KIB, model="test/model")
SLACK_S = 2.0  # over a bound computed from the config: scheduling on a loaded machine
# Budgets for tests that count on every lookup answering: a lookup's GET carries a body, and a
# loaded machine's moto may take longer than the default second.
PATIENT = {"timeout_s": 30.0, "lookup_timeout_s": 30.0}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def s3_tier(server: MotoS3Server, bucket: str, ctx: TierContext = CTX, **kwargs: Any) -> S3Tier:
    """A tier on ``server``; config fields and tier keywords (``clock=``...) in ``kwargs``."""
    names = ("breaker_threshold", "breaker_timeouts", "breaker_open_s", "clock")
    tuning = {k: kwargs.pop(k) for k in names if k in kwargs}
    config = S3Config.parse(server.tier_config(bucket, **kwargs), "obj")
    return S3Tier("obj", ctx, config, backoff_s=0.001, **tuning)


def data(
    count: int, size: int = CTX.block_bytes
) -> tuple[list[bytes], list[memoryview], list[memoryview]]:
    """``count`` keys, blocks of random bytes, and empty slots for loading them."""
    return make_keys(count), make_blocks(count, size, seed=count), make_blocks(count, size)


def equal(a: memoryview, b: memoryview) -> bool:
    return a.tobytes() == b.tobytes()


# -- configuration -----------------------------------------------------------------------------


def config(data: dict[str, Any]) -> S3Config:
    return S3Config.parse(data, "secondary_tiers[1]")


def test_config_fields_and_defaults() -> None:
    cfg = config({"bucket": "kv", "endpoint_override": "minio:9000", "prefix": "/a/b/"})
    assert cfg.endpoint_url == "http://minio:9000"  # vLLM's default scheme with an endpoint
    assert cfg.client_region == "us-east-1"
    assert cfg.prefix == "a/b"
    assert (cfg.max_concurrency, cfg.timeout_s, cfg.retries) == (16, 5.0, 3)
    assert cfg.lookup_timeout_s == 1.0
    assert config({"bucket": "kv", "timeout_s": 0.25}).lookup_timeout_s == 0.25  # never more
    assert not cfg.access_key  # empty: the AWS credential chain
    aws = config({"bucket": "kv", "region": "eu-west-1"})
    assert aws.endpoint_url is None and aws.scheme == "https" and aws.client_region == "eu-west-1"
    tls = config({"bucket": "kv", "endpoint_override": "https://s3.local", "max_concurrency": 4})
    assert tls.endpoint_url == "https://s3.local" and tls.max_concurrency == 4


def test_config_accepts_vllms_nested_store_config() -> None:
    cfg = config(
        {
            "store_config": {"bucket": "kv", "endpoint_override": "h:1", "scheme": "https"},
            "prefix": "p",
            "io_threads": 8,
        }
    )
    assert (cfg.bucket, cfg.endpoint_url, cfg.prefix, cfg.max_concurrency) == (
        "kv",
        "https://h:1",
        "p",
        8,
    )


@pytest.mark.parametrize(
    ("data", "field", "text"),
    [
        ({}, "bucket", "is required"),
        ({"bucket": "a/b"}, "bucket", "not a bucket name"),
        ({"bucket": "kv", "color": 1}, "color", "unknown key"),
        ({"bucket": "kv", "access_key": "AK"}, "secret_key", "is required"),
        ({"bucket": "kv", "secret_key": "SK"}, "access_key", "is required"),
        ({"bucket": "kv", "session_token": "T"}, "session_token", "needs access_key"),
        ({"bucket": "kv", "scheme": "ftp"}, "scheme", "must be one of"),
        ({"bucket": "kv", "endpoint_override": "ftp://h"}, "endpoint_override", "http or https"),
        ({"bucket": "kv", "endpoint_override": "h:1/path"}, "endpoint_override", "host[:port]"),
        ({"bucket": "kv", "endpoint_override": "h:port"}, "endpoint_override", "Port"),
        ({"bucket": "kv", "endpoint_override": "http://h", "scheme": "https"}, "scheme", "is"),
        ({"bucket": "kv", "max_concurrency": 0}, "max_concurrency", "in [1, 1024]"),
        ({"bucket": "kv", "max_concurrency": 4, "io_threads": 4}, "io_threads", "not both"),
        ({"bucket": "kv", "timeout_s": 0}, "timeout_s", "must be"),
        ({"bucket": "kv", "lookup_timeout_s": 0}, "lookup_timeout_s", "must be"),
        ({"bucket": "kv", "retries": -1}, "retries", "must be"),
        ({"bucket": "kv", "store_config": {"bucket": "x"}}, "store_config.bucket", "also set"),
        ({"store_config": {"bucket": "x", "prefix": "p"}}, "store_config.prefix", "unknown"),
    ],
)
def test_config_errors_name_the_field(data: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(data)
    assert info.value.field == f"secondary_tiers[1].{field}"
    assert text in str(info.value)


def test_config_never_echoes_an_endpoint_with_user_info() -> None:
    with pytest.raises(ConfigError) as info:
        config({"bucket": "kv", "endpoint_override": "http://AK:VERYSECRET@host:9000"})
    assert "VERYSECRET" not in str(info.value)


def test_the_factory_builds_the_tier() -> None:
    tier = make_tier({"type": "obj", "bucket": "kv"}, CTX, "secondary_tiers[2]")
    assert isinstance(tier, S3Tier)
    assert (tier.name, tier.kind, tier.config.path) == ("obj[2]", "obj", "secondary_tiers[2]")
    assert tier.read_workers == tier.write_workers == 16


def test_object_names_are_the_fs_relative_paths() -> None:
    from kvtier_async.tiers.blockfile import block_relpath

    key = make_keys(1, group=3)[0]
    tier = S3Tier("obj", CTX, config({"bucket": "kv", "prefix": "kv/cache"}))
    assert tier.object_name(key) == "kv/cache/" + block_relpath(CTX, key)
    assert S3Tier("obj", CTX, config({"bucket": "kv"})).object_name(key) == block_relpath(CTX, key)


# -- data --------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("size", [4 * KIB, 100_000, 256 * KIB, 2048 * KIB])
async def test_round_trip_is_byte_exact(moto_s3: MotoS3Server, s3_bucket: str, size: int) -> None:
    ctx = TierContext(block_bytes=size)
    keys, blocks, slots = make_keys(6), make_blocks(6, size, seed=size), make_blocks(6, size)
    async with opened(s3_tier(moto_s3, s3_bucket, ctx, prefix="rt")) as tier:
        assert await tier.lookup(keys) == [False] * 6
        assert await tier.store(keys, blocks) == [True] * 6
        assert await tier.lookup(keys) == [True] * 6
        assert await tier.load(keys, slots) == [True] * 6
        stats = tier.statistics()
    assert all(equal(a, b) for a, b in zip(blocks, slots, strict=True))
    assert (tier.counters.written, tier.counters.present, stats.retries) == (6, 0, 0)


@pytest.mark.anyio
async def test_loads_into_the_shared_regions_slots(
    moto_s3: MotoS3Server, s3_bucket: str, tmp_path: Path
) -> None:
    keys, blocks = make_keys(4), make_blocks(4, CTX.block_bytes, seed=1)
    region = SharedRegion("s3test", 4, CTX.block_bytes, directory=tmp_path)
    try:
        slots = [region.slot_view(i) for i in range(4)]
        async with opened(s3_tier(moto_s3, s3_bucket)) as tier:
            assert await tier.store(keys, blocks) == [True] * 4
            assert await tier.load(keys[::-1], slots) == [True] * 4
        assert all(equal(a, b) for a, b in zip(blocks[::-1], slots, strict=True))
        del slots
    finally:
        region.close()


@pytest.mark.anyio
async def test_a_second_store_is_skipped(moto_s3: MotoS3Server, s3_bucket: str) -> None:
    (key,), (first, second), (slot,) = (
        make_keys(1),
        make_blocks(2, CTX.block_bytes),
        make_blocks(1, CTX.block_bytes),
    )
    async with opened(s3_tier(moto_s3, s3_bucket)) as tier:
        requests = RequestLog().attach(tier)
        assert await tier.store([key], [first]) == [True]
        assert await tier.store([key], [second]) == [True]  # present: reported stored
        assert await tier.load([key], [slot]) == [True]
    assert equal(slot, first)  # the second store did not overwrite
    # one conditional PUT each; the second was refused (412) without replacing the object
    assert requests.sent == {"PutObject": 2, "GetObject": 1}
    assert [s for s in requests.statuses if s[0] == "PutObject"] == [
        ("PutObject", 200),
        ("PutObject", 412),
    ]
    assert (tier.counters.written, tier.counters.present) == (1, 1)


@pytest.mark.anyio
async def test_a_new_tier_finds_what_an_old_one_stored(
    moto_s3: MotoS3Server, s3_bucket: str
) -> None:
    keys, blocks, slots = (
        make_keys(3),
        make_blocks(3, CTX.block_bytes),
        make_blocks(3, CTX.block_bytes),
    )
    async with opened(s3_tier(moto_s3, s3_bucket, prefix="keep")) as tier:
        assert await tier.store(keys, blocks) == [True] * 3
    async with opened(s3_tier(moto_s3, s3_bucket, prefix="keep")) as tier:
        assert await tier.lookup(keys) == [True] * 3
        assert await tier.load(keys, slots) == [True] * 3
    assert all(equal(a, b) for a, b in zip(blocks, slots, strict=True))
    async with opened(s3_tier(moto_s3, s3_bucket, prefix="other")) as tier:
        assert await tier.lookup(keys) == [False] * 3


@pytest.mark.anyio
async def test_a_root_directory_and_a_bucket_are_interchangeable(
    moto_s3: MotoS3Server, s3_bucket: str, tmp_path: Path
) -> None:
    keys, blocks, slots = (
        make_keys(2),
        make_blocks(2, CTX.block_bytes),
        make_blocks(2, CTX.block_bytes),
    )
    fs_config = {"type": "fs", "root_dir": str(tmp_path / "root")}
    # fs -> "sync" the root to the bucket -> obj
    async with opened(make_tier(fs_config, CTX, "fs")) as fs_tier:
        assert await fs_tier.store(keys[:1], blocks[:1]) == [True]
    async with raw_client(moto_s3) as client:
        for path in (tmp_path / "root").rglob("*.bin"):
            name = path.relative_to(tmp_path / "root").as_posix()
            await client.put_object(Bucket=s3_bucket, Key=name, Body=path.read_bytes())
    async with opened(s3_tier(moto_s3, s3_bucket)) as tier:
        assert await tier.lookup(keys) == [True, False]
        assert await tier.load(keys[:1], slots[:1]) == [True]
        assert equal(slots[0], blocks[0])
        # obj -> "sync" the bucket to the root -> fs
        assert await tier.store(keys[1:], blocks[1:]) == [True]
        name = tier.object_name(keys[1])
        async with raw_client(moto_s3) as client:
            body = await (await client.get_object(Bucket=s3_bucket, Key=name))["Body"].read()
    (tmp_path / "root" / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "root" / name).write_bytes(body)
    async with opened(make_tier(fs_config, CTX, "fs")) as fs_tier:
        assert await fs_tier.load(keys[1:], slots[1:]) == [True]
    assert equal(slots[1], blocks[1])


@pytest.mark.anyio
async def test_a_missing_object_fails_only_its_key(moto_s3: MotoS3Server, s3_bucket: str) -> None:
    keys, blocks, slots = (
        make_keys(3),
        make_blocks(3, CTX.block_bytes),
        make_blocks(3, CTX.block_bytes),
    )
    async with opened(s3_tier(moto_s3, s3_bucket)) as tier:
        assert await tier.store([keys[0], keys[2]], [blocks[0], blocks[2]]) == [True, True]
        assert await tier.load(keys, slots) == [True, False, True]


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another key's object", "foreign"])
async def test_a_corrupt_object_fails_and_is_deleted(
    moto_s3: MotoS3Server, s3_bucket: str, damage: str
) -> None:
    keys, blocks, slots = (
        make_keys(2),
        make_blocks(2, CTX.block_bytes),
        make_blocks(2, CTX.block_bytes),
    )
    async with opened(s3_tier(moto_s3, s3_bucket)) as tier:
        assert await tier.store(keys, blocks) == [True, True]
        name = tier.object_name(keys[0])
        async with raw_client(moto_s3) as client:
            good = await (await client.get_object(Bucket=s3_bucket, Key=name))["Body"].read()
            other = tier.object_name(keys[1])
            body = {
                "flip a byte": good[:-1] + bytes([good[-1] ^ 1]),
                "truncate": good[: len(good) // 2],
                "another key's object": await (
                    await client.get_object(Bucket=s3_bucket, Key=other)
                )["Body"].read(),
                "foreign": os.urandom(len(good)),
            }[damage]
            await client.put_object(Bucket=s3_bucket, Key=name, Body=body)
            assert tier.take_removed() == []
            assert await tier.load(keys, slots) == [False, True]
            assert await tier.lookup(keys) == [False, True]  # deleted
            assert tier.take_removed() == [keys[0]]  # reported once
            assert tier.take_removed() == []
            listed = await client.list_objects_v2(Bucket=s3_bucket)
        stats = tier.statistics()
    assert [o["Key"] for o in listed["Contents"]] == [tier.object_name(keys[1])]
    assert stats.corrupt_objects == 1


# -- GET as the lookup -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_hit_costs_one_request(moto_s3: MotoS3Server, s3_bucket: str) -> None:
    keys, blocks, slots = data(5)
    async with opened(s3_tier(moto_s3, s3_bucket, **PATIENT)) as tier:
        assert await tier.store(keys[:4], blocks[:4]) == [True] * 4
        requests = RequestLog().attach(tier)
        assert await tier.lookup(keys) == [True] * 4 + [False]
        assert await tier.lookup(keys[:2]) == [True, True]  # staged: asked nothing again
        assert await tier.load(keys[:4], slots[:4]) == [True] * 4
        stats, staging = tier.statistics(), tier.staging
    assert requests.sent == {"GetObject": 5}
    assert all(equal(a, b) for a, b in zip(blocks[:4], slots[:4], strict=True))
    assert (stats.blocks_staged, stats.staged_loads) == (4, 4)
    assert stats.bytes_staged == 4 * CTX.block_bytes
    assert (len(staging), staging.in_use) == (0, 0)


@pytest.mark.anyio
async def test_staging_is_bounded_and_falls_back_to_head(
    moto_s3: MotoS3Server, s3_bucket: str
) -> None:
    keys, blocks, slots = data(6)
    two = 2 * CTX.block_bytes
    tier = s3_tier(moto_s3, s3_bucket, staging_bytes=two, max_concurrency=1, **PATIENT)
    async with opened(tier):
        assert await tier.store(keys, blocks) == [True] * 6
        requests = RequestLog().attach(tier)
        assert await tier.lookup(keys) == [True] * 6  # one at a time: each GET evicts the oldest
        assert tier.staging.allocated_bytes == two
        assert [key in tier.staging for key in keys] == [False] * 4 + [True] * 2
        assert await tier.load(keys, slots) == [True] * 6  # 4 GETs again, 2 copies
        stats = tier.statistics()
    assert requests.sent == {"GetObject": 10}
    assert (stats.staged_evicted, stats.staged_loads) == (4, 2)
    assert all(equal(a, b) for a, b in zip(blocks, slots, strict=True))
    keys, blocks, slots = data(8)
    tier = s3_tier(moto_s3, s3_bucket, staging_bytes=two, max_concurrency=8, **PATIENT)
    async with opened(tier):
        assert await tier.store(keys, blocks) == [True] * 8
        requests = RequestLog().attach(tier)
        assert await tier.lookup(keys) == [True] * 8  # 8 at once: 2 GETs hold the buffers
        assert tier.staging.allocated_bytes == two
        assert requests.sent["GetObject"] >= 2 and requests.sent["HeadObject"] >= 1
        assert requests.total == 8
        assert await tier.load(keys, slots) == [True] * 8
    assert all(equal(a, b) for a, b in zip(blocks, slots, strict=True))
    async with opened(s3_tier(moto_s3, s3_bucket, staging_bytes=0, **PATIENT)) as tier:
        requests = RequestLog().attach(tier)
        assert await tier.lookup(keys[:3]) == [True] * 3
    assert requests.sent == {"HeadObject": 3}  # staging off: lookups HEAD


@pytest.mark.anyio
async def test_a_lookup_finds_a_corrupt_object_and_deletes_it(
    moto_s3: MotoS3Server, s3_bucket: str
) -> None:
    keys, blocks, slots = data(2)
    async with opened(s3_tier(moto_s3, s3_bucket, **PATIENT)) as tier:
        assert await tier.store(keys, blocks) == [True, True]
        name = tier.object_name(keys[0])
        async with raw_client(moto_s3) as client:
            good = await (await client.get_object(Bucket=s3_bucket, Key=name))["Body"].read()
            await client.put_object(Bucket=s3_bucket, Key=name, Body=good[:-1] + b"\x00")
            assert await tier.lookup(keys) == [False, True]  # not a hit: never promoted
            assert tier.take_removed() == [keys[0]]
            listed = await client.list_objects_v2(Bucket=s3_bucket)
        assert await tier.load(keys[1:], slots[1:]) == [True]
        stats, staging = tier.statistics(), tier.staging
    assert [o["Key"] for o in listed["Contents"]] == [tier.object_name(keys[1])]
    assert (stats.corrupt_objects, stats.blocks_staged, staging.in_use) == (1, 1, 0)
    assert equal(slots[1], blocks[1])


def test_staging_reuses_its_buffers_within_the_bound() -> None:
    staging = Staging(3 * 100 + 99, 100)  # room for 3 buffers
    buffers = [staging.acquire() for _ in range(3)]
    assert all(b is not None and len(b) == 100 for b in buffers)
    assert staging.acquire() is None  # all three in flight: nothing to evict
    for key, buffer in zip((b"a", b"b", b"c"), buffers, strict=True):
        assert buffer is not None
        staging.stage(key, buffer)
    assert staging.touch(b"a")  # now the most recent: b is the oldest
    assert staging.acquire() is buffers[1] and staging.evicted == 1 and b"b" not in staging
    taken = staging.take(b"a")
    assert taken is buffers[0] and staging.take(b"a") is None and staging.served == 1
    staging.release(taken)
    assert staging.in_use == 1  # the evicted buffer, still held
    assert staging.acquire() is buffers[0] and staging.allocated_bytes == 300
    assert Staging(99, 100).acquire() is None  # less than one block: no staging


# -- faults ------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "code"), [(503, "SlowDown"), (500, "InternalError"), (429, "TooManyRequests")]
)
@pytest.mark.parametrize("staging", [True, False], ids=["get-lookup", "head-lookup"])
async def test_throttling_and_server_errors_are_retried(
    moto_s3: MotoS3Server, s3_bucket: str, status: int, code: str, staging: bool
) -> None:
    (key,), (block,), (slot,) = (
        make_keys(1),
        make_blocks(1, CTX.block_bytes),
        make_blocks(1, CTX.block_bytes),
    )
    # Budgets far above what three attempts need on a loaded machine: this is about retries
    # (a lookup's default 1 s, retries included, ran out in CI with the machine busy).
    budgets = {"timeout_s": 30.0, "lookup_timeout_s": 30.0}
    # With staging the lookup's GET is the load's too; without it, a HEAD and then a GET.
    ops = ("PutObject", "GetObject") if staging else ("PutObject", "HeadObject", "GetObject")
    tuning = {} if staging else {"staging_bytes": 0}
    async with opened(s3_tier(moto_s3, s3_bucket, retries=3, **budgets, **tuning)) as tier:
        injectors = {op: Injector(status, code, count=2) for op in ops}
        for op, injector in injectors.items():
            inject(tier, op, injector)
        requests = RequestLog().attach(tier)
        assert await tier.store([key], [block]) == [True]
        assert await tier.lookup([key]) == [True]
        assert await tier.load([key], [slot]) == [True]
        stats = tier.statistics()
    assert equal(slot, block)
    assert all(i.injected == 2 and i.seen == 3 for i in injectors.values())
    assert stats.retries == 2 * len(ops)
    assert stats.staged_loads == int(staging)
    assert sum(requests.sent.get(op, 0) for op in ("HeadObject", "GetObject")) == 3 * (len(ops) - 1)
    assert stats.circuit_state == "closed"


@pytest.mark.anyio
async def test_retries_are_bounded(moto_s3: MotoS3Server, s3_bucket: str) -> None:
    (key,), (block,) = make_keys(1), make_blocks(1, CTX.block_bytes)
    async with opened(s3_tier(moto_s3, s3_bucket, retries=2)) as tier:
        injector = Injector(503, "SlowDown", count=10)
        tier.client.meta.events.register("before-send.s3.PutObject", injector)
        assert await tier.store([key], [block]) == [False]
        assert injector.seen == 3  # the first try and two retries
        assert await tier.lookup([key]) == [False]


@pytest.mark.anyio
async def test_a_store_without_conditional_puts_heads_first(
    moto_s3: MotoS3Server, s3_bucket: str
) -> None:
    (key,), (block,) = make_keys(1), make_blocks(1, CTX.block_bytes)
    async with opened(s3_tier(moto_s3, s3_bucket)) as tier:
        injector = Injector(501, "NotImplemented", count=100, only_conditional=True)
        tier.client.meta.events.register("before-send.s3.PutObject", injector)
        requests = RequestLog().attach(tier)
        assert await tier.store([key], [block]) == [True]
        assert await tier.store([key], [block]) == [True]
        stats = tier.statistics()
    assert injector.injected == 1  # asked once, then never again
    assert requests.sent == {"PutObject": 2, "HeadObject": 2}
    assert (tier.counters.written, tier.counters.present) == (1, 1)
    assert "HEAD then PUT" in stats.detail


@pytest.mark.anyio
async def test_requests_are_bounded_by_max_concurrency(
    moto_s3: MotoS3Server, s3_bucket: str
) -> None:
    keys = make_keys(40)
    async with opened(s3_tier(moto_s3, s3_bucket, max_concurrency=3)) as tier:
        requests = RequestLog().attach(tier)
        async with anyio.create_task_group() as tg:  # two batches at once share the bound
            tg.start_soon(tier.lookup, keys[:20])
            tg.start_soon(tier.lookup, keys[20:])
    assert requests.sent == {"GetObject": 40}  # a lookup GETs (40 misses: none staged)
    assert requests.peak == 3


@pytest.mark.anyio
async def test_a_stopped_endpoint_opens_the_circuit_and_a_restarted_one_closes_it(
    own_moto_s3: MotoS3Server,
) -> None:
    server, clock = own_moto_s3, FakeClock()
    server.create_bucket("breaker")
    keys, blocks, slots = (
        make_keys(4),
        make_blocks(4, CTX.block_bytes),
        make_blocks(4, CTX.block_bytes),
    )
    tier = s3_tier(
        server, "breaker", retries=1, breaker_threshold=3, breaker_open_s=30, clock=clock
    )
    async with opened(tier):
        assert await tier.store(keys[:2], blocks[:2]) == [True, True]
        requests = RequestLog().attach(tier)
        server.stop()
        with anyio.fail_after(10):
            # connection refused: the keys fail, and the failures open the circuit
            assert await tier.store(keys[2:], blocks[2:]) == [False, False]
            assert tier.statistics().circuit_state == "open"
            sent = requests.total
            # open: no I/O at all; lookups miss, stores and loads raise at once
            assert await tier.lookup(keys) == [False] * 4
            with pytest.raises(CircuitOpenError, match="circuit open"):
                await tier.store(keys[2:], blocks[2:])
            with pytest.raises(CircuitOpenError):
                await tier.load(keys[:2], slots[:2])
            assert requests.total == sent
            # the open time passes: one probe, still refused, opens it again
            clock.advance(30)
            assert await tier.lookup(keys) == [False] * 4
            assert requests.total == sent + 1
            assert (tier.statistics().circuit_state, tier.statistics().circuit_opens) == ("open", 2)
            # the endpoint returns; the circuit stays open until the next probe
            server.start()
            assert await tier.lookup(keys) == [False] * 4
            clock.advance(30)
            assert await tier.lookup(keys) == [True, True, False, False]
            assert tier.statistics().circuit_state == "closed"
            assert await tier.load(keys[:2], slots[:2]) == [True, True]
            assert await tier.store(keys[2:], blocks[2:]) == [True, True]
    assert all(equal(a, b) for a, b in zip(blocks[:2], slots[:2], strict=True))


@pytest.mark.anyio
async def test_a_silent_endpoint_times_out_and_lookups_stop_waiting(
    own_moto_s3: MotoS3Server,
) -> None:
    server, clock = own_moto_s3, FakeClock()
    server.create_bucket("silent")
    keys = make_keys(4)
    tier = s3_tier(server, "silent", timeout_s=0.3, retries=0, breaker_threshold=2, clock=clock)
    async with opened(tier):
        server.stop()
        with socket.socket() as silent:  # accepts connections, never answers
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            silent.bind(("127.0.0.1", server.port))
            silent.listen(64)
            with anyio.fail_after(5):
                assert await tier.lookup(keys) == [False] * 4  # four timeouts open it
            assert tier.statistics().circuit_state == "open"
            with anyio.fail_after(0.5):
                assert await tier.lookup(keys) == [False] * 4
                with pytest.raises(CircuitOpenError):
                    await tier.load(keys[:1], make_blocks(1, CTX.block_bytes))


@pytest.mark.anyio
async def test_a_cancelled_store_leaves_no_partial_object(
    moto_s3: MotoS3Server, s3_bucket: str
) -> None:
    keys, blocks, slots = (
        make_keys(8),
        make_blocks(8, CTX.block_bytes),
        make_blocks(8, CTX.block_bytes),
    )
    async with opened(s3_tier(moto_s3, s3_bucket, max_concurrency=2)) as tier:
        third_put = anyio.Event()
        requests = RequestLog().attach(tier)

        def watch(**_: Any) -> None:
            if requests.sent.get("PutObject", 0) >= 3:
                third_put.set()

        tier.client.meta.events.register("before-send.s3.PutObject", watch)
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.store, keys, blocks)
            with anyio.fail_after(10):
                await third_put.wait()
            tg.cancel_scope.cancel()
        found = await tier.lookup(keys)
        assert 0 < sum(found) < 8
        present = [k for k, f in zip(keys, found, strict=True) if f]
        assert await tier.load(present, slots[: len(present)]) == [True] * len(present)
        assert await tier.store(keys, blocks) == [True] * 8  # the tier still works


# -- a hung endpoint ---------------------------------------------------------------------------

# Config per operation. Stores and loads get 2 x timeout_s per request (retries included),
# a lookup's HEAD gets lookup_timeout_s, far under timeout_s here: the bound shows which ran.
HUNG: dict[str, dict[str, Any]] = {
    "store": {"timeout_s": 0.5, "retries": 3},
    "load": {"timeout_s": 0.5, "retries": 3},
    "lookup": {"timeout_s": 5.0, "lookup_timeout_s": 0.3, "retries": 3},
}
OPEN_S = 30.0  # the breaker's open time (on the fake clock)


def bound_s(tier: S3Tier, operation: str) -> float:
    """How long one call may run against a hung endpoint, by the tier's config."""
    cfg = tier.config
    return {
        "store": 2 * cfg.timeout_s,
        "load": 2 * cfg.timeout_s,
        "lookup": cfg.lookup_timeout_s,
        "probe": min(cfg.timeout_s, cfg.lookup_timeout_s),
        "open": 3 * cfg.timeout_s,  # the probe's budget, then closing the client
    }[operation]


async def timed(call: Awaitable[T]) -> tuple[T, float]:
    """``await call`` and the seconds it took; a hang fails the test instead of stalling it."""
    start = anyio.current_time()
    with anyio.fail_after(30):
        result = await call
    return result, anyio.current_time() - start


async def fails_within_its_bound(
    tier: S3Tier, operation: str, keys: list[bytes], blocks: list[memoryview]
) -> None:
    """``operation`` on ``keys`` against a hung endpoint: every key fails within the bound,
    the first timeouts open the circuit, and the next call fails at once, without I/O."""
    before = tier.statistics()
    calls = {"store": tier.store, "load": tier.load, "lookup": lambda k, _: tier.lookup(k)}
    result, elapsed = await timed(calls[operation](keys, blocks))
    stats = tier.statistics()
    assert result == [False] * len(keys)
    assert elapsed < bound_s(tier, operation) + SLACK_S, elapsed
    assert (stats.circuit_state, stats.circuit_opens) == ("open", before.circuit_opens + 1)
    assert stats.timeouts - before.timeouts >= 2  # two timeouts open it, not all the retries
    if operation == "lookup":  # a store's or load's failures are the ledger's count
        assert stats.lookup_timeouts - before.lookup_timeouts == len(keys)
    requests = RequestLog().attach(tier)
    with anyio.fail_after(SLACK_S):
        if operation == "lookup":
            assert await tier.lookup(keys) == [False] * len(keys)
        else:
            with pytest.raises(CircuitOpenError):
                await calls[operation](keys, blocks)
    assert requests.total == 0


async def probe_fails_within_its_bound(tier: S3Tier, clock: FakeClock, keys: list[bytes]) -> None:
    """After the open time, the probe against the hung endpoint times out: open again."""
    opens = tier.statistics().circuit_opens
    clock.advance(OPEN_S)
    result, elapsed = await timed(tier.lookup(keys))
    assert result == [False] * len(keys)
    assert elapsed < bound_s(tier, "probe") + SLACK_S, elapsed
    stats = tier.statistics()
    assert (stats.circuit_state, stats.circuit_opens) == ("open", opens + 1)


async def recovers(tier: S3Tier, clock: FakeClock, keys: list[bytes]) -> None:
    """The endpoint answers again: the next probe closes the circuit and the keys are found.
    (A resumed server may first work through what it received while paused: a few probes.)"""
    for _ in range(5):
        clock.advance(OPEN_S)
        found = await tier.lookup(keys)
        if tier.statistics().circuit_state == "closed":
            break
    assert tier.statistics().circuit_state == "closed"
    assert found == [True] * len(keys) or await tier.lookup(keys) == [True] * len(keys)


async def loads_again(
    tier: S3Tier, clock: FakeClock, keys: list[bytes], slots: list[memoryview]
) -> None:
    """After the recovery the stored blocks load again. The first GETs on fresh connections
    to a restarted or resumed server can miss this tier's tight deadline (0.5 s) on a loaded
    machine and open the breaker once more: then the next probe closes it."""
    for _ in range(5):
        if await tier.load(keys, slots) == [True] * len(keys):
            return
        clock.advance(OPEN_S)
        await tier.lookup(keys)  # the probe that closes the circuit again
    raise AssertionError(f"the blocks did not load again: {tier.statistics()}")


async def seed(
    server: MotoS3Server, bucket: str, keys: list[bytes], blocks: list[memoryview]
) -> None:
    """Store ``blocks`` through a tier with the default deadlines: the setup of a test whose
    own tier has tight ones (0.5 s), which a loaded machine can miss on a healthy server."""
    async with opened(s3_tier(server, bucket)) as patient:
        assert await patient.store(keys, blocks) == [True] * len(keys)


def targets(
    operation: str, keys: list[bytes], blocks: list[memoryview], slots: list[memoryview]
) -> tuple[list[bytes], list[memoryview]]:
    """What ``operation`` runs on: new keys for a store, the 4 stored ones otherwise."""
    return (keys[4:], blocks[4:]) if operation == "store" else (keys[:4], slots[:4])


@pytest.mark.anyio
async def test_a_put_sends_its_body_without_waiting_for_100_continue(
    moto_s3: MotoS3Server, s3_bucket: str
) -> None:
    headers: list[dict[str, str]] = []
    async with opened(s3_tier(moto_s3, s3_bucket)) as tier:
        tier.client.meta.events.register(
            "before-send.s3.PutObject", lambda request, **_: headers.append(dict(request.headers))
        )
        assert await tier.store(make_keys(2), make_blocks(2, CTX.block_bytes)) == [True, True]
    assert len(headers) == 2
    assert not [h for h in headers if "expect" in (k.lower() for k in h)]


@pytest.mark.anyio
@pytest.mark.parametrize("operation", ["store", "load", "lookup"])
async def test_a_silent_endpoint_fails_each_call_within_its_deadline(
    own_moto_s3: MotoS3Server, operation: str
) -> None:
    server, clock = own_moto_s3, FakeClock()
    server.create_bucket("silent")
    keys, blocks, slots = data(8)
    tier = s3_tier(server, "silent", clock=clock, breaker_open_s=OPEN_S, **HUNG[operation])
    await seed(server, "silent", keys[:4], blocks[:4])
    async with opened(tier):
        server.stop()
        with SilentServer(server.port) as silent:
            await fails_within_its_bound(tier, operation, *targets(operation, keys, blocks, slots))
            await probe_fails_within_its_bound(tier, clock, keys[:4])
            assert tier.staging.in_use == 0  # the lookups' buffers came back
        method = {"store": b"PUT", "load": b"GET", "lookup": b"GET"}[operation]
        assert f"{method.decode()} /silent/".encode() in silent.received
        assert b"expect:" not in silent.received.lower()
        server.start()
        await recovers(tier, clock, keys[:4])
        await loads_again(tier, clock, keys[:4], slots[:4])
    assert all(equal(a, b) for a, b in zip(blocks[:4], slots[:4], strict=True))


@pytest.mark.anyio
async def test_the_first_timeouts_open_the_circuit_not_the_retries(
    own_moto_s3: MotoS3Server,
) -> None:
    server = own_moto_s3
    server.create_bucket("first")
    (key,), (block,) = make_keys(1), make_blocks(1, CTX.block_bytes)
    tier = s3_tier(server, "first", timeout_s=0.3, retries=5, breaker_threshold=5)
    async with opened(tier):
        requests = RequestLog().attach(tier)
        server.stop()
        with SilentServer(server.port):
            result, elapsed = await timed(tier.store([key], [block]))
        stats = tier.statistics()
    assert result == [False]
    assert requests.sent == {"PutObject": 2}  # then the circuit opened: no third attempt
    assert (stats.timeouts, stats.retries, stats.circuit_state) == (2, 1, "open")
    assert elapsed < 2 * 0.3 + SLACK_S


@pytest.mark.anyio
@pytest.mark.parametrize("operation", ["store", "load", "lookup"])
async def test_a_paused_server_fails_each_call_within_its_deadline_and_recovers(
    moto_s3_process: MotoS3Server, operation: str
) -> None:
    server, clock = moto_s3_process, FakeClock()
    bucket = f"paused-{os.urandom(6).hex()}"
    server.create_bucket(bucket)
    keys, blocks, slots = data(8)
    tier = s3_tier(server, bucket, clock=clock, breaker_open_s=OPEN_S, **HUNG[operation])
    await seed(server, bucket, keys[:4], blocks[:4])
    async with opened(tier):
        server.pause()
        try:
            await fails_within_its_bound(tier, operation, *targets(operation, keys, blocks, slots))
            await probe_fails_within_its_bound(tier, clock, keys[:4])
        finally:
            server.resume()
        await recovers(tier, clock, keys[:4])
        await loads_again(tier, clock, keys[:4], slots[:4])
    assert all(equal(a, b) for a, b in zip(blocks[:4], slots[:4], strict=True))


@pytest.mark.anyio
@pytest.mark.parametrize("hung", ["silent", "paused"])
async def test_open_against_a_hung_endpoint_fails_within_its_budget(
    moto_s3_process: MotoS3Server, hung: str
) -> None:
    with contextlib.ExitStack() as stack:
        if hung == "silent":
            port = stack.enter_context(SilentServer()).port
        else:
            port = moto_s3_process.port
            moto_s3_process.pause()
            stack.callback(moto_s3_process.resume)
        cfg = config({"bucket": "kv", "endpoint_override": f"127.0.0.1:{port}",
                      "access_key": "AKIAOPENTEST", "secret_key": "open-test-secret",
                      "timeout_s": 0.5, "retries": 9})  # fmt: skip
        tier = S3Tier("obj", CTX, cfg, backoff_s=0.001)
        start = anyio.current_time()
        with anyio.fail_after(30), pytest.raises(EndpointUnreachableError) as info:
            await tier.open()
        elapsed = anyio.current_time() - start
        await tier.aclose()
    assert elapsed < bound_s(tier, "open") + SLACK_S, elapsed
    assert isinstance(info.value.__cause__, RequestTimeoutError)
    assert "no complete answer" in str(info.value)


@pytest.mark.anyio
async def test_a_cache_over_a_silent_endpoint_drains_and_frees_its_slots(
    own_moto_s3: MotoS3Server, caplog: pytest.LogCaptureFixture
) -> None:
    server = own_moto_s3
    server.create_bucket("cache")
    tier = server.tier_config("cache", timeout_s=0.5, retries=3)
    cfg = {"block_bytes": 4 * KIB, "num_slots": 16, "secondary_tiers": [tier]}
    keys = make_keys(8)
    blocks = [np.full(4 * KIB, i, np.uint8) for i in range(8)]
    async with TieredKVCache(cfg) as cache:
        server.stop()
        with SilentServer(server.port):
            assert len((await cache.store(keys[:4], blocks[:4])).stored) == 4
            _, elapsed = await timed(cache.drain())
            assert elapsed < 2 * 0.5 + SLACK_S, elapsed
            stats = cache.stats()
            counters = stats.tiers[0].counts
            tier_stats = stats.tiers[0].state
            assert (stats.ledger.pinned, stats.ledger.writing) == (0, 0)  # slots released
            assert counters.cascade_failed == 4
            assert tier_stats.circuit_state == "open"
            # while the circuit is open every cascade fails whole, at once: one warning
            caplog.set_level(logging.WARNING, logger="kvtier_async.engine.lane")
            for i in range(4, 8):
                await cache.store(keys[i : i + 1], blocks[i : i + 1])
            _, elapsed = await timed(cache.drain())
            assert elapsed < SLACK_S
            lane = next(s for s in cache.stats().lanes if s.name == "obj[0]")
            assert (lane.failed, lane.warnings_suppressed) == (4, 3)
            lines = [r.getMessage() for r in caplog.records if r.name.endswith(".lane")]
            assert [line.split(" lane=")[0] for line in lines] == ["job failed"]
            assert cache.stats().ledger.pinned == 0


@pytest.mark.anyio
async def test_a_cache_lookup_over_a_silent_endpoint_is_a_miss_within_its_deadline(
    own_moto_s3: MotoS3Server,
) -> None:
    server = own_moto_s3
    server.create_bucket("cache")
    tier = server.tier_config("cache", timeout_s=5.0, lookup_timeout_s=0.3)
    async with TieredKVCache({"block_bytes": 4 * KIB, "num_slots": 8,
                              "secondary_tiers": [tier]}) as cache:  # fmt: skip
        server.stop()
        with SilentServer(server.port):
            found, elapsed = await timed(cache.lookup(make_keys(4)))
            assert found == 0
            assert elapsed < 0.3 + SLACK_S, elapsed  # not timeout_s, not (retries + 1) x it
            assert cache.stats().tiers[0].state.lookup_timeouts >= 1


@pytest.mark.anyio
async def test_closing_a_cache_over_a_silent_endpoint_is_bounded(
    own_moto_s3: MotoS3Server, caplog: pytest.LogCaptureFixture
) -> None:
    server = own_moto_s3
    server.create_bucket("close")
    tier = server.tier_config("close", timeout_s=30.0, retries=0)  # requests outlast the close
    cfg = {"block_bytes": 4 * KIB, "num_slots": 8, "secondary_tiers": [tier],
           "close_timeout_s": 0.5}  # fmt: skip
    caplog.set_level(logging.WARNING, logger="kvtier_async.api")
    cache = TieredKVCache(cfg)
    with contextlib.ExitStack() as stack:
        async with cache:
            server.stop()
            stack.enter_context(SilentServer(server.port))
            await cache.store(make_keys(2), [np.zeros(4 * KIB, np.uint8)] * 2)
            start = anyio.current_time()
        elapsed = anyio.current_time() - start
    assert elapsed < 0.5 + SLACK_S, elapsed
    (record,) = [r for r in caplog.records if r.name == "kvtier_async.api"]
    assert record.getMessage().startswith("cache closed before its jobs ended; cancelling them")
    assert "jobs=1" in record.getMessage() and "'obj[0]': 1" in record.getMessage()
    stats = cache.ledger.primary.statistics()
    assert (stats.pinned, stats.writing) == (0, 0)
    assert cache.ledger.counters[0].cascade_failed == 2


def test_a_threaded_engine_closes_in_time_over_a_silent_endpoint(
    own_moto_s3: MotoS3Server,
) -> None:
    """The vLLM face's shutdown path: ThreadedEngine.close cancels a PUT that hangs."""
    server = own_moto_s3
    server.create_bucket("threaded")
    tier = s3_tier(server, "threaded", timeout_s=30.0, retries=0)
    keys, blocks = make_keys(2), make_blocks(2, CTX.block_bytes)
    sent = threading.Event()
    threaded = ThreadedEngine(lambda: Engine([tier], blocks.__getitem__)).__enter__()
    try:
        threaded.call(
            tier.client.meta.events.register, "before-send.s3.PutObject", lambda **_: sent.set()
        )
        server.stop()
        with SilentServer(server.port):
            threaded.submit([Job(JobKind.STORE, tuple(keys), [0, 1], tier=0)])
            assert sent.wait(timeout=10)
            start = time.monotonic()
            threaded.close()
            elapsed = time.monotonic() - start
    finally:
        threaded.close()
    assert elapsed < SLACK_S, elapsed
    (result,) = threaded.poll()
    assert result.cancelled and result.ok == (False, False)


# -- start-up ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_open_reports_an_unreachable_endpoint() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = config({"bucket": "kv", "endpoint_override": f"127.0.0.1:{port}", "access_key": "a",
                  "secret_key": "b", "retries": 1})  # fmt: skip
    tier = S3Tier("obj", CTX, cfg, backoff_s=0.001)
    with anyio.fail_after(10), pytest.raises(EndpointUnreachableError) as info:
        await tier.open()
    await tier.aclose()
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, TierOpenError)
    assert f"127.0.0.1:{port}" in str(info.value)
    assert "secondary_tiers[1].endpoint_override" in str(info.value)


@pytest.mark.anyio
async def test_open_reports_a_missing_bucket(moto_s3: MotoS3Server) -> None:
    tier = s3_tier(moto_s3, "no-such-bucket")
    with pytest.raises(BucketNotFoundError, match=r"obj\.bucket: bucket 'no-such-bucket'") as info:
        await tier.open()
    await tier.aclose()
    assert isinstance(info.value, LookupError)


@pytest.mark.anyio
async def test_empty_credentials_use_the_aws_chain(
    moto_s3: MotoS3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    cfg = config({"bucket": s3_bucket, "endpoint_override": moto_s3.endpoint})
    tier = S3Tier("obj", CTX, cfg)
    with pytest.raises(AccessDeniedError, match="credential chain found none"):
        await tier.open()
    await tier.aclose()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-the-environment")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-the-environment")
    async with opened(S3Tier("obj", CTX, cfg)) as tier:
        assert await tier.lookup(make_keys(1)) == [False]


@pytest.fixture
def iam_users(moto_s3: MotoS3Server, s3_bucket: str) -> dict[str, tuple[str, str]]:
    """Two IAM users, one allowed S3 and one without any policy; moto then checks auth."""

    async def create() -> dict[str, tuple[str, str]]:
        users = {}
        async with raw_client(moto_s3, "iam") as iam:
            for user in ("allowed", "denied"):
                await iam.create_user(UserName=f"{s3_bucket}-{user}")
                key = (await iam.create_access_key(UserName=f"{s3_bucket}-{user}"))["AccessKey"]
                users[user] = (key["AccessKeyId"], key["SecretAccessKey"])
            allow = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
            policy = {"Version": "2012-10-17", "Statement": [allow]}
            await iam.put_user_policy(
                UserName=f"{s3_bucket}-allowed", PolicyName="s3", PolicyDocument=json.dumps(policy)
            )
        return users

    return anyio.run(create)


@pytest.fixture
def moto_auth(moto_s3: MotoS3Server) -> Any:
    """Turn on moto's IAM checks for one test."""
    moto_s3.set_auth(True)
    try:
        yield
    finally:
        moto_s3.set_auth(False)


@pytest.mark.anyio
async def test_open_reports_rejected_credentials_and_denied_access(
    moto_s3: MotoS3Server, s3_bucket: str, iam_users: dict[str, tuple[str, str]], moto_auth: Any
) -> None:
    allowed, denied = iam_users["allowed"], iam_users["denied"]
    cases = {
        "unknown key": ((f"AKIA{'X' * 16}", "whatever"), "InvalidAccessKeyId", "rejected"),
        "wrong secret": ((allowed[0], "not-the-secret"), "SignatureDoesNotMatch", "rejected"),
        "no permission": (denied, "AccessDenied", "access denied"),
    }
    for (access_key, secret_key), code, text in cases.values():
        tier = s3_tier(moto_s3, s3_bucket, access_key=access_key, secret_key=secret_key)
        with pytest.raises(AccessDeniedError) as info:
            await tier.open()
        await tier.aclose()
        assert isinstance(info.value, PermissionError)
        assert info.value.code == code and text in str(info.value)
    access_key, secret_key = allowed
    async with opened(
        s3_tier(moto_s3, s3_bucket, access_key=access_key, secret_key=secret_key)
    ) as tier:
        assert await tier.store(make_keys(1), make_blocks(1, CTX.block_bytes)) == [True]


@pytest.mark.anyio
async def test_credentials_never_show(
    moto_s3: MotoS3Server, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    secrets = {"access_key": "AKIAKVTIERLEAKCHECK1", "secret_key": "kvtier-secret-LEAK-check-2",
               "session_token": "kvtier-token-LEAK-check-3"}  # fmt: skip
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="kvtier_async")
    shown: list[str] = []
    keys, blocks = make_keys(2), make_blocks(2, CTX.block_bytes)
    # accepted while moto does not check; then every request is refused
    tier = s3_tier(moto_s3, s3_bucket, **secrets)
    async with opened(tier):
        assert await tier.store(keys[:1], blocks[:1]) == [True]
        moto_s3.set_auth(True)
        try:
            assert await tier.lookup(keys) == [False, False]
            assert await tier.store(keys[1:], blocks[1:]) == [False]
            assert await tier.load(keys[:1], blocks[:1]) == [False]
        finally:
            moto_s3.set_auth(False)
        shown += [repr(tier), str(tier.statistics()), repr(tier.config), str(tier.config)]
        shown += [json.dumps(tier.config.as_dict())]
        moto_s3.set_auth(True)
        try:
            again = s3_tier(moto_s3, s3_bucket, **secrets)
            with pytest.raises(AccessDeniedError) as info:
                await again.open()
            await again.aclose()
        finally:
            moto_s3.set_auth(False)
    shown += [str(info.value), repr(info.value), "".join(traceback.format_exception(info.value))]
    shown += [caplog.text, *(str(r.__dict__) for r in caplog.records)]
    assert "obj store failed" in caplog.text and "rejected" in str(info.value)
    for text in shown:
        for secret in secrets.values():
            assert secret not in text
    assert tier.config.as_dict()["secret_key"] == "***"
    assert repr(Secret("x")) == "Secret('***')" and str(Secret()) == ""


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_open_says_it_needs_asyncio(anyio_backend: str) -> None:
    tier = S3Tier("obj", CTX, config({"bucket": "kv", "endpoint_override": "127.0.0.1:9"}))
    with pytest.raises(TierOpenError, match="needs asyncio"):
        await tier.open()
    await tier.aclose()


@pytest.mark.anyio
async def test_calls_need_an_open_tier(moto_s3: MotoS3Server, s3_bucket: str) -> None:
    tier = s3_tier(moto_s3, s3_bucket)
    with pytest.raises(RuntimeError, match="not open"):
        await tier.lookup(make_keys(1))
    async with opened(tier):
        assert await tier.lookup([]) == []
        with pytest.raises(ValueError, match="2 keys but 1 blocks"):
            await tier.store(make_keys(2), make_blocks(1, CTX.block_bytes))
    await tier.aclose()  # idempotent
    with pytest.raises(RuntimeError):
        await tier.open()


OPEN_CHILD = """
import socket, sys, threading, time
import anyio
from kvtier_async.api import TieredKVCache
from kvtier_async.tiers.s3 import EndpointUnreachableError

silent = socket.socket()
silent.bind(("127.0.0.1", 0))
silent.listen(64)  # accepts connections (the kernel's backlog), never answers
config = {"block_bytes": 4096, "num_slots": 4, "secondary_tiers": [{
    "type": "obj", "bucket": "kv", "endpoint_override": f"127.0.0.1:{silent.getsockname()[1]}",
    "scheme": "http", "access_key": "test-access-key", "secret_key": "test-secret-key",
    "region": "us-east-1", "timeout_s": float(sys.argv[1])}]}

async def main():
    start = time.monotonic()
    try:
        async with TieredKVCache(config):
            print("opened")
    except EndpointUnreachableError:
        pass
    print(time.monotonic() - start, "torch" in sys.modules)

anyio.run(main)
"""


def test_a_first_open_over_a_silent_endpoint_ends_within_its_deadline() -> None:
    """The first open of a process over an endpoint that never answers fails within its
    stated bound (a request and its retries: 2 x timeout_s), and imports no torch on the
    way (a host-only cache has no use for it: seconds of the open before)."""
    import subprocess
    import sys

    timeout_s = 1.0
    done = subprocess.run(
        [sys.executable, "-c", OPEN_CHILD, str(timeout_s)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    elapsed, torch_imported = done.stdout.split()
    assert torch_imported == "False"
    assert float(elapsed) < 2 * timeout_s + SLACK_S, elapsed
