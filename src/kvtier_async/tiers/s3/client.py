"""The obj tier's aiobotocore client: opening it, checking the bucket, and block bodies.

*Opening.* `enter_client` creates one aioboto3 session and S3 client with our timeouts and
retries (botocore's are off), path-style addressing for a custom endpoint, and no S3
checksum headers: the checksum travels inside the object (the block file format), so it works
on every S3-compatible store (moto neither checks nor returns them, and SigV4 already covers
the payload over plain HTTP). `probe_bucket` HEADs the bucket and turns a failure into the
`TierOpenError` that says what to fix.

*No 100-continue.* botocore asks for ``Expect: 100-continue`` on every PUT whose body looks
like a file; `no_expect_continue` (a ``before-sign.s3.PutObject`` hook) removes it, because
aiohttp waits for the ``100 Continue`` with no timeout running (neither connect nor read), so
an endpoint that accepted the connection and went silent held the PUT, its pinned CPU slot
and the engine's drain forever.

*Bodies.* A PUT sends the header page and the slot's memory as one body without copying the
block (`BlockFileBody` hands aiohttp slices of the slot itself); a GET streams the body chunk
by chunk straight into the slot's memory (`read_into`): no whole-object copy either way.
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import AsyncExitStack
from typing import Any, Final

import aioboto3
import aiohttp.payload
import anyio
from aiohttp.abc import AbstractStreamWriter
from botocore import exceptions as boto_errors  # type: ignore[import-untyped]
from botocore.config import Config as BotoConfig  # type: ignore[import-untyped]

from kvtier_async.tiers.blockfile import CorruptBlockError
from kvtier_async.tiers.s3.config import S3Config
from kvtier_async.tiers.s3.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    EndpointUnreachableError,
    TierOpenError,
)
from kvtier_async.tiers.s3.requests import CONNECTION_ERRORS, Requests, code_of, status_of

__all__ = [
    "BlockFileBody",
    "check_ca_bundle",
    "enter_client",
    "make_session",
    "no_expect_continue",
    "probe_bucket",
    "read_into",
]

_SEND_CHUNK: Final = 256 * 1024  # slices handed to aiohttp: bounds its transport buffer
_CREDENTIAL_CODES: Final = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
    "TokenRefreshRequired", "InvalidClientTokenId", "AuthorizationHeaderMalformed",
})  # fmt: skip


# -- opening ---------------------------------------------------------------------------------


async def check_ca_bundle(config: S3Config) -> None:
    """`TierOpenError` if ``ca_bundle`` names no file (for https)."""
    bundle = config.ca_bundle
    if bundle and config.scheme == "https" and not await anyio.Path(bundle).is_file():
        raise TierOpenError(f"{config.field('ca_bundle')}: no such file {bundle!r}")


def make_session(config: S3Config) -> aioboto3.Session:
    """An aioboto3 session with the config's credentials (empty: the AWS credential chain)."""
    return aioboto3.Session(
        aws_access_key_id=config.access_key.reveal() or None,
        aws_secret_access_key=config.secret_key.reveal() or None,
        aws_session_token=config.session_token.reveal() or None,
    )


async def enter_client(
    stack: AsyncExitStack, requests: Requests, session: aioboto3.Session | None = None
) -> Any:
    """A new aiobotocore S3 client for ``requests.config`` (from ``session``, default a new
    `make_session`), closed with ``stack``; our retries instead of botocore's, no
    ``Expect: 100-continue`` (`no_expect_continue`)."""
    config = requests.config
    session = session or make_session(config)
    verify = config.ca_bundle if config.ca_bundle and config.scheme == "https" else None
    client_config = BotoConfig(
        connect_timeout=config.timeout_s,
        read_timeout=config.timeout_s,
        retries={"total_max_attempts": 1},  # ours, with the breaker, instead
        max_pool_connections=config.max_concurrency + 1,  # + the breaker's probe
        request_checksum_calculation="when_required",  # the body carries its checksum
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if config.endpoint_override else {},
        user_agent_extra="kvtier-async",
    )
    try:
        client = await stack.enter_async_context(
            session.client(
                "s3",
                endpoint_url=config.endpoint_url,
                region_name=config.client_region,
                use_ssl=config.scheme == "https",
                verify=verify,
                config=client_config,
            )
        )
        client.meta.events.register("before-sign.s3.PutObject", no_expect_continue)
        return client
    except boto_errors.NoRegionError:
        raise TierOpenError(
            f"{config.field('region')}: empty, and the AWS configuration names no region"
        ) from None
    except Exception as exc:
        raise TierOpenError(
            f"obj tier {requests.name!r}: cannot create the S3 client: {requests.describe(exc)}"
        ) from exc


