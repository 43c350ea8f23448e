"""An asyncio serving loop that keeps its KV cache in kvtier-async's tiers.

A fake model stands in for the GPU: the K/V bytes of a block are a deterministic function of
the tokens before it, so every block that comes back from the cache can be checked. Requests
share a few system prompts; each one:

1. names its blocks: `prefix_keys(prompt)`, one key per full 16-token block, chained like
   vLLM's prefix hashes (equal prefixes, equal keys);
2. looks the keys up: how many leading blocks the cache has (blocks only in the fs tier are
   promoted to the CPU tier first; the call waits for that);
3. loads those blocks into its own buffers (the "GPU"), computes the rest, and stores them:
   the CPU tier takes them now, the fs tier gets a copy in the background.

Run it:  python examples/asyncio_server.py [--root DIR] [--requests N]
The fs tier's root stays behind (default ./kvtier-example-root) for examples/inspect_and_gc.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
from pathlib import Path
from typing import NamedTuple

import aiofiles  # asyncio-only, like this example: the report file is written with it
import numpy as np

from kvtier_async.api import StoreResult, TieredKVCache
from kvtier_async.ledger import prefix_keys

BLOCK_TOKENS = 16
BLOCK_BYTES = 16 * 1024  # one block of K/V: 16 tokens x 2 (K, V) x 256 float16 values


def fake_kv(key: bytes) -> np.ndarray:
    """What the fake model computes for a block: bytes derived from the block's key (which
    names every token up to the block's end)."""
    seed = np.frombuffer(hashlib.sha256(key).digest(), dtype=np.uint8)
    return np.resize(seed, BLOCK_BYTES)


class Served(NamedTuple):
    reused: int  # blocks loaded from the cache
    computed: int  # blocks the model computed (and offered to the cache)
    busy: bool  # the CPU tier had no room for them (StoreResult.no_room)


async def serve_one(cache: TieredKVCache, req_id: str, prompt: list[int]) -> Served:
    """One request, from its token ids to its stored blocks."""
    keys = prefix_keys(prompt, block_tokens=BLOCK_TOKENS, salt=b"example-model")
    async with cache.request(req_id) as r:  # the request's calls share its id
        hits = await r.lookup(keys)
        gpu = [np.empty(BLOCK_BYTES, np.uint8) for _ in range(len(keys))]  # "GPU" blocks
        loaded = await r.load(keys[:hits], gpu[:hits])
        for key, block in zip(keys[:loaded], gpu):
            assert np.array_equal(block, fake_kv(key)), "the cache returned wrong bytes"
        for i in range(loaded, len(keys)):  # the model computes what the cache lacked
            gpu[i][:] = fake_kv(keys[i])
        result: StoreResult = await r.store(keys[loaded:], gpu[loaded:])
        # no_room: the CPU tier could not free enough slots at that moment (the others were
        # being loaded, stored or copied to the fs tier), so these blocks were not cached.
        # Nothing is lost or wrong, the request is served either way; a bigger CPU tier or
        # fewer requests in flight avoid it.
    return Served(loaded, len(keys) - loaded, result.no_room)


async def main(root: str, requests: int, concurrency: int, report: str | None) -> None:
    config = {
        "block_bytes": BLOCK_BYTES,
        "num_slots": 64,  # a small CPU tier: older blocks are evicted, then promoted back
        "eviction_policy": "arc",
        "secondary_tiers": [{"type": "fs", "name": "disk", "root_dir": root}],
        "model": "example-model",
    }
    rng = random.Random(0)
    systems = [[rng.randrange(32_000) for _ in range(256)] for _ in range(4)]
    queue: asyncio.Queue[tuple[str, list[int]]] = asyncio.Queue()
    for i in range(requests):
        prompt = systems[rng.randrange(4)] + [rng.randrange(32_000) for _ in range(64)]
        queue.put_nowait((f"req-{i}", prompt))
    reused = computed = busy = 0

    async def worker() -> None:
        nonlocal reused, computed, busy
        while not queue.empty():
            req_id, prompt = queue.get_nowait()
            served = await serve_one(cache, req_id, prompt)
            reused, computed = reused + served.reused, computed + served.computed
            busy += served.busy

    async with TieredKVCache(config) as cache:
        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(worker())
        await cache.drain()  # the fs tier has every block: counters are final
        stats = cache.stats()

    total = reused + computed
    from_tiers = {tier.name: tier.counts.promoted for tier in stats.tiers}
    from_cpu = stats.lookup_hits - sum(from_tiers.values())
    print(
        f"{requests} requests, {total} blocks: {reused} reused ({reused / total:.0%}), "
        f"{computed} computed"
    )
    print(f"  hit in the CPU tier:   {from_cpu:5d} blocks ({from_cpu / total:.0%})")
    for name, count in from_tiers.items():
        print(f"  promoted from {name + ':':8s}{count:5d} blocks ({count / total:.0%})")
    if busy:
        print(f"  {busy} requests found the CPU tier busy (no_room): their blocks not cached")
    if report is not None:
        summary = {
            "requests": requests,
            "blocks": total,
            "reused": reused,
            "cpu_hits": from_cpu,
            "promoted": from_tiers,
        }
        async with aiofiles.open(report, "w") as f:
            await f.write(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="kvtier-example-root", help="the fs tier's root")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--report", help="also write a JSON summary there")
    args = parser.parse_args()
    Path(args.root).mkdir(mode=0o700, exist_ok=True)
    asyncio.run(main(args.root, args.requests, args.concurrency, args.report))
