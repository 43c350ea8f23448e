"""The obj tier's GET without botocore: one SigV4-signed aiohttp request, read into the slot.

*Why.* botocore spends about 1.2 ms of client CPU on every request (its event hooks, the
request model, the response parsing; `kvtier bench obj` on ``rclone serve s3``), and on a
cache hit the GETs are the critical path: for a 2k-token prompt's 16 blocks, 20 of the 26 ms
the hit took. This GET signs with SigV4 itself (`Signer`: the Authorization botocore
computes, tested side by side with botocore's own signer), sends with aiohttp and reads the
body straight into the caller's views. Everything else (PUT, HEAD, DELETE, the probes, the
diagnosis at ``open``, the credential chain) stays on botocore.

*Where.* Used with a custom endpoint (``endpoint_override``: path-style addressing, as the
botocore client uses there). For AWS S3's own endpoint, GETs stay on botocore: virtual-hosted
addressing and the bucket's region are botocore's to resolve.

*Errors* are `botocore.exceptions.ClientError`s built from the answer's status and S3 error
code, so `requests.classify`, the retries and the breaker treat them as botocore's; aiohttp's
connection errors are in `requests.CONNECTION_ERRORS` already. Deadlines are the caller's
(`requests.Requests.attempt` bounds the whole request, body included); aiohttp's socket
timeouts are set to ``timeout_s`` as well. A response is read to its end or its connection
closed, never returned to the pool half-read.

*Hooks*, for instrumentation and fault injection: each of `FastGet.hooks` is called as
``hook(operation, headers)`` before a request goes out (``operation`` is ``"GetObject"``),
all of them; the first that returns ``(status, code)`` answers the request with that error
instead of sending it. Each of `FastGet.answered` is called as ``hook(operation, status)``
once a request sent is done with (``status`` 0: no answer, or a body not read whole).
`FastGet.sent` counts the requests sent.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import re
import ssl
import urllib.parse
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Final, Protocol

import aiohttp
from botocore import exceptions as boto_errors  # type: ignore[import-untyped]
from yarl import URL

from kvtier_async.tiers.blockfile import CorruptBlockError
from kvtier_async.tiers.s3.client import read_into
from kvtier_async.tiers.s3.config import S3Config

__all__ = ["EMPTY_SHA256", "AnswerHook", "FastGet", "Hook", "Signer"]

EMPTY_SHA256: Final = hashlib.sha256(b"").hexdigest()
_ALGORITHM: Final = "AWS4-HMAC-SHA256"
_ERROR_CODE: Final = re.compile(rb"<Code>([^<]{1,128})</Code>")
_ERROR_PEEK: Final = 4096  # bytes of an error answer read for its code

Hook = Callable[[str, dict[str, str]], "tuple[int, str] | None"]
AnswerHook = Callable[[str, int], None]


class FrozenCredentials(Protocol):
    access_key: str
    secret_key: str
    token: str | None


class Signer:
    """SigV4 for S3 requests without a body (``x-amz-content-sha256`` is the empty hash),
    as botocore's ``S3SigV4Auth`` signs them; the day's signing key is cached."""

    def __init__(self, region: str, service: str = "s3") -> None:
        self.region = region
        self.service = service
        self._key: tuple[str, str, bytes] = ("", "", b"")  # (secret, day, key)

    def headers(
        self,
        method: str,
        host: str,
        path: str,
        credentials: FrozenCredentials,
        amz_date: str | None = None,
    ) -> dict[str, str]:
        """The signed headers of ``method`` on ``path`` (already URI-encoded) at ``host``;
        ``amz_date`` (``YYYYMMDDTHHMMSSZ``) defaults to now."""
        if amz_date is None:
            amz_date = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
        if credentials.token:
            headers["x-amz-security-token"] = credentials.token
        names = sorted(headers)
        signed = ";".join(names)
        canonical = "\n".join((
            method, path, "", "".join(f"{n}:{headers[n]}\n" for n in names), signed, EMPTY_SHA256
        ))  # fmt: skip
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        to_sign = f"{_ALGORITHM}\n{amz_date}\n{scope}\n{digest}"
        signature = hmac.new(self._signing_key(credentials.secret_key, day), to_sign.encode(),
                             "sha256").hexdigest()  # fmt: skip
        headers["authorization"] = (
            f"{_ALGORITHM} Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )
        del headers["host"]  # aiohttp sends it, from the URL
        return headers

    def _signing_key(self, secret: str, day: str) -> bytes:
        cached_secret, cached_day, key = self._key
        if cached_secret == secret and cached_day == day:
            return key
        key = hmac.digest(f"AWS4{secret}".encode(), day.encode(), "sha256")
        for part in (self.region, self.service, "aws4_request"):
            key = hmac.digest(key, part.encode(), "sha256")
        self._key = (secret, day, key)
        return key


class FastGet:
    """GETs of one bucket at a custom endpoint (see the module docstring)."""

    def __init__(
        self, config: S3Config, credentials: Any, region: str, session: aiohttp.ClientSession
    ) -> None:
        self._credentials = credentials  # botocore's (refreshable or not): frozen per request
        self._signer = Signer(region)
        self._session = session
        self._host = _canonical_host(config.scheme, config.endpoint_override)
        self._base = f"{config.scheme}://{config.endpoint_override}"
        self._bucket = urllib.parse.quote(config.bucket, safe="~")
        self.hooks: list[Hook] = []
        self.answered: list[AnswerHook] = []
        self.sent = 0

    @classmethod
    async def open(
        cls, stack: AsyncExitStack, config: S3Config, credentials: Any, region: str
    ) -> FastGet:
        """A `FastGet` whose aiohttp session (``max_concurrency`` + 1 connections) closes
        with ``stack``."""
        verify: ssl.SSLContext | bool = config.scheme == "https"  # True: the default CAs
        if verify and config.ca_bundle:
            verify = ssl.create_default_context(cafile=config.ca_bundle)
        connector = aiohttp.TCPConnector(limit=config.max_concurrency + 1, ssl=verify)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.timeout_s, sock_read=config.timeout_s
        )
        session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, raise_for_status=False
        )
        stack.push_async_callback(session.close)
        return cls(config, credentials, region, session)

    async def get_into(self, name: str, views: Sequence[memoryview]) -> None:
        """GET object ``name`` into ``views``, one after another; `CorruptBlockError` if its
        length is not theirs, a `ClientError` for an error answer."""
        path = f"/{self._bucket}/{urllib.parse.quote(name, safe='/~')}"
        frozen = await self._credentials.get_frozen_credentials()
        headers = self._signer.headers("GET", self._host, path, frozen)
        answers = [hook("GetObject", headers) for hook in self.hooks]
        injected = next((answer for answer in answers if answer is not None), None)
        if injected is not None:
            raise _client_error(*injected)
        self.sent += 1
        status = 0
        try:
            status = await self._send(path, headers, views)
        except boto_errors.ClientError as exc:
            status = exc.response["ResponseMetadata"]["HTTPStatusCode"]
            raise
        finally:
            for answered in self.answered:
                answered("GetObject", status)

    async def _send(self, path: str, headers: dict[str, str], views: Sequence[memoryview]) -> int:
        url = URL(self._base + path, encoded=True)
        async with self._session.get(url, headers=headers) as response:
            if response.status != 200:
                body = await response.content.read(_ERROR_PEEK)
                match = _ERROR_CODE.search(body)
                code = match.group(1).decode("ascii", "replace") if match else ""
                raise _client_error(response.status, code or str(response.status))
            size, expected = response.content_length, sum(view.nbytes for view in views)
            if size is not None and size != expected:
                raise CorruptBlockError(f"object is {size} bytes, expected {expected}")
            for view in views:
                await read_into(response.content, view)
            if size is None and await response.content.read(1):  # chunked: no length said
                raise CorruptBlockError(f"object is longer than {expected} bytes")
            return response.status


def _canonical_host(scheme: str, host: str) -> str:
    """``host`` as the Host header says it (and SigV4 signs it): without the scheme's default
    port, which aiohttp leaves out."""
    default = {"http": ":80", "https": ":443"}.get(scheme, "")
    return host.removesuffix(default) if default else host


def _client_error(status: int, code: str) -> boto_errors.ClientError:
    """The `ClientError` botocore raises for an error answer ``status`` with ``code``."""
    answer = {
        "Error": {"Code": code, "Message": ""},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return boto_errors.ClientError(answer, "GetObject")
