"""File damage of every kind, through `TieredKVCache` with an fs tier, on a disk directory
and on tmpfs.

Each trial stores four blocks, drains (all four confirmed in the fs tier), damages the file of
the first one in one way, clears the CPU tier and loads all four back through lookups
(promotions from the fs tier). The damaged block must be a miss, never wrong bytes; the three
others must load byte for byte. A damaged file that a lookup takes for a block (a regular file
of the right size) must be gone after the failed promotion, and its removal announced (a KV
event); any other must be replaced by the next store of that key. The damage is made
with test_tier_fs's helpers (`_craft`, `block_path`) where they have it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio

from faults._common import (
    DISK,
    LOCAL_BOUNDS,
    SHM,
    Calls,
    Row,
    Watched,
    audit,
    cache_config,
    content,
    fs_tier,
    guard,
    keys_of,
    private_dir,
    store,
)
from kvtier_async.tiers.checksum import checksum
from kvtier_async.tiers.fs import HEADER_BYTES, FsTier
from kvtier_async.tiers.fs import native as fs_native
from test_tier_fs import _craft, block_path

BLOCK = 4 * 4096  # four pages: `_craft`'s "short length" needs more than one
TIER = "fs[0]"
BOUND_S = 5.0  # local file I/O of a few 16 KiB blocks; generous for a busy 2-core machine


@dataclass
class Damage:
    """The block file to damage, its key, and a good file of another key beside it."""

    path: Path
    key: bytes
    other: Path
    scratch: Path

    def payload(self) -> bytes:
        return self.path.read_bytes()[HEADER_BYTES:]


def crafted(kind: str) -> Callable[[Damage], None]:
    def damage(d: Damage) -> None:
        d.path.write_bytes(_craft(kind, d.key, d.payload()))

    return damage


def flip_random_bit(d: Damage) -> None:
    data = bytearray(d.path.read_bytes())
    bit = random.Random(d.key).randrange(len(data) * 8)
    data[bit // 8] ^= 1 << (bit % 8)
    d.path.write_bytes(bytes(data))


def wrong_version(d: Damage) -> None:
    """A header of another format version whose header checksum is right."""
    page = bytearray(d.path.read_bytes()[:HEADER_BYTES])
    page[8:10] = (int.from_bytes(page[8:10], "little") + 1).to_bytes(2, "little")
    page[-8:] = checksum(memoryview(page)[:-8]).to_bytes(8, "little")
    d.path.write_bytes(bytes(page) + d.payload())


def zero_header(d: Damage) -> None:
    d.path.write_bytes(bytes(HEADER_BYTES) + d.payload())


def zero_payload(d: Damage) -> None:
    d.path.write_bytes(d.path.read_bytes()[:HEADER_BYTES] + bytes(BLOCK))


def truncate_to(size: int) -> Callable[[Damage], None]:
    def damage(d: Damage) -> None:
        os.truncate(d.path, size)

    return damage


def copy_of_other(d: Damage) -> None:
    shutil.copyfile(d.other, d.path)


def link_to_other(d: Damage) -> None:
    d.path.unlink()
    d.path.symlink_to(d.other)


def link_to_own_bytes(d: Damage) -> None:
    """The right bytes for this key, behind a symbolic link (never followed)."""
    elsewhere = d.scratch / "moved.bin"
    d.path.rename(elsewhere)
    d.path.symlink_to(elsewhere)


def dangling_link(d: Damage) -> None:
    d.path.unlink()
    d.path.symlink_to(d.scratch / "nothing-here")


def directory(d: Damage) -> None:
    d.path.unlink()
    d.path.mkdir()


def fifo(d: Damage) -> None:
    d.path.unlink()
    os.mkfifo(d.path, 0o600)


def unreadable(d: Damage) -> None:
    """Mode 000; the trial runs as an unprivileged user (see `as_nobody`), so it is EACCES."""
    d.path.chmod(0)


# name -> (damage, whether a lookup takes the damaged file for a block)
KINDS: dict[str, tuple[Callable[[Damage], None], bool]] = {
    **{
        f"craft: {kind}": (crafted(kind), kind not in ("truncated", "too long"))
        for kind in (
            "header bit",
            "foreign magic",
            "short length",
            "another key",
            "payload bit",
            "truncated",
            "too long",
        )
    },
    "one random bit flipped": (flip_random_bit, True),
    "wrong format version": (wrong_version, True),
    "header page zeroed": (zero_header, True),
    "payload zeroed": (zero_payload, True),
    "cut inside the header": (truncate_to(10), False),
    "empty file": (truncate_to(0), False),
    "copy of another key's file": (copy_of_other, True),
    "symlink to another key's file": (link_to_other, False),
    "symlink to its own bytes": (link_to_own_bytes, False),
    "dangling symlink": (dangling_link, False),
    "directory in its place": (directory, False),
    "FIFO in its place": (fifo, False),
    "permission denied (mode 000)": (unreadable, True),
}
PLACES = {"disk": DISK, "tmpfs": SHM}


def run(seed: int) -> Iterator[Row]:
    row = Row(
        f"fs: file damage, {len(KINDS)} kinds x disk and tmpfs",
        bound_s=BOUND_S,
        bounds=[LOCAL_BOUNDS],
    )
    fs_native.native_fsio()  # built or loaded now, as this user (see `as_nobody`)
    for place, parent in PLACES.items():
        for number, (kind, (damage, looks_whole)) in enumerate(KINDS.items()):
            label = f"{kind} on {place}"
            with as_nobody(kind == "permission denied (mode 000)"), guard(row):
                root = private_dir(parent, "damage")  # this user's, 0700
                try:
                    anyio.run(trial, row, label, f"{seed}-{place}-{number}", root, damage,
                              looks_whole)  # fmt: skip
                finally:
                    shutil.rmtree(root, ignore_errors=True)
            row.trials += 1
    row.notes = list(dict.fromkeys(row.notes))  # the same finding on both places: once
    yield row


@contextlib.contextmanager
def as_nobody(wanted: bool) -> Iterator[None]:
    """Run as user ``nobody`` (effective uid) when ``wanted`` and root: root reads any file,
    so a mode-000 file is unreadable only to another user."""
    if not wanted or os.geteuid() != 0:
        yield
        return
    os.seteuid(pwd.getpwnam("nobody").pw_uid)
    try:
        yield
    finally:
        os.seteuid(0)


async def trial(
    row: Row,
    label: str,
    seed: str,
    root: Path,
    damage: Callable[[Damage], None],
    looks_whole: bool,
) -> None:
    calls = Calls(row)
    keys = keys_of(seed, 4)
    async with Watched(cache_config(BLOCK, 8, fs_tier(root))) as cache:
        await store(cache, keys)
        await cache.drain()
        if cache.take_durable(TIER) != set(keys):
            row.problems.append(f"{label}: the four blocks were not all stored")
            return
        (tier,) = cache.tiers
        assert isinstance(tier, FsTier)
        victim = Damage(block_path(tier, keys[0]), keys[0], block_path(tier, keys[1]), root)
        damage(victim)
        other_bytes = victim.other.read_bytes()
        found = await audit(cache, keys, calls)
        row.wrong_bytes += found.wrong_bytes
        row.durable_lost += found.lost(keys[1:])
        if keys[0] in found.present:
            row.problems.append(f"{label}: the damaged block was served")
        check_cleanup(row, label, cache, victim, looks_whole)
        await check_repair(row, label, cache, tier, keys[0], calls)
        if victim.other.read_bytes() != other_bytes:
            row.problems.append(f"{label}: another key's file changed")


def check_cleanup(row: Row, label: str, cache: Watched, victim: Damage, looks_whole: bool) -> None:
    """A file that looked like a block was promoted, failed, and must be gone, and the cache
    must have announced its removal from the tier (the tier's `take_removed`, as a KV
    event)."""
    removed = cache.take_removed(TIER)
    if not looks_whole:
        return
    if os.path.lexists(victim.path):
        row.problems.append(f"{label}: the damaged file is still there")
    if removed != [victim.key]:
        row.problems.append(f"{label}: {len(removed)} removals announced, not the victim's")


async def check_repair(
    row: Row, label: str, cache: Watched, tier: FsTier, key: bytes, calls: Calls
) -> None:
    """The next store of the damaged key replaces whatever is at its name."""
    await store(cache, [key], calls)
    await calls("drain", cache.drain)
    cache.take_durable(TIER)
    found = await audit(cache, [key], calls)
    row.wrong_bytes += found.wrong_bytes
    if key not in found.present and block_path(tier, key).is_dir():
        row.notes.append(
            f"{label.split(' on ')[0]}: the key stays a miss: stores do not replace a "
            "directory at a block's name (lookups skip it, so no promotion's load removes it)"
        )
    elif key not in found.present:
        row.problems.append(f"{label}: a new store did not replace the damaged file")
    elif block_path(tier, key).read_bytes()[HEADER_BYTES:] != content(key, BLOCK).tobytes():
        row.problems.append(f"{label}: the repaired file holds other bytes")
