"""A network fault on 127.0.0.1: a TCP proxy that delays every chunk it forwards, or holds
every HTTP PUT (a port that never answers at all is `_s3.SilentServer`).

The proxy runs its own event loop in a thread of its own (a server is not the client's
loop), serving with anyio's TCP listener. `DelayProxy.delay_s` and `DelayProxy.hold_puts`
may change while it runs: the delay applies to the next chunk in either direction; while
``hold_puts`` is set, a client chunk that starts an HTTP PUT is never forwarded and its
connection stays silent (reads pass, writes hang: a stuck write path).
"""

from __future__ import annotations

import contextlib
import functools
from types import TracebackType

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal, start_blocking_portal

HOST = "127.0.0.1"
_CHUNK = 64 << 10


class DelayProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:target``, waiting ``delay_s`` before each chunk."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.delay_s = 0.0
        self.hold_puts = False
        self.held = 0  # PUTs held right now (their client has not given up yet)
        self.port = 0
        self._portal_cm: contextlib.AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._scope: anyio.CancelScope | None = None

    def __enter__(self) -> DelayProxy:
        self._portal_cm = start_blocking_portal()
        portal = self._portal = self._portal_cm.__enter__()
        try:
            listener = portal.call(functools.partial(anyio.create_tcp_listener, local_host=HOST))
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            self._scope = portal.call(anyio.CancelScope)
            portal.start_task_soon(self._serve, listener)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._portal_cm is not None and self._portal is not None
        try:
            self._portal.call(self._cancel)
        finally:
            self._portal_cm.__exit__(exc_type, exc, tb)

    def _cancel(self) -> None:
        assert self._scope is not None
        self._scope.cancel()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def _serve(self, listener: anyio.abc.SocketListener) -> None:
        assert self._scope is not None
        with self._scope:
            async with listener:
                await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            try:
                upstream = await anyio.connect_tcp(HOST, self.target)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as tg:
                tg.start_soon(self._pipe, client, upstream, tg.cancel_scope, True)
                tg.start_soon(self._pipe, upstream, client, tg.cancel_scope, False)

    async def _pipe(
        self,
        src: anyio.abc.SocketStream,
        dst: anyio.abc.SocketStream,
        scope: anyio.CancelScope,
        requests: bool,
    ) -> None:
        try:
            while True:
                chunk = await src.receive(_CHUNK)
                if requests and self.hold_puts and chunk.startswith(b"PUT "):
                    self.held += 1
                    try:
                        await anyio.sleep_forever()
                    finally:
                        self.held -= 1
                if self.delay_s:
                    await anyio.sleep(self.delay_s)
                await dst.send(chunk)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            scope.cancel()
