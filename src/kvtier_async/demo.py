"""``kvtier demo``: a simulated multi-turn chat workload through `TieredKVCache`.

A few shared system prompts open many conversations; each turn's prompt is the system
prompt, the whole history and a new user message, split into 16-token blocks named by
chained hashes (as vLLM's prefix hashes are). Per turn: look the prompt up, load the hits
and check every byte against what a model would have computed (a deterministic function of
the block's key), then "compute" and store the rest. The CPU tier is small, so old turns are
evicted from it and come back by promotion from the secondary tiers.

Runs on embedded defaults: a CPU region in /dev/shm, the memory tier, and the fs tier in a
temporary directory when it is available.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from kvtier_async.api import CacheStats, TieredKVCache
from kvtier_async.ledger import prefix_keys

__all__ = ["DemoReport", "default_config", "render_report", "run_demo"]

TOKENS_PER_BLOCK = 16


@dataclass
class DemoReport:
    turns: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    verified_blocks: int = 0
    stored_blocks: int = 0
    seconds: float = 0.0
    stats: CacheStats | None = None
    tiers: list[str] = field(default_factory=list)


def default_config(fs_root: str | None, block_bytes: int = 32 * 1024) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"type": "memory", "name": "memory"}]
    if fs_root is not None:
        tiers.append({"type": "fs", "name": "fs", "root_dir": fs_root})
    return {
        "block_bytes": block_bytes,
        "num_slots": 192,
        "secondary_tiers": tiers,
        "model": "kvtier-demo-chat",
    }


def expected_block(key: bytes, block_bytes: int) -> np.ndarray:
    """What the fake model writes for a block: bytes derived from its key."""
    seed = np.frombuffer(hashlib.sha256(key).digest(), dtype=np.uint8)
    return np.resize(seed, block_bytes)


class Conversation:
    def __init__(self, system: list[int], rng: random.Random) -> None:
        self.tokens = list(system)
        self.rng = rng

    def next_prompt(self) -> list[int]:
        self.tokens += [self.rng.randrange(32000) for _ in range(self.rng.randint(48, 160))]
        return list(self.tokens)

    def reply(self) -> None:
        self.tokens += [self.rng.randrange(32000) for _ in range(self.rng.randint(48, 160))]


def block_keys(tokens: list[int]) -> list[bytes]:
    """The prompt's offload keys: one per full 16-token block, chained like vLLM's hashes."""
    return prefix_keys(tokens, block_tokens=TOKENS_PER_BLOCK, salt=b"kvtier-demo")


def schedule(num_convs: int, turns: int, seed: int) -> Iterator[int]:
    """The conversation of each turn, all conversations' turns interleaved."""
    rng = random.Random(seed)
    remaining = {c: turns for c in range(num_convs)}
    while remaining:
        conv = rng.choice(sorted(remaining))
        remaining[conv] -= 1
        yield conv
        if not remaining[conv]:
            del remaining[conv]


async def run_demo(
    config: dict[str, Any],
    *,
    conversations: int = 24,
    turns: int = 5,
    seed: int = 7,
    progress: Callable[[int, int], None] | None = None,
) -> DemoReport:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(512)] for _ in range(3)]
    convs = [
        Conversation(systems[c % 3], random.Random(seed * 1000 + c)) for c in range(conversations)
    ]
    report, total = DemoReport(), conversations * turns
    block_bytes = config["block_bytes"]
    start = time.perf_counter()
    async with TieredKVCache(config) as cache:
        report.tiers = [tier.name for tier in cache.tiers]
        for conv in schedule(conversations, turns, seed):
            await _turn(cache, convs[conv], block_bytes, report)
            if progress is not None:
                progress(report.turns, total)
        await cache.drain()
        report.stats = cache.stats()
    report.seconds = time.perf_counter() - start
    return report


