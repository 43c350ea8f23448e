"""The same serving core as asyncio_server.py, on trio: kvtier-async runs on anyio, so the
cache, the tiers and `serve_one` are the same code under either event loop.

Run it:  python examples/trio_embedding.py [--root DIR] [--requests N]
"""

from __future__ import annotations

import argparse
import random
import tempfile

try:
    import trio
except ImportError:  # one line, not a traceback
    raise SystemExit(
        "trio_embedding.py needs the examples extra (trio): pip install 'kvtier-async[examples]'"
    ) from None
from asyncio_server import BLOCK_BYTES, serve_one  # the backend-neutral request handler

from kvtier_async.api import TieredKVCache


async def main(root: str, requests: int, concurrency: int) -> None:
    config = {
        "block_bytes": BLOCK_BYTES,
        "num_slots": 64,
        "secondary_tiers": [{"type": "fs", "name": "disk", "root_dir": root}],
        "model": "example-model",
    }
    rng = random.Random(1)
    systems = [[rng.randrange(32_000) for _ in range(256)] for _ in range(4)]
    prompts = [
        systems[rng.randrange(4)] + [rng.randrange(32_000) for _ in range(64)]
        for _ in range(requests)
    ]
    send, receive = trio.open_memory_channel[tuple[str, list[int]]](requests)
    for i, prompt in enumerate(prompts):
        send.send_nowait((f"req-{i}", prompt))
    send.close()
    totals = [0, 0]

    async def worker() -> None:
        async for req_id, prompt in receive:
            served = await serve_one(cache, req_id, prompt)
            totals[0] += served.reused
            totals[1] += served.computed

    async with TieredKVCache(config) as cache:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        await cache.drain()
    reused, computed = totals
    print(
        f"trio: {requests} requests, {reused} blocks reused, {computed} computed "
        f"({reused / (reused + computed):.0%} reused)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="the fs tier's root (default: a temporary directory)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    if args.root:
        trio.run(main, args.root, args.requests, args.concurrency)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-trio-") as root:
            trio.run(main, root, args.requests, args.concurrency)
