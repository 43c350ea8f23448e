"""The feed over real ZMQ sockets: a publisher speaking vLLM's wire format (vLLM's own
``ZmqEventPublisher`` runs in ``tests/e2e/test_fleet.py``), the index's SUB socket, the
replay socket; then the index's and the router's HTTP faces, with engines stood in for by
small HTTP servers (a real engine: the e2e fleet tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
aiohttp = pytest.importorskip("aiohttp")

from aiohttp import web  # noqa: E402

from kvtier_async.fleet import BlockHasher, FleetIndex  # noqa: E402
from kvtier_async.fleet.feed import Feed  # noqa: E402
from kvtier_async.fleet.router import Router  # noqa: E402
from kvtier_async.fleet.service import index_app, parse_engines  # noqa: E402
from kvtier_async.fleet.wire import Batch, BlockRemoved, BlockStored, encode_batch  # noqa: E402

HASHER = BlockHasher(4)
TOKENS = list(range(64))
HASHES = HASHER.hashes(TOKENS)
DEADLINE_S = 30.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # pyzmq's asyncio sockets, aiohttp


class Publisher:
    """vLLM's ZmqEventPublisher's protocol: PUB connects to the index's socket and sends
    (topic, 8-byte seq, payload); a ROUTER serves replays from a buffer of past batches."""

    def __init__(self, topic: str, endpoint: str, *, replay: bool = True) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.connect(endpoint)
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=100)
        self.router = None
        self.replay_endpoint = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            port = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def send(self, batch: Batch, *, live: bool = True) -> int:
        """Buffer the next batch, and send it (unless ``live`` is false: lost on the way)."""
        seq, self.seq = self.seq, self.seq + 1
        payload = encode_batch(batch)
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def raw(self, *frames: bytes) -> None:
        self.pub.send_multipart(list(frames))

    def serve_replays(self) -> None:
        """Answer the replay requests waiting (as vLLM's publisher thread does)."""
        assert self.router is not None
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    self.router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.term()


async def until(condition: Callable[[], bool], tick: Callable[[], None] | None = None) -> None:
    """Wait for ``condition`` (polled, with a deadline: the other side is a socket)."""
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            if tick is not None:
                tick()
            await asyncio.sleep(0.01)


def stored(n: int, medium: str = "GPU") -> Batch:
    return Batch(0.0, [BlockStored(HASHES[:n], medium=medium)])


async def connected(feed: Feed, pub: Publisher) -> None:
    """Send seq 0 until the index has it (a PUB drops what it sends before it is connected;
    a repeat read as a restart re-applies the same batch)."""
    payload = encode_batch(stored(1))
    pub.buffer.append((0, payload))
    pub.seq = 1
    name = pub.topic.decode()

    def resend() -> None:
        pub.pub.send_multipart([pub.topic, (0).to_bytes(8, "big"), payload])

    await until(lambda: _stats(feed, name).batches >= 1, resend)


async def joined(feed: Feed, pub: Publisher) -> None:
    """Send a batch of an engine the index does not know until the index counts one: then
    ``pub`` is connected (a PUB drops what it sends before), and nothing of its own was sent."""
    seen = feed.index.unknown_batches
    frames = [b"probe", (0).to_bytes(8, "big"), encode_batch(Batch(0.0, []))]
    await until(lambda: feed.index.unknown_batches > seen, lambda: pub.raw(*frames))


def _stats(feed: Feed, name: str) -> Any:
    return next(s for s in feed.index.stats() if s.name == name)


@pytest.mark.anyio
async def test_live_batches_unknown_engines_and_malformed_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = FleetIndex(["a"])
    feed = Feed(index, "tcp://127.0.0.1:0")
    where = feed.open()
    task = asyncio.get_running_loop().create_task(feed.run())
    a, stranger = Publisher("a", where, replay=False), Publisher("zz", where, replay=False)
    try:
        await connected(feed, a)
        a.send(stored(4))
        await until(lambda: index.match(HASHER.keys(TOKENS)).gpu["a"] == 4)
        with caplog.at_level(logging.WARNING, logger="kvtier_async"):
            for _ in range(200):  # until one got through the slow joiner
                stranger.raw(b"zz", (0).to_bytes(8, "big"), encode_batch(stored(8)))
                if index.unknown_batches:
                    break
                await asyncio.sleep(0.01)
            await until(lambda: index.unknown_batches >= 1)
            a.raw(b"a", (2).to_bytes(8, "big"), b"\xc1 not msgpack")
            await until(lambda: _stats(feed, "a").malformed == 1)
        assert feed.unknown_engines.get("zz", 0) >= 1
        assert index.match(HASHER.keys(TOKENS)).gpu["a"] == 0  # resynced: nothing claimed
        text = caplog.text
        assert "unknown engine" in text and "engine='zz'" in text
        assert "malformed" in text and "engine='a'" in text
        a.seq = 3
        a.send(stored(2))  # the sequence goes on after the malformed batch
        await until(lambda: index.match(HASHER.keys(TOKENS)).gpu["a"] == 2)
    finally:
        task.cancel()
        a.close()
        stranger.close()


@pytest.mark.anyio
async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    index = FleetIndex(["a"])
    feed = Feed(index, "tcp://127.0.0.1:0")
    where = feed.open()
    a = Publisher("a", where)
    feed.replay = {"a": str(a.replay_endpoint)}
    task = asyncio.get_running_loop().create_task(feed.run())
    try:
        await connected(feed, a)
        a.send(stored(2), live=False)  # 1: lost on the way
        a.send(stored(3, "CPU"), live=False)  # 2: lost
        a.send(stored(5))  # 3: arrives, opens a replay from 1
        await until(lambda: _stats(feed, "a").next_seq == 4 and not feed._replays, a.serve_replays)
        st = _stats(feed, "a")
        # 1, 2 and 3 came from the replay (its buffer holds 3 too); the live 3 was dropped.
        assert (st.gaps, st.resyncs, st.replayed) == (1, 0, 3)
        m = index.match(HASHER.keys(TOKENS))
        assert (m.gpu["a"], m.cpu["a"]) == (5, 3)
    finally:
        task.cancel()
        a.close()


@pytest.mark.anyio
async def test_an_index_started_late_replays_and_a_dead_replay_socket_resyncs() -> None:
    index = FleetIndex(["a", "b"])
    feed = Feed(index, "tcp://127.0.0.1:0", replay_timeout_s=0.5)
    where = feed.open()
    a, b = Publisher("a", where), Publisher("b", where)
    feed.replay = {"a": str(a.replay_endpoint), "b": "tcp://127.0.0.1:9"}  # b: nobody there
    for pub in (a, b):
        pub.send(stored(6), live=False)  # before the index listened
        pub.send(stored(6, "CPU"), live=False)
    task = asyncio.get_running_loop().create_task(feed.run())
    try:
        for pub in (a, b):
            await joined(feed, pub)  # then batch 2 is sent once: a PUB never sends one twice
            pub.pub.send_multipart(
                [pub.topic, (2).to_bytes(8, "big"), encode_batch(Batch(0.0, []))]
            )

        def settled() -> bool:
            return not feed._replays and all(
                _stats(feed, name).next_seq == 3 for name in ("a", "b")
            )

        await until(settled, a.serve_replays)
        m = index.match(HASHER.keys(TOKENS))
        assert (m.gpu["a"], m.cpu["a"], _stats(feed, "a").resyncs) == (6, 6, 0)
        assert (m.gpu["b"], m.cpu["b"], _stats(feed, "b").resyncs) == (0, 0, 1)
    finally:
        task.cancel()
        a.close()
        b.close()


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.anyio
async def test_the_index_answers_match_over_http_and_names_bad_fields() -> None:
    index = FleetIndex(["a"])
    index.receive("a", 0, stored(3))
    runner, url = await _serve(index_app(index, HASHER))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/match", json={"token_ids": TOKENS}) as resp:
                assert resp.status == 200
                body = await resp.json()
            assert (body["blocks"], body["gpu"], body["block_size"]) == (16, {"a": 12}, 4)
            hexes = [h.hex() for h in HASHES]
            async with http.post(f"{url}/match", json={"block_hashes": hexes}) as resp:
                assert (await resp.json())["gpu"] == {"a": 12}
            for bad, field in (
                ({"token_ids": [1, "x"]}, "token_ids"),
                ({}, "exactly one"),
                ({"block_hashes": ["zz"]}, "block_hashes"),
            ):
                async with http.post(f"{url}/match", json=bad) as resp:
                    assert resp.status == 400 and field in (await resp.json())["error"]
            async with http.get(f"{url}/engines") as resp:
                assert (await resp.json())["engines"][0]["gpu_blocks"] == 3
    finally:
        await runner.cleanup()


def _fake_engine(name: str, seen: list[tuple[str, Any]]) -> web.Application:
    """What the router needs of an engine: /v1/completions streamed, /tokenize, /health."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((name, body["prompt"]))
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps({'engine': name})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    async def tokenize(request: web.Request) -> web.Response:
        text = (await request.json())["prompt"]
        return web.json_response({"tokens": [int(w) for w in text.split()]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    return app


@pytest.mark.anyio
async def test_the_router_sends_a_prompt_where_its_prefix_is_and_survives_a_dead_engine() -> None:
    seen: list[tuple[str, Any]] = []
    engines = {}
    runners = []
    for name in ("a", "b"):
        runner, url = await _serve(_fake_engine(name, seen))
        runners.append(runner)
        engines[name] = url
    index = FleetIndex(["a", "b"])
    index.receive("b", 0, stored(8, "CPU"))  # b holds the prompt's first 8 blocks
    router = Router(engines, index, HASHER, probe_interval_s=0.05)
    proxy, url = await _serve(router.app())
    try:
        async with aiohttp.ClientSession() as http:

            async def complete(prompt: Any) -> tuple[str, str, str]:
                body = {"model": "m", "prompt": prompt, "stream": True}
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    text = await resp.text()
                    return resp.headers["x-kvtier-engine"], resp.headers["x-kvtier-route"], text

            engine, why, text = await complete(TOKENS)
            assert (engine, why) == ("b", "local") and '"engine": "b"' in text
            engine, why, _ = await complete(" ".join(map(str, TOKENS)))  # via /tokenize
            assert (engine, why) == ("b", "local")
            # The shared tier holds more than b's CPU: b, idle, still costs least (it loads
            # fewer blocks); with prefill queued on b, a loads it all from the shared tier.
            index.receive(
                "a", 0, Batch(0.0, [BlockStored(HASHES, medium="STORAGE", ownership="fs")])
            )
            router.upstreams["b"].claimed.clear()  # (b's claims from the calls above)
            assert router.upstreams["b"].pending == 0  # (what the calls above added is gone)
            engine, why, _ = await complete(TOKENS)
            assert (engine, why) == ("b", "shared")
            router.upstreams["b"].claimed.clear()
            router.upstreams["b"].pending = 3.0  # three blocks of prefill queued on b
            engine, why, _ = await complete(TOKENS)
            assert (engine, why) == ("a", "shared")
            router.upstreams["b"].pending = 0.0
            # A new prompt, twice, before any event: the second goes where the first went
            # (the router's claim), not to the other, idler engine.
            fresh = list(range(1000, 1064))
            first, why, _ = await complete(fresh)
            assert why == "least-loaded"
            again, why, _ = await complete(fresh)
            assert (again, why) == (first, "local")
            for upstream in router.upstreams.values():
                upstream.claimed.clear()
            # The shared tier's copy is deleted; b dies. The router picks b (its CPU tier
            # holds the prefix), finds it refusing, forgets it, and a serves.
            index.receive(
                "a", 1, Batch(0.0, [BlockRemoved(HASHES, medium="STORAGE", ownership="fs")])
            )
            await runners[1].cleanup()
            engine, why, _ = await complete(TOKENS)
            assert (engine, why) == ("a", "least-loaded")
            assert router.upstreams["b"].up is False
            assert index.match(HASHER.keys(TOKENS)).cpu["b"] == 0
            # Both gone: 503, said plainly.
            await runners[0].cleanup()
            async with http.post(f"{url}/v1/completions", json={"prompt": TOKENS}) as resp:
                assert resp.status in (502, 503)
                assert "engine" in (await resp.json())["error"]
    finally:
        await proxy.cleanup()
        for runner in runners:
            await runner.cleanup()


def test_engine_specs_are_checked() -> None:
    assert parse_engines(["a,url=http://x:1,replay=tcp://x:2"], need_url=True) == {
        "a": {"url": "http://x:1", "replay": "tcp://x:2"}
    }
    for specs, message in (
        (["a,port=1"], "allowed are url=URL"),
        (["a", "a"], "given twice"),
        ([], "at least one engine"),
        (["url=x"], "must start with"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_engines(specs, need_url=False)
    with pytest.raises(ValueError, match="the router needs url="):
        parse_engines(["a"], need_url=True)