async def probe_bucket(requests: Requests, client: Any) -> None:
    """HEAD the bucket (past the breaker); raise the `TierOpenError` that says what to fix."""
    config, describe = requests.config, requests.describe
    head_bucket = functools.partial(client.head_bucket, Bucket=config.bucket)
    try:
        await requests.send(head_bucket, gated=False)
    except boto_errors.ClientError as exc:
        raise await _open_error(requests, client, exc) from exc
    except (boto_errors.NoCredentialsError, boto_errors.PartialCredentialsError) as exc:
        raise AccessDeniedError(
            f"{config.field('access_key')} and {config.field('secret_key')} are empty and "
            f"the AWS credential chain found none ({describe(exc)})"
        ) from exc
    except CONNECTION_ERRORS as exc:
        raise EndpointUnreachableError(
            f"obj tier {requests.name!r}: cannot reach {config.endpoint_url or 'AWS S3'} "
            f"({describe(exc)}); check {config.field('endpoint_override')}, "
            f"{config.field('scheme')} and {config.field('ca_bundle')}"
        ) from exc


async def _open_error(requests: Requests, client: Any, exc: Any) -> TierOpenError:
    """The `TierOpenError` for HEAD bucket's error answer."""
    config, status, code = requests.config, status_of(exc), code_of(exc)
    where = f"bucket {config.bucket!r} at {config.endpoint_url or 'AWS S3'}"
    if status == 404 or code in ("NoSuchBucket", "NotFound"):
        return BucketNotFoundError(
            f"{config.field('bucket')}: {where} does not exist; create it first"
        )
    if status == 403:
        return await _access_error(requests, client, where)
    if status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
        region = (
            exc.response.get("ResponseMetadata", {})
            .get("HTTPHeaders", {})
            .get("x-amz-bucket-region", "another region")
        )
        return TierOpenError(f"{config.field('region')}: {where} is in {region}")
    return TierOpenError(f"obj tier {requests.name!r}: {where}: {requests.describe(exc)}")


async def _access_error(requests: Requests, client: Any, where: str) -> AccessDeniedError:
    """HEAD answers 403 without a reason; a GET of a probe name tells which 403 it was."""
    config, code, name = requests.config, "", requests.name
    probe = f"{config.prefix}/.kvtier-probe" if config.prefix else ".kvtier-probe"
    with contextlib.suppress(Exception), anyio.move_on_after(config.timeout_s):
        try:  # without a reason (or an answer), the 403 stands as it is
            (await client.get_object(Bucket=config.bucket, Key=probe))["Body"].close()
        except boto_errors.ClientError as exc:
            code = code_of(exc)
    if code in _CREDENTIAL_CODES:
        return AccessDeniedError(
            f"obj tier {name!r}: the endpoint rejected the credentials ({code}); check "
            f"{config.field('access_key')}, {config.field('secret_key')} and "
            f"{config.field('session_token')} (when empty: the AWS credential chain)",
            code,
        )
    return AccessDeniedError(
        f"obj tier {name!r}: access denied to {where} ({code or 403}); the credentials "
        "need s3:ListBucket on the bucket and s3:GetObject, s3:PutObject and "
        "s3:DeleteObject on its objects",
        code or "AccessDenied",
    )


# -- bodies ----------------------------------------------------------------------------------


class BlockFileBody(aiohttp.payload.Payload):
    """A PUT body made of the header page and the slot itself, never copied into one buffer.

    botocore sees a file (``read``/``seek``/``tell``/``len``: it hashes the payload for SigV4
    over plain HTTP, reading memoryview slices); aiohttp sees a ready `Payload` and sends
    slices of the two views. One body per attempt: aiohttp may consume a payload.
    """

    def __init__(self, *parts: memoryview) -> None:
        super().__init__(parts)
        self._parts = parts
        self._length = self._size = sum(part.nbytes for part in parts)
        self._position = 0

    def __len__(self) -> int:
        return self._length

    def read(self, size: int | None = -1) -> memoryview:
        """Up to ``size`` bytes (all: -1) from the position, within one part; empty at EOF."""
        offset = self._position
        for part in self._parts:
            if offset < part.nbytes:
                end = part.nbytes if size is None or size < 0 else offset + size
                chunk = part[offset:end]
                self._position += chunk.nbytes
                return chunk
            offset -= part.nbytes
        return memoryview(b"")

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._position, self._length)[whence]
        self._position = min(max(0, base + offset), self._length)
        return self._position

    def tell(self) -> int:
        return self._position

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._parts).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        left = self._length if content_length is None else min(content_length, self._length)
        for part in self._parts:
            for start in range(0, min(part.nbytes, left), _SEND_CHUNK):
                chunk = part[start : min(start + _SEND_CHUNK, left)]
                await writer.write(chunk)  # waits when the transport's buffer is full
            left -= min(part.nbytes, left)


def no_expect_continue(request: Any, **_: Any) -> None:
    """``before-sign.s3.PutObject``: send the body at once, without ``Expect: 100-continue``
    (see the module docstring: no timeout covers aiohttp's wait for ``100 Continue``)."""
    del request.headers["Expect"]  # a no-op when absent


async def read_into(stream: Any, view: memoryview) -> None:
    """Fill ``view`` from a streaming body, chunk by chunk as the bytes arrive."""
    filled, size = 0, view.nbytes
    while filled < size:
        chunk = await stream.read(size - filled)
        if not chunk:
            raise CorruptBlockError(f"body ended after {filled} of {size} bytes")
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
