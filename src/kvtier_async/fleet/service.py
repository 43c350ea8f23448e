"""The fleet's services as processes: ``kvtier fleet index`` and ``kvtier fleet router``.

`index_app` is the index's HTTP face, for a router of any kind to call:

- ``POST /match`` with ``{"token_ids": [...]}`` (hashed as vLLM hashes them: the fleet's
  block size and seed) or ``{"block_hashes": ["<hex>", ...]}`` (vLLM's own hashes, head to
  tail) answers ``{"blocks": n, "block_size": b, "gpu": {engine: tokens}, "cpu": {engine:
  tokens}, "storage": {tier: tokens}}``: the longest cached prefix, in tokens, per engine
  and medium, and per shared tier;
- ``GET /engines``: each engine's sequence, block counts and what went wrong (gaps, replays,
  resyncs, restarts, malformed batches), and the batches of unknown engines;
- ``GET /health``.

Bad input is a 400 naming the field and what is allowed. `serve` runs the feed and an app
until SIGINT or SIGTERM, then stops within a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Mapping
from typing import Any

from kvtier_async._log import get_logger

from .feed import Feed
from .hashing import BlockHasher
from .index import FleetIndex
from .query import match_json

__all__ = ["index_app", "parse_engines", "run_index", "run_router", "serve"]

log = get_logger(__name__)


def index_app(index: FleetIndex, hasher: BlockHasher, feed: Feed | None = None) -> Any:
    from aiohttp import web

    async def match(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body: must be JSON"}, status=400)
        try:
            return web.json_response(match_json(index, hasher, body))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)

    async def engines(request: web.Request) -> web.Response:
        unknown = dict(feed.unknown_engines) if feed is not None else {}
        return web.json_response(
            {
                "engines": [s._asdict() for s in index.stats()],
                "storage_blocks": index.storage_blocks(),
                "unknown_batches": index.unknown_batches,
                "unknown_engines": unknown,
            }
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/match", match)
    app.router.add_get("/engines", engines)
    app.router.add_get("/health", health)
    return app


async def serve(
    feed: Feed, app: Any, host: str, port: int, ready: Callable[[str], None] | None = None
) -> None:
    """Run ``feed`` and ``app`` on ``host:port`` until SIGINT/SIGTERM (or cancellation)."""
    from aiohttp import web

    runner = web.AppRunner(app, shutdown_timeout=5.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    bound = feed.open()
    listening = task = None
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        listening = site.name
        task = loop.create_task(feed.run())
        log.info("fleet service up", http=listening, events=bound, engines=list(feed.index.engines))
        if ready is not None:
            ready(f"http={listening} events={bound}")
        waiter = loop.create_task(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # the feed failed: say why
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(runner.cleanup(), timeout=10.0)
        feed.close()


def parse_engines(specs: list[str], *, need_url: bool) -> dict[str, dict[str, str]]:
    """``NAME[,url=http://...][,replay=tcp://...]`` each -> {name: {"url":..., "replay":...}}."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, *fields = spec.split(",")
        if not name or "=" in name:
            raise ValueError(
                f"--engine {spec!r}: must start with the engine's name (its KV events topic)"
            )
        if name in out:
            raise ValueError(f"--engine {spec!r}: {name!r} given twice")
        entry: dict[str, str] = {}
        for item in fields:
            key, sep, value = item.partition("=")
            if not sep or key not in ("url", "replay") or not value:
                raise ValueError(
                    f"--engine {spec!r}: {item!r}: allowed are url=URL and replay=tcp://HOST:PORT"
                )
            entry[key] = value
        if need_url and "url" not in entry:
            raise ValueError(f"--engine {spec!r}: the router needs url=http://HOST:PORT")
        out[name] = entry
    if not out:
        raise ValueError("--engine: at least one engine is needed")
    return out


def replays(engines: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    return {name: e["replay"] for name, e in engines.items() if "replay" in e}


def run_index(
    *,
    events: str,
    engines: list[str],
    host: str,
    port: int,
    block_size: int,
    offload_factor: int,
    max_blocks: int,
    seed: str | None,
    ready: Callable[[str], None] | None = None,
) -> None:
    """``kvtier fleet index``: the feed and the index's HTTP face, until SIGINT/SIGTERM."""
    specs = parse_engines(engines, need_url=False)
    hasher = BlockHasher(block_size, seed=seed)
    index = FleetIndex(specs, offload_factor=offload_factor, max_blocks=max_blocks)
    feed = Feed(index, events, replay=replays(specs))
    asyncio.run(serve(feed, index_app(index, hasher, feed), host, port, ready))


def run_router(
    *,
    events: str,
    engines: list[str],
    host: str,
    port: int,
    block_size: int,
    offload_factor: int,
    max_blocks: int,
    seed: str | None,
    max_imbalance: int,
    ready: Callable[[str], None] | None = None,
) -> None:
    """``kvtier fleet router``: the feed, the index and the router in one process (its
    ``/fleet/engines`` shows the index), until SIGINT/SIGTERM."""
    from .router import Router

    specs = parse_engines(engines, need_url=True)
    hasher = BlockHasher(block_size, seed=seed)
    index = FleetIndex(specs, offload_factor=offload_factor, max_blocks=max_blocks)
    feed = Feed(index, events, replay=replays(specs))
    router = Router(
        {n: e["url"] for n, e in specs.items()}, index, hasher, max_imbalance=max_imbalance
    )
    asyncio.run(serve(feed, router.app(), host, port, ready))