async def _turn(
    cache: TieredKVCache, conv: Conversation, block_bytes: int, report: DemoReport
) -> None:
    prompt = conv.next_prompt()
    keys = block_keys(prompt)
    hits = await cache.lookup(keys)
    if hits:
        out = [np.empty(block_bytes, np.uint8) for _ in range(hits)]
        loaded = await cache.load(keys[:hits], out)
        for key, block in zip(keys[:loaded], out):
            if not np.array_equal(block, expected_block(key, block_bytes)):
                raise AssertionError(f"block {key.hex()} came back with wrong bytes")
        hits = loaded
    new = keys[hits:]
    result = await cache.store(new, [expected_block(key, block_bytes) for key in new])
    conv.reply()
    report.turns += 1
    report.prompt_tokens += len(prompt)
    report.reused_tokens += hits * TOKENS_PER_BLOCK
    report.verified_blocks += hits
    report.stored_blocks += len(result.stored)


# What the table's columns count, printed under it.
COLUMNS = [
    "",
    "  lookups      keys asked of the tier (cpu: every key looked up; the others: keys the",
    "               CPU tier did not hold then)",
    "  hits         of those, keys the tier held (cpu: with those promoted for the lookup;",
    "               a key held by two tiers is promoted from the first)",
    "  promoted     blocks copied up from the tier into the CPU tier after a hit",
    "  cascaded     blocks copied down from the CPU tier into the tier",
    "  bytes moved  bytes the tier read and wrote (cpu: copies to and from the caller)",
    "  GB/s         bytes moved per second of the tier's job run time, summed over its",
    "               concurrent jobs, lookups included (they move no bytes): how busy the",
    "               tier was in this small, latency-bound run, not its bandwidth",
    "               (for that: kvtier bench fs)",
]


def render_report(report: DemoReport) -> str:
    stats = report.stats
    assert stats is not None
    device = stats.device
    rows = [("tier", "lookups", "hits", "promoted", "cascaded", "bytes moved", "GB/s")]
    rows.append(
        (
            "cpu",
            f"{stats.lookups:,}",
            f"{stats.lookup_hits:,}",
            "-",
            "-",
            _bytes(device.store_bytes + device.load_bytes),
            f"{device.gbps:.2f}",
        )
    )
    for tier in stats.tiers:
        c = tier.counts
        rows.append(
            (
                tier.name,
                f"{c.lookups:,}",
                f"{c.hits:,}",
                f"{c.promoted:,}",
                f"{c.cascaded:,}",
                _bytes(c.bytes_read + c.bytes_written),
                f"{c.gbps:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += COLUMNS
    share = report.reused_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
    lines += [
        "",
        f"{report.turns} turns, {report.prompt_tokens:,} prompt tokens in {report.seconds:.1f} s",
        f"prompt tokens not recomputed: {report.reused_tokens:,} ({share:.0%}); "
        f"{report.verified_blocks:,} loaded blocks verified byte for byte",
        f"CPU tier: {stats.ledger.capacity} slots, {stats.ledger.used} in use",
    ]
    return "\n".join(lines)


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GiB"


class ProgressBar:
    """A one-line progress bar on a terminal, or a line per 10% elsewhere."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream, self.width = stream, width
        self._tty = stream.isatty()
        self._last_decile = -1

    def __call__(self, done: int, total: int) -> None:
        if self._tty:
            filled = self.width * done // total
            bar = "#" * filled + "." * (self.width - filled)
            end = "\n" if done == total else ""
            self.stream.write(f"\r[{bar}] {done}/{total} turns{end}")
        elif (decile := 10 * done // total) != self._last_decile:
            self._last_decile = decile
            self.stream.write(f"demo: {done}/{total} turns\n")
        self.stream.flush()


def fs_available() -> bool:
    try:
        import kvtier_async.tiers.fs  # noqa: F401
    except ImportError:
        return False
    return True


async def main(*, conversations: int = 24, turns: int = 5) -> DemoReport:
    """The CLI's demo: temporary fs root (removed afterwards) when the fs tier exists."""
    root = tempfile.mkdtemp(prefix="kvtier-demo-", dir="/var/tmp") if fs_available() else None
    try:
        return await run_demo(
            default_config(root), conversations=conversations, turns=turns, progress=ProgressBar()
        )
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
