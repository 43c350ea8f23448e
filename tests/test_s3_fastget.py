"""The obj tier's GET without botocore (`kvtier_async.tiers.s3.fastget`): its SigV4
signature against botocore's own signer, and its requests against ``rclone serve s3``, a real
S3 server that verifies signatures (moto does not)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
from aiobotocore.credentials import AioCredentials  # type: ignore[import-untyped]
from botocore.auth import S3SigV4Auth  # type: ignore[import-untyped]
from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
from botocore.credentials import Credentials  # type: ignore[import-untyped]
from botocore.exceptions import ClientError  # type: ignore[import-untyped]

from _s3 import Injector, RequestLog, inject, make_blocks, make_keys, opened
from kvtier_async.bench.rclone import RcloneS3Server
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.blockfile import CorruptBlockError
from kvtier_async.tiers.s3 import S3Config, S3Tier
from kvtier_async.tiers.s3.fastget import EMPTY_SHA256, FastGet, Signer, _canonical_host
from kvtier_async.tiers.s3.requests import code_of, status_of

pytest_plugins = ["conftest_s3"]

CTX = TierContext(block_bytes=64 * 1024, model="test/fastget")
AMZ_DATE = "%Y%m%dT%H%M%SZ"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//token+with/odd=chars"])
@pytest.mark.parametrize("region", ["us-east-1", "eu-central-1"])
@pytest.mark.parametrize(
    "path", ["/kvtier-bench/kv/ab/abcdef0123.kvb", "/b/a%20key%2Bplus/~tilde", "/bucket/x"]
)
def test_the_signature_is_botocores(token: str | None, region: str, path: str) -> None:
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    host = "127.0.0.1:9000"
    request = AWSRequest(
        method="GET", url=f"http://{host}{path}", headers={"X-Amz-Content-SHA256": EMPTY_SHA256}
    )
    S3SigV4Auth(credentials, "s3", region).add_auth(request)
    amz_date = request.context["timestamp"]
    signer = Signer(region)
    for _ in range(2):  # the second with the cached signing key
        ours = signer.headers("GET", host, path, credentials.get_frozen_credentials(), amz_date)
        assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"] == amz_date
    assert ours.get("x-amz-security-token") == request.headers.get("X-Amz-Security-Token")
    assert ours["x-amz-content-sha256"] == EMPTY_SHA256
    other = Signer(region).headers("GET", host, path + "x", credentials, amz_date)
    assert other["authorization"] != ours["authorization"]  # the path is signed


def rclone_tier(server: RcloneS3Server, **extra: object) -> S3Tier:
    fields = {"timeout_s": 30.0, "lookup_timeout_s": 30.0, **extra}  # a loaded machine
    config = S3Config.parse(server.tier_config(prefix="fastget", **fields), "obj")
    return S3Tier("obj", CTX, config, backoff_s=0.001)


@pytest.mark.anyio
async def test_hits_are_served_by_one_signed_get_each(rclone_s3: RcloneS3Server) -> None:
    keys, blocks = make_keys(5, group=7), make_blocks(5, CTX.block_bytes, seed=3)
    slots = make_blocks(4, CTX.block_bytes)
    async with opened(rclone_tier(rclone_s3)) as tier:
        assert isinstance(tier, S3Tier) and tier.fast_get is not None
        assert await tier.store(keys[:4], blocks[:4]) == [True] * 4
        requests = RequestLog().attach(tier)
        assert await tier.lookup(keys) == [True] * 4 + [False]  # the 5th: a 404, a miss
        assert await tier.load(keys[:4], slots) == [True] * 4
        stats, sent = tier.statistics(), tier.fast_get.sent
    assert [a.tobytes() for a in slots] == [b.tobytes() for b in blocks[:4]]
    assert requests.sent == {"GetObject": 5} and sent == 5
    assert sorted(requests.statuses) == [("GetObject", 200)] * 4 + [("GetObject", 404)]
    assert (stats.staged_loads, stats.lookup_timeouts, stats.retries) == (4, 0, 0)


@pytest.mark.anyio
async def test_a_load_without_staging_gets_each_block(rclone_s3: RcloneS3Server) -> None:
    keys, blocks = make_keys(3, group=8), make_blocks(3, CTX.block_bytes, seed=4)
    slots = make_blocks(3, CTX.block_bytes)
    async with opened(rclone_tier(rclone_s3, staging_bytes=0)) as tier:
        assert await tier.store(keys, blocks) == [True] * 3
        requests = RequestLog().attach(tier)
        assert await tier.lookup(keys) == [True] * 3
        assert await tier.load(keys, slots) == [True] * 3
    assert [a.tobytes() for a in slots] == [b.tobytes() for b in blocks]
    assert requests.sent == {"HeadObject": 3, "GetObject": 3}


@pytest.mark.anyio
async def test_an_injected_slowdown_is_retried(rclone_s3: RcloneS3Server) -> None:
    (key,), (block,), (slot,) = (
        make_keys(1, group=9),
        make_blocks(1, CTX.block_bytes),
        make_blocks(1, CTX.block_bytes),
    )
    async with opened(rclone_tier(rclone_s3, retries=3, lookup_timeout_s=30.0)) as tier:
        assert await tier.store([key], [block]) == [True]
        slowdown = Injector(503, "SlowDown", count=2)
        inject(tier, "GetObject", slowdown)
        assert await tier.lookup([key]) == [True]
        assert await tier.load([key], [slot]) == [True]
        stats = tier.statistics()
    assert (slowdown.injected, slowdown.seen, stats.retries) == (2, 3, 2)
    assert slot.tobytes() == block.tobytes()


async def fast_get(server: RcloneS3Server, stack: AsyncExitStack, secret: str) -> FastGet:
    config = S3Config.parse(server.tier_config(), "obj")
    credentials = AioCredentials(server.access_key, secret)  # as an aioboto3 session has
    return await FastGet.open(stack, config, credentials, server.region)


@pytest.mark.anyio
async def test_a_wrong_secret_and_a_missing_object_are_client_errors_by_name(
    rclone_s3: RcloneS3Server,
) -> None:
    views = [memoryview(bytearray(16))]
    async with AsyncExitStack() as stack:
        wrong = await fast_get(rclone_s3, stack, rclone_s3.secret_key[::-1])
        with pytest.raises(ClientError) as refused:
            await wrong.get_into("fastget/anything", views)
        right = await fast_get(rclone_s3, stack, rclone_s3.secret_key)
        with pytest.raises(ClientError) as missing:
            await right.get_into("fastget/no-such-object", views)
    assert status_of(refused.value) == 403 and code_of(refused.value)  # rclone names it
    assert (status_of(missing.value), code_of(missing.value)) == (404, "NoSuchKey")
    assert rclone_s3.secret_key not in str(refused.value)
    assert bytes(views[0]) == bytes(16)  # an error answer writes nothing


@pytest.mark.anyio
async def test_an_object_of_the_wrong_length_is_corrupt(rclone_s3: RcloneS3Server) -> None:
    name = "fastget/short-object"
    async with opened(rclone_tier(rclone_s3)) as tier:
        assert isinstance(tier, S3Tier)
        await tier.client.put_object(Bucket=rclone_s3.bucket, Key=name, Body=b"x" * 100)
        assert tier.fast_get is not None
        for size in (99, 101):
            with pytest.raises(CorruptBlockError, match="100 bytes"):
                await tier.fast_get.get_into(name, [memoryview(bytearray(size))])
        whole = memoryview(bytearray(100))
        await tier.fast_get.get_into(name, [whole[:40], whole[40:]])
    assert bytes(whole) == b"x" * 100


@pytest.mark.parametrize(
    ("scheme", "host"),
    [("http", "minio.internal:80"), ("https", "s3.example:443"), ("http", "127.0.0.1:9000"),
     ("https", "s3.example:80")],
)  # fmt: skip
def test_the_signed_host_is_botocores(scheme: str, host: str) -> None:
    """A default port in ``endpoint_override`` is left out of the signed Host, as botocore
    leaves it out (and aiohttp's Host header does)."""
    credentials = Credentials("AKIDEXAMPLE", "secret")
    request = AWSRequest(
        method="GET", url=f"{scheme}://{host}/b/k", headers={"X-Amz-Content-SHA256": EMPTY_SHA256}
    )
    S3SigV4Auth(credentials, "s3", "us-east-1").add_auth(request)
    signed = _canonical_host(scheme, host)
    amz_date = request.context["timestamp"]
    ours = Signer("us-east-1").headers("GET", signed, "/b/k", credentials, amz_date)
    assert ours["authorization"] == request.headers["Authorization"]
