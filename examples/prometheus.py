"""The async API's metrics on a Prometheus endpoint, scraped once.

`TieredKVCache.register_metrics` puts the cache's per-tier series (hits, misses, promotions,
cascades, bytes and seconds per direction, failures, queue depth, bytes held) into a registry
of our own; prometheus_client's HTTP server serves it on 127.0.0.1, on a port the system
picks; we serve a few requests, then scrape /metrics the way Prometheus would.

Run it:  python examples/prometheus.py [--root DIR] [--requests N]
Needs:   pip install 'kvtier-async[metrics]'   (prometheus_client)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import urllib.request

import anyio
from asyncio_server import BLOCK_BYTES, serve_one  # the request handler of the first example

try:
    from prometheus_client import CollectorRegistry, start_http_server
except ImportError:  # one line, not a traceback
    raise SystemExit(
        "prometheus.py needs the examples extra (prometheus_client): "
        "pip install 'kvtier-async[examples]'"
    ) from None

from kvtier_async.api import TieredKVCache


def scrape(port: int) -> str:
    """GET /metrics, as Prometheus does (blocking: run it in a thread)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


async def main(root: str, requests: int) -> str:
    # A registry of our own: the process-wide default one (prometheus_client.REGISTRY) is
    # left alone. Pass that one instead to serve the cache beside your other metrics.
    registry = CollectorRegistry()
    # The HTTP server runs in a daemon thread; port 0: any free port.
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    config = {
        "block_bytes": BLOCK_BYTES,
        "num_slots": 24,  # a small CPU tier: blocks are evicted, then promoted from disk
        "secondary_tiers": [{"type": "fs", "name": "disk", "root_dir": root}],
    }
    rng = random.Random(1)
    systems = [[rng.randrange(32_000) for _ in range(128)] for _ in range(3)]
    try:
        async with TieredKVCache(config) as cache:
            cache.register_metrics(registry)  # each scrape reads the cache's counters
            for i in range(requests):  # prompts that share one of three system prompts
                prompt = systems[i % 3] + [rng.randrange(32_000) for _ in range(32)]
                await serve_one(cache, f"req-{i}", prompt)
            await cache.drain()  # every cascade ended: the counters are final
            text = await anyio.to_thread.run_sync(scrape, server.server_port)
            print(cache.stats())  # the same figures, for a person
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    print(f"\nscraped http://127.0.0.1:{server.server_port}/metrics, the per-tier series:")
    for line in text.splitlines():
        if line.startswith("kvtier_tier_") and "_created" not in line:
            print(" ", line)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="the fs tier's root (default: a temporary directory)")
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, args.root or tmp, args.requests)
