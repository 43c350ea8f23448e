"""The reference router: an async HTTP proxy in front of a fleet's engines, routed by the index.

A request to ``/v1/completions`` (a text prompt, or token ids) goes to the engine where it
costs least to start: each engine's cost is the prefill work already queued there (blocks of
prompts routed to it whose first token has not come back) plus this prompt's blocks it would
compute (those past the longest prefix it holds on its GPU, in its CPU tier, or can load from
a shared tier), a block loaded from a shared tier counting `SHARED_LOAD_COST` of a computed
one. So a prompt goes where its prefix is while that engine is not behind, and to an idler
engine that loads the prefix from the shared tier when it is; an engine with more than
``max_imbalance`` requests in flight above the least loaded one gets none. A prompt routed
to an engine counts as held there for ``CLAIM_S`` seconds, before its KV events arrive, so a
burst of prompts with one new prefix goes to one engine instead of computing it on each. The answer
streams back as the engine sends it; ``x-kvtier-engine`` names the engine and
``x-kvtier-route`` why (``local``, ``shared``, ``least-loaded``). A text prompt is turned into
token ids by an engine's ``/tokenize`` (every engine of a fleet has the same tokenizer).
Other paths (``/v1/models``, ``/v1/chat/completions``, ...) go to the least loaded engine.

An engine that refuses a connection is marked down, forgotten by the index, and the request
goes to the next engine; a probe of its ``/health`` every ``probe_interval_s`` brings it back.
With no engine up the router answers 503. This is the project's reference implementation of
routing on the index, for measuring it (``kvtier bench fleet``) and as a model for a router's
own hook; it is not a hardened gateway (no TLS, no auth: bind it to a private address).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvtier_async._log import RateLimited, get_logger

from .hashing import BlockHasher
from .index import FleetIndex, Match
from .query import match_json

__all__ = ["Router"]

log = get_logger(__name__)
DEFAULT_MAX_IMBALANCE: Final = 4
# A block loaded from a shared tier, in computed blocks: on vLLM's CPU build a 2k-token prefix
# from the fs tier costs 6% of recomputing it, from a local S3 server about 20% (README).
SHARED_LOAD_COST: Final = 0.2
CLAIM_S: Final = 10.0  # how long a routed prompt counts as held where it went
MAX_CLAIMS: Final = 100_000  # keys claimed per engine
_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "host",
        "upgrade",
        "proxy-connection",
        "te",
        "trailer",
    }
)


@dataclass(slots=True)
class _Upstream:
    name: str
    url: str
    up: bool = True
    in_flight: int = 0
    pending: float = 0.0  # blocks of prefill routed here whose first token has not come back
    routed: int = 0
    failures: int = 0
    # Keys of prompts routed here whose blocks the index may not have heard of yet (the
    # engine is still computing them): key -> when the claim lapses.
    claimed: dict[int, float] = field(default_factory=dict)

    def claim(self, keys: Sequence[int], until: float, limit: int) -> None:
        for key in keys:
            self.claimed.pop(key, None)
            self.claimed[key] = until
        while len(self.claimed) > limit:
            del self.claimed[next(iter(self.claimed))]

    def claimed_prefix(self, keys: Sequence[int], now: float) -> int:
        n = 0
        for key in keys:
            until = self.claimed.get(key)
            if until is None or until < now:
                break
            n += 1
        return n


class Router:
    """Routes to ``engines`` (name -> base URL) by ``index``; `app` is the aiohttp app."""

    def __init__(
        self,
        engines: Mapping[str, str],
        index: FleetIndex,
        hasher: BlockHasher,
        *,
        max_imbalance: int = DEFAULT_MAX_IMBALANCE,
        probe_interval_s: float = 1.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        missing = set(index.engines) ^ set(engines)
        if missing:
            raise ValueError(
                f"engines: the router and the index name different engines: {sorted(missing)}"
            )
        self.index = index
        self.hasher = hasher
        self.max_imbalance = max_imbalance
        self.probe_interval_s = probe_interval_s
        self.request_timeout_s = request_timeout_s
        self.upstreams = {name: _Upstream(name, url.rstrip("/")) for name, url in engines.items()}
        self._warn = RateLimited(log)
        self._session: Any = None

    # -- routing ------------------------------------------------------------------------------

    def choose(self, match: Match | None, keys: Sequence[int] = ()) -> tuple[_Upstream, str, float]:
        """The engine a prompt with ``match`` (and block ``keys``) goes to, why, and the
        prefill work it adds there (in blocks); `LookupError` if none is up. An engine holds a
        prefix when the index says so, or when a prompt with that prefix was routed to it in
        the last `CLAIM_S` seconds (its blocks may still be computing: the events come after)."""
        live = [u for u in self.upstreams.values() if u.up]
        if not live:
            raise LookupError("no engine is up")
        fewest = min(u.in_flight for u in live)
        live = [u for u in live if u.in_flight - fewest <= self.max_imbalance]
        if match is None:
            least = min(live, key=lambda u: (u.pending, u.in_flight, u.routed))
            return least, "least-loaded", 1.0
        now = time.monotonic()
        shared = match.shared
        blocks = max(match.blocks, len(keys))
        best: tuple[float, int, int] | None = None
        chosen = live[0]
        chosen_held = work = 0.0
        for u in live:
            held = max(match.local(u.name), u.claimed_prefix(keys, now))
            # Blocks computed here (the tail's partial block always is), then loaded.
            added = blocks - max(held, shared) + 1 + SHARED_LOAD_COST * max(0, shared - held)
            rank = (u.pending + added, u.in_flight, u.routed)
            if best is None or rank < best:
                best, chosen, chosen_held, work = rank, u, held, added
        if chosen_held and chosen_held >= shared:
            return chosen, "local", work
        return chosen, "shared" if shared else "least-loaded", work

    async def _token_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids: given, or from an engine's ``/tokenize``."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            return None  # batched prompts, embeddings: routed by load
        for upstream in self._live():
            try:
                async with self._session.post(
                    f"{upstream.url}/tokenize", json={"model": body.get("model"), "prompt": prompt}
                ) as resp:
                    if resp.status == 200:
                        tokens = (await resp.json()).get("tokens")
                        return tokens if isinstance(tokens, list) else None
            except OSError:
                self._down(upstream, "tokenize failed")
        return None

    def _live(self) -> list[_Upstream]:
        return sorted((u for u in self.upstreams.values() if u.up), key=lambda u: u.in_flight)

    def _down(self, upstream: _Upstream, why: str) -> None:
        if upstream.up:
            log.warning(
                "fleet engine down: forgotten by the index",
                engine=upstream.name,
                url=upstream.url,
                reason=why,
            )
        upstream.up = False
        upstream.failures += 1
        upstream.claimed.clear()
        self.index.forget(upstream.name)

    # -- the HTTP side ------------------------------------------------------------------------

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/fleet/engines", self._engines)
        app.router.add_post("/fleet/match", self._match)
        app.router.add_route("*", "/{path:.*}", self._passthrough)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: Any) -> Any:
        import asyncio

        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=5.0)
        self._session = aiohttp.ClientSession(timeout=timeout)
        probe = asyncio.get_running_loop().create_task(self._probe_forever())
        try:
            yield
        finally:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
            await self._session.close()

    async def _probe_forever(self) -> None:
        import asyncio

        import aiohttp

        while True:
            for upstream in self.upstreams.values():
                if upstream.up:
                    continue
                try:
                    async with self._session.get(
                        f"{upstream.url}/health", timeout=aiohttp.ClientTimeout(total=2.0)
                    ) as resp:
                        if resp.status == 200:
                            upstream.up = True
                            log.info("fleet engine up again", engine=upstream.name)
                except (TimeoutError, OSError):
                    pass
            await asyncio.sleep(self.probe_interval_s)

    async def _engines(self, request: Any) -> Any:
        from aiohttp import web

        upstreams = {
            u.name: {
                "url": u.url,
                "up": u.up,
                "in_flight": u.in_flight,
                "pending_blocks": round(u.pending, 3),
                "routed": u.routed,
                "failures": u.failures,
            }
            for u in self.upstreams.values()
        }
        index = [s._asdict() for s in self.index.stats()]
        return web.json_response(
            {"engines": upstreams, "index": index, "storage_blocks": self.index.storage_blocks()}
        )

    async def _match(self, request: Any) -> Any:
        from aiohttp import web

        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body: must be JSON"}, status=400)
        try:
            return web.json_response(match_json(self.index, self.hasher, body))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web

        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        tokens = await self._token_ids(body)
        keys = self.hasher.keys(tokens) if tokens else []
        match = self.index.match(keys) if tokens else None
        return await self._forward(request, raw, match, keys)

    async def _passthrough(self, request: Any) -> Any:
        return await self._forward(request, await request.read(), None, [])

    async def _forward(
        self, request: Any, raw: bytes, match: Match | None, keys: Sequence[int]
    ) -> Any:
        from aiohttp import ClientConnectorError, web

        tried: set[str] = set()
        while True:
            try:
                upstream, why, work = self.choose(match, keys)
            except LookupError:
                return web.json_response({"error": "no engine is up"}, status=503)
            if upstream.name in tried:
                return web.json_response({"error": "no engine answered"}, status=502)
            tried.add(upstream.name)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            upstream.in_flight += 1
            upstream.pending += work
            upstream.routed += 1
            upstream.claim(keys, time.monotonic() + CLAIM_S, MAX_CLAIMS)
            try:
                async with self._session.request(
                    request.method,
                    upstream.url + request.rel_url.path_qs,
                    data=raw,
                    headers=headers,
                ) as resp:
                    out = web.StreamResponse(status=resp.status)
                    for k, v in resp.headers.items():
                        if k.lower() not in _HOP:
                            out.headers[k] = v
                    out.headers["x-kvtier-engine"] = upstream.name
                    out.headers["x-kvtier-route"] = why
                    await out.prepare(request)
                    async for chunk in resp.content.iter_any():
                        if work:  # the first token is out: its prefill is done
                            upstream.pending -= work
                            work = 0.0
                        await out.write(chunk)
                    await out.write_eof()
                    return out
            except ClientConnectorError as exc:
                self._down(upstream, str(exc))  # nothing was sent back yet: try the next
            finally:
                upstream.in_flight -= 1
                upstream.pending -= work
