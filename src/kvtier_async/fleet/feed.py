"""The index's ears: one ZMQ SUB socket every engine's KV-event publisher connects to.

Each engine runs vLLM's ``ZmqEventPublisher`` with ``--kv-events-config``'s ``endpoint`` set
to this socket's address (a ``tcp://host:port`` without ``*`` makes vLLM connect instead of
bind), its ``topic`` set to the engine's name, and, for gaps to be filled, a
``replay_endpoint`` of its own that `Feed` is told about. `Feed.run` receives batches, hands
them to the `FleetIndex`, and when the index asks for a replay asks that engine's replay
socket (a DEALER to its ROUTER) from the missing sequence on, with a deadline; a replay that
fails or runs out of time resyncs the engine (`FleetIndex.replay_done`).

What an engine sends that is wrong (not three frames, a sequence that is not 8 bytes, a
payload that is not a batch of KV events, a topic that names no configured engine) is logged
(rate-limited, with the engine and the reason) and counted, never applied.

asyncio only (pyzmq's ``zmq.asyncio``): the fleet's services are applications, not the
engine, and run on asyncio.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Final

from kvtier_async._log import RateLimited, get_logger

from .index import FleetIndex, Receipt
from .wire import END_SEQ, MalformedBatch, decode_batch, decode_seq

__all__ = ["Feed"]

log = get_logger(__name__)
DEFAULT_REPLAY_TIMEOUT_S: Final = 5.0


class Feed:
    """Binds ``listen`` (``tcp://127.0.0.1:5557``) and feeds ``index`` until cancelled.

    ``replay`` maps an engine's name to its publisher's ``replay_endpoint``; an engine
    without one is resynced at a gap instead of replayed.
    """

    def __init__(
        self,
        index: FleetIndex,
        listen: str,
        *,
        replay: Mapping[str, str] | None = None,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
    ) -> None:
        unknown = set(replay or ()) - set(index.engines)
        if unknown:
            raise ValueError(f"replay: names no configured engine: {sorted(unknown)}")
        self.index = index
        self.listen = listen
        self.replay = dict(replay or {})
        self.replay_timeout_s = replay_timeout_s
        self.bound: str | None = None  # the address bound, once running
        self.unknown_engines: dict[str, int] = {}
        self._warn = RateLimited(log)
        self._replays: dict[str, Any] = {}  # engine -> its replay's task
        self._socket: Any = None
        self._context: Any = None

    def open(self) -> str:
        """Bind the SUB socket now (before the engines start: a publisher that connects to
        nothing drops its batches); returns the address bound (a port 0 is resolved)."""
        import zmq
        import zmq.asyncio

        if self._socket is not None:
            return str(self.bound)
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.RCVHWM, 100_000)
        try:
            socket.bind(self.listen)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            self._context.term()
            self._context = None
            raise OSError(f"events: cannot bind {self.listen}: {exc}") from None
        self._socket = socket
        self.bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.bound

    def close(self) -> None:
        for task in list(self._replays.values()):
            task.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def run(self) -> None:
        """Receive and apply batches until cancelled (then close the sockets)."""
        import asyncio

        self.open()
        try:
            while True:
                frames = await self._socket.recv_multipart()
                engine = self._receive(frames)
                if engine is not None and engine not in self._replays:
                    task = asyncio.get_running_loop().create_task(self._replay(engine))
                    self._replays[engine] = task
                    task.add_done_callback(functools.partial(self._replay_ended, engine))
        finally:
            self.close()

    def _replay_ended(self, engine: str, _task: Any) -> None:
        self._replays.pop(engine, None)

    def _receive(self, frames: list[bytes]) -> str | None:
        """Apply one message; the engine's name if a replay must start."""
        if len(frames) != 3:
            self._warn("fleet event message dropped", reason=f"{len(frames)} frames, not 3")
            self.index.unknown_batches += 1
            return None
        topic, seq_frame, payload = frames
        engine = topic.decode("utf-8", "replace")
        if engine not in self.index.engines:
            self.unknown_engines[engine] = self.unknown_engines.get(engine, 0) + 1
            self.index.unknown_batches += 1
            self._warn(
                "fleet events from an unknown engine dropped",
                engine=engine,
                known=list(self.index.engines),
            )
            return None
        seq: int | None = None
        try:
            seq = decode_seq(seq_frame)
            batch = decode_batch(payload)
        except MalformedBatch as exc:
            self.index.malformed(engine, seq)
            self._warn("fleet events malformed, engine resynced", engine=engine, reason=str(exc))
            return None
        receipt = self.index.receive(engine, seq, batch)
        if receipt is Receipt.RESTARTED:
            log.info("fleet engine restarted: its blocks forgotten", engine=engine)
        elif receipt is Receipt.REPLAY:
            return engine
        return None

    async def _replay(self, engine: str) -> None:
        """Ask ``engine``'s replay socket for what the index misses; then close the gap."""
        import zmq

        start = self.index.replay_from(engine)
        endpoint = self.replay.get(engine)
        if start is None:
            return
        got = 0
        if endpoint is not None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.connect(endpoint)
                await socket.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
                got = await self._read_replay(socket, engine)
            except TimeoutError:
                self._warn(
                    "fleet replay timed out, engine resynced",
                    engine=engine,
                    endpoint=endpoint,
                    timeout_s=self.replay_timeout_s,
                )
            except (MalformedBatch, zmq.ZMQError) as exc:
                self._warn("fleet replay failed, engine resynced", engine=engine, reason=str(exc))
            finally:
                socket.close(linger=0)
        closed = self.index.replay_done(engine)
        log.info("fleet replay", engine=engine, start=start, batches=got, gap_closed=closed)

    async def _read_replay(self, socket: Any, engine: str) -> int:
        import asyncio

        got = 0
        async with asyncio.timeout(self.replay_timeout_s):
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 4:
                    raise MalformedBatch(f"replay message of {len(frames)} frames, not 4")
                _empty, _topic, seq_frame, payload = frames
                seq = decode_seq(seq_frame)
                if seq == END_SEQ:
                    return got
                self.index.replayed(engine, seq, decode_batch(payload))
                got += 1
