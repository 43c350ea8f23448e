"""Helpers for the obj (S3) tier tests: blocks, keys, clients, a fake clock, fault injection.

Page-aligned blocks, a fake clock for the circuit breaker, botocore event hooks that inject
error answers and count requests, and `SilentServer`, a hung S3 peer. Tiers are opened in test
bodies (`opened`), not across a fixture's ``yield``.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import random
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aioboto3
from aiobotocore.awsrequest import AioAWSResponse

from kvtier_async.bench.s3server import MotoS3Server
from kvtier_async.ledger import make_offload_key
from kvtier_async.tiers.base import SecondaryTier


def make_blocks(count: int, size: int, *, seed: int = 0) -> list[memoryview]:
    """``count`` page-aligned blocks of ``size`` random bytes, each in its own mapping row."""
    row = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = memoryview(mmap.mmap(-1, count * row))
    blocks = [mapping[i * row : i * row + size] for i in range(count)]
    rng = random.Random(seed)
    for block in blocks:
        block[:] = rng.randbytes(size)
    return blocks


def make_keys(count: int, *, group: int = 0) -> list[bytes]:
    return [make_offload_key(os.urandom(32), group) for _ in range(count)]


@asynccontextmanager
async def opened(tier: SecondaryTier) -> AsyncIterator[SecondaryTier]:
    """``tier``, opened, and closed at the end."""
    await tier.open()
    try:
        yield tier
    finally:
        await tier.aclose()


@asynccontextmanager
async def raw_client(server: MotoS3Server, service: str = "s3") -> AsyncIterator[Any]:
    """A plain aiobotocore client on ``server``, outside any tier."""
    session = aioboto3.Session(
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
    )
    async with session.client(service, endpoint_url=server.endpoint) as client:
        yield client


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def read(self) -> bytes:
        return self._data


def error_response(request: Any, status: int, code: str) -> AioAWSResponse:
    """An S3 error answer, as if the server had sent it."""
    xml = f"<Error><Code>{code}</Code><Message>injected {code}</Message></Error>"
    headers = {"content-type": "application/xml"}
    return AioAWSResponse(request.url, status, headers, _Body(xml.encode()))


@dataclass(eq=False)
class Injector:
    """Answers the next ``count`` matching requests with ``status``/``code`` instead of
    sending them; counts what it saw."""

    status: int
    code: str
    count: int
    only_conditional: bool = False
    injected: int = 0
    seen: int = 0

    def __call__(self, request: Any, **_: Any) -> AioAWSResponse | None:
        if self._answer(request.headers) is None:
            return None
        return error_response(request, self.status, self.code)

    def fast(self, operation: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """The same, as a `FastGet` hook."""
        return self._answer(headers)

    def _answer(self, headers: Any) -> tuple[int, str] | None:
        if self.only_conditional and "If-None-Match" not in headers:
            return None
        self.seen += 1
        if self.injected >= self.count:
            return None
        self.injected += 1
        return self.status, self.code


def inject(tier: Any, operation: str, hook: Any) -> None:
    """Register ``hook`` (an `Injector` or a botocore ``before-send`` handler with a ``fast``
    method) for ``operation`` on an open `S3Tier`, on botocore and, for GETs, on its
    `FastGet` too."""
    tier.client.meta.events.register(f"before-send.s3.{operation}", hook)
    if operation == "GetObject" and tier.fast_get is not None:
        tier.fast_get.hooks.append(hook.fast)


@dataclass(eq=False)
class RequestLog:
    """Counts requests per operation (``before-send``) and answers (``after-call``)."""

    sent: dict[str, int] = field(default_factory=dict)
    statuses: list[tuple[str, int]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0

    def attach(self, tier: Any) -> RequestLog:
        """Count an open `S3Tier`'s requests: botocore's and its `FastGet`'s."""
        client = tier.client
        client.meta.events.register("before-send.s3", self._before_send)
        client.meta.events.register("after-call.s3", self._after_call)
        client.meta.events.register("after-call-error.s3", self._after_error)
        if tier.fast_get is not None:
            tier.fast_get.hooks.append(self._fast_send)
            tier.fast_get.answered.append(self._fast_answer)
        return self

    def _count(self, operation: str) -> None:
        self.sent[operation] = self.sent.get(operation, 0) + 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def _fast_send(self, operation: str, headers: dict[str, str]) -> None:
        self._count(operation)

    def _fast_answer(self, operation: str, status: int) -> None:
        self.in_flight -= 1
        if status:
            self.statuses.append((operation, status))

    def _before_send(self, request: Any, **kwargs: Any) -> None:
        self._count(kwargs["event_name"].rsplit(".", 1)[-1])

    def _after_call(self, http_response: Any, model: Any, **_: Any) -> None:
        self.in_flight -= 1
        self.statuses.append((model.name, http_response.status_code))

    def _after_error(self, **_: Any) -> None:
        self.in_flight -= 1

    @property
    def total(self) -> int:
        return sum(self.sent.values())


class SilentServer:
    """A hung peer: a small asyncio TCP server on 127.0.0.1, in a thread of its own, that
    accepts every connection, reads everything sent and never answers.

    ``port=0`` picks a free port; a given one is taken over (SO_REUSEADDR), e.g. a stopped
    moto server's, so that a tier opened there finds it hung. `received` is every byte read.
    """

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.connections = 0
        self._chunks: list[bytes] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="silent-server", daemon=True)

    @property
    def received(self) -> bytes:
        return b"".join(self._chunks)

    def __enter__(self) -> SilentServer:
        self._thread.start()
        if not self._ready.wait(timeout=10) or self._error is not None:
            raise RuntimeError(f"silent server did not start: {self._error!r}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by __enter__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        writers: list[asyncio.StreamWriter] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writers.append(writer)
            while chunk := await reader.read(1 << 16):
                self._chunks.append(chunk)

        server = await asyncio.start_server(silent, "127.0.0.1", self.port, reuse_address=True)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            for writer in writers:
                writer.close()
            # Closed before the loop ends, or a transport collected later warns of a closed
            # loop in whichever test runs then.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await asyncio.gather(
                        *(writer.wait_closed() for writer in writers), return_exceptions=True
                    )
