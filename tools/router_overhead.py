"""What `kvtier fleet router` adds to a request's first token, against a stub engine.

A measurement, not a benchmark: two stub upstreams (aiohttp servers answering
``/v1/completions`` with five small server-sent-event chunks at once) on 127.0.0.1, and the
router in front of them with an empty index (`kvtier_async.fleet.router.Router`, as `kvtier
fleet router` runs it); a client times the first chunk of a 1,024-token prompt sent straight
to a stub and through the router, interleaved in rounds of 100, and prints the medians and
their difference: the router's own time (reading the body, hashing the prompt's blocks,
matching the index, choosing, proxying the stream), without any engine's.

Run with the ``[fleet]`` extra installed (the e2e environment has it)::

    .nox/e2e/bin/python tools/router_overhead.py
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time

from aiohttp import ClientSession, web

from kvtier_async.fleet import BlockHasher, FleetIndex
from kvtier_async.fleet.router import Router

ROUNDS, PER_ROUND, WARMUP = 5, 100, 50
CHUNK = b'data: {"choices":[{"text":"x"}]}\n\n'


async def upstream(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(4):
        await resp.write(CHUNK)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def first_chunks(session: ClientSession, url: str, body: bytes, n: int) -> list[float]:
    """Seconds to the first chunk of ``n`` requests, one after the other."""
    out = []
    for _ in range(n):
        started = time.perf_counter()
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            await r.content.readany()
            out.append(time.perf_counter() - started)
            await r.read()
    return out


async def main() -> None:
    stub = web.Application()
    stub.router.add_post("/v1/completions", upstream)
    ports = {name: free_port() for name in ("a", "b", "router")}
    runners = [await serve(stub, ports["a"]), await serve(stub, ports["b"])]
    engines = {name: f"http://127.0.0.1:{ports[name]}" for name in ("a", "b")}
    router = Router(engines, FleetIndex(list(engines)), BlockHasher(16))
    runners.append(await serve(router.app(), ports["router"]))
    prompt = {"model": "tiny", "prompt": list(range(3, 1027)), "max_tokens": 4, "stream": True}
    body = json.dumps(prompt).encode()
    direct = f"{engines['a']}/v1/completions"
    routed = f"http://127.0.0.1:{ports['router']}/v1/completions"
    straight: list[float] = []
    through: list[float] = []
    try:
        async with ClientSession() as session:
            await first_chunks(session, direct, body, WARMUP)
            await first_chunks(session, routed, body, WARMUP)
            for _ in range(ROUNDS):
                straight += await first_chunks(session, direct, body, PER_ROUND)
                through += await first_chunks(session, routed, body, PER_ROUND)
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
    a, b = statistics.median(straight), statistics.median(through)
    print(
        f"first chunk, p50 of {len(straight)}: straight to a stub {a * 1e3:.2f} ms, "
        f"through the router {b * 1e3:.2f} ms: the router adds {(b - a) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())
