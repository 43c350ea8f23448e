"""Smoke test of an installed wheel (``nox -s wheel``): run with the wheel's interpreter, from
a directory outside the checkout, so ``kvtier_async`` is the installed package.

``wheel-smoke.py fs``: the async API over the CPU tier and an fs tier, every byte checked.
``wheel-smoke.py s3``: the same over an obj tier on moto's S3 server (127.0.0.1), the [s3]
extra installed.
"""

from __future__ import annotations

import sys
import sysconfig
import tempfile
from pathlib import Path

import anyio
import numpy as np

import kvtier_async
from kvtier_async.api import TieredKVCache
from kvtier_async.ledger import prefix_keys

BLOCK = 16 * 1024


def tier(kind: str, where: str) -> tuple[dict[str, object], object]:
    if kind == "fs":
        return {"type": "fs", "root_dir": where}, None
    from kvtier_async.bench.s3server import MotoS3Server

    server = MotoS3Server().start()
    server.create_bucket("wheel-smoke")
    return server.tier_config("wheel-smoke"), server


async def main(kind: str) -> None:
    installed = Path(kvtier_async.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert installed.is_relative_to(site), f"{installed} is not the installed package ({site})"
    with tempfile.TemporaryDirectory() as where:
        config, server = tier(kind, where)
        try:
            cache_config = {"block_bytes": BLOCK, "num_slots": 8, "secondary_tiers": [config]}
            keys = prefix_keys(list(range(16 * 6)), block_tokens=16)
            blocks = [np.full(BLOCK, i + 1, np.uint8) for i in range(len(keys))]
            async with TieredKVCache(cache_config) as cache:
                await cache.store(keys, blocks)
                await cache.drain()
                await cache.reset()  # every load now comes from the secondary tier
                assert await cache.lookup(keys) == len(keys), "the tier lost blocks"
                out = [np.zeros(BLOCK, np.uint8) for _ in keys]
                assert await cache.load(keys, out) == len(keys)
                assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        finally:
            if server is not None:
                server.stop()  # type: ignore[attr-defined]
    print(f"wheel smoke ({kind}): {len(keys)} blocks through the {kind} tier, bytes checked")


anyio.run(main, sys.argv[1])
