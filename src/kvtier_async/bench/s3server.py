"""A moto S3 server on 127.0.0.1 for benchmarks and tests (``moto[server]``: the ``bench`` extra).

``kvtier bench s3`` measures the obj tier against it, so it ships with the benchmarks; the
test suite and the fault suite (``tests/faults``) start theirs from here too. The engine never
imports it.

`MotoS3Server` serves moto's S3 (and IAM, for access tests) over real HTTP on a loopback port:

- in this process (default): a thread, started in milliseconds, stoppable and restartable on
  the same port; moto's state lives in the process, so it survives a restart;
- in a child process (``in_process=False``): its own interpreter and CPU, so in benchmarks
  the server does not compete with the client for the GIL.

`stop` closes the listening socket, so new connections are refused (moto's own
``ThreadedMotoServer.stop`` leaves it bound: connections would hang in the backlog instead).
`pause` (a child process only) stops it with SIGSTOP: connections are accepted by the kernel
and never answered, a hung endpoint; `resume` sends SIGCONT.
Control requests (`create_bucket`, `reset`, `set_auth`) use moto's HTTP API with the standard
library, so they work in both modes. Any credentials are accepted until `set_auth` turns on
moto's IAM checks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from types import TracebackType
from typing import Any, Final

__all__ = ["MotoS3Server", "free_port", "wait_for_port"]

HOST: Final = "127.0.0.1"
ACCESS_KEY: Final = "testing"
SECRET_KEY: Final = "testing"
REGION: Final = "us-east-1"
_START_TIMEOUT_S: Final = 30.0


class MotoS3Server:
    """moto's S3 server on ``127.0.0.1:port`` (``port=0``: a free one, kept across restarts)."""

    access_key: Final = ACCESS_KEY
    secret_key: Final = SECRET_KEY
    region: Final = REGION

    def __init__(self, port: int = 0, *, in_process: bool = True) -> None:
        self._port = port
        self._in_process = in_process
        self._thread_server: Any = None  # moto.server.ThreadedMotoServer
        self._process: subprocess.Popen[bytes] | None = None

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> MotoS3Server:
        """Start serving; returns self. Raises `RuntimeError` if it is running already."""
        if self.running:
            raise RuntimeError(f"{self!r} is running already")
        if self._in_process:
            self._start_thread()
        else:
            self._start_process()
        return self

    def stop(self) -> None:
        """Stop serving and close the port; idempotent."""
        if self._thread_server is not None:
            server, self._thread_server = self._thread_server, None
            server.stop()
            with contextlib.suppress(AttributeError, OSError):
                server._server.server_close()  # moto leaves the listening socket open
        if self._process is not None:
            process, self._process = self._process, None
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)  # a paused child cannot end otherwise
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def pause(self) -> None:
        """Stop the child process with SIGSTOP: it accepts connections and answers nothing."""
        os.kill(self._child().pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused child process run again (SIGCONT); harmless when it is not paused."""
        os.kill(self._child().pid, signal.SIGCONT)

    def _child(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError(f"{self!r}: only a running child process can pause")
        return self._process

    def restart(self) -> None:
        """Stop, then serve again on the same port."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._thread_server is not None or self._process is not None

    def __enter__(self) -> MotoS3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        mode = "thread" if self._in_process else "process"
        state = "running" if self.running else "stopped"
        return f"<MotoS3Server {self.endpoint} {mode} {state}>"

    # -- addresses ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port (0 until the first start when it was asked to pick one)."""
        return self._port

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self._port}"

    def tier_config(self, bucket: str, **extra: Any) -> dict[str, Any]:
        """An obj tier config for ``bucket`` on this server, plus ``extra`` fields."""
        config = {
            "type": "obj",
            "bucket": bucket,
            "endpoint_override": self.endpoint,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "region": self.region,
        }
        return {**config, **extra}

    # -- control ------------------------------------------------------------------------------

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (an unsigned request: do it before `set_auth`)."""
        self._request("PUT", f"/{name}")

    def reset(self) -> None:
        """Forget every bucket, object, IAM user and key."""
        self._request("POST", "/moto-api/reset")

    def set_auth(self, enabled: bool) -> None:
        """Turn moto's IAM authentication and authorisation on or off (off at start).

        The switch is global to the moto instance (in-process: to every in-process server).
        """
        self._request("POST", "/moto-api/reset-auth", b"0" if enabled else b"inf")

    def _request(self, method: str, path: str, data: bytes | None = None) -> None:
        headers = {"Content-Type": "text/plain"}
        request = urllib.request.Request(self.endpoint + path, data, headers, method=method)
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    # -- starting -----------------------------------------------------------------------------

    def _start_thread(self) -> None:
        from moto.server import ThreadedMotoServer

        # werkzeug logs every request at INFO through a handler of its own; keep it quiet.
        werkzeug = logging.getLogger("werkzeug")
        if werkzeug.level == logging.NOTSET:
            werkzeug.setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address=HOST, port=self._port, verbose=False)
        server.start()
        self._port = server.get_host_and_port()[1]
        self._thread_server = server

    def _start_process(self) -> None:
        if self._port == 0:
            self._port = free_port()
        command = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self._port)]
        self._process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_for_port(self._port, self._process)
        except BaseException:
            self.stop()
            raise


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str = "moto server") -> None:
    """Wait until the child ``what`` accepts connections (it has no readiness signal of its
    own); `RuntimeError` if it exits, `TimeoutError` after 30 s."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not listen on port {port}") from None
            time.sleep(0.05)
