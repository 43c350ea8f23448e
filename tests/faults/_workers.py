"""Child processes of the multi-process scenarios: ``python -m faults._workers ROLE ...``.

- ``writer``: a `TieredKVCache` on the given tiers stores batches of blocks of stream
  ``--seed`` (indices in order, or shuffled with ``--shuffle``), drains after each batch and
  prints ``durable <hex key> ...`` for the keys the cache confirmed stored in the first tier,
  flushed at once: what a crash may not lose. ``--batches 0``: until killed.
- ``reader``: a cache on the same tiers looks up and loads random blocks of the stream,
  clearing its CPU tier every few loads so that they come from the shared tier, checks every
  byte, and prints ``read <loads> <wrong bytes> <longest call s>`` once ``--stop`` exists.

Both print ``ready`` once their cache is open. Every line is one write, flushed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

import anyio

from faults._common import (
    Calls,
    Row,
    Watched,
    cache_config,
    key_of,
    keys_of,
    load_one,
    store,
)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m faults._workers")
    parser.add_argument("role", choices=["writer", "reader"])
    parser.add_argument("--tiers", required=True, help="JSON list of tier configs")
    parser.add_argument("--seed", required=True)
    parser.add_argument("--block-bytes", type=int, default=64 << 10)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--instance-id")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=0)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--keys", type=int, default=256, help="stream length (reader)")
    parser.add_argument("--stop", help="reader: stop once this path exists")
    args = parser.parse_args()
    tiers = json.loads(args.tiers)
    extra = {"instance_id": args.instance_id} if args.instance_id else {}
    config = cache_config(args.block_bytes, args.slots, *tiers, **extra)
    role = writer if args.role == "writer" else reader
    anyio.run(role, config, args)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def writer(config: dict[str, Any], args: argparse.Namespace) -> None:
    tier = f"{config['secondary_tiers'][0]['type']}[0]"
    order = list(range(args.batch * args.batches)) if args.batches else None
    if order is not None and args.shuffle:
        random.Random(args.seed).shuffle(order)
    async with Watched(config) as cache:
        say("ready")
        batch = 0
        while not args.batches or batch < args.batches:
            start = batch * args.batch
            indices = (
                order[start : start + args.batch] if order else range(start, start + args.batch)
            )
            keys = [key_of(args.seed, i) for i in indices]
            await store(cache, keys)
            await cache.drain()
            say("durable " + " ".join(key.hex() for key in cache.take_durable(tier)))
            batch += 1


async def reader(config: dict[str, Any], args: argparse.Namespace) -> None:
    rng = random.Random(f"{args.seed}-reader-{os.getpid()}")
    keys = keys_of(args.seed, args.keys)
    row = Row("reader")
    calls = Calls(row)
    loads = wrong = 0
    async with Watched(config) as cache:
        say("ready")
        while not os.path.exists(args.stop):
            for _ in range(8):
                got = await load_one(cache, rng.choice(keys), calls)
                if got is not None:
                    loads += 1
                    wrong += got
            await calls("reset", cache.reset)
    say(f"read {loads} {wrong} {row.longest_s:.3f}")


if __name__ == "__main__":
    main()
