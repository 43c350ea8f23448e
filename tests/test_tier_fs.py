"""The fs tier on real file systems: a disk directory (O_DIRECT) and /dev/shm (tmpfs).

Block memory comes from a real `SharedRegion`, so O_DIRECT reads and writes hit page-aligned
slots as in production. Faults are real where the machine allows (a directory squatting a block
path, a size-limited tmpfs mount, dead processes) and injected through the syscall seams of
`kvtier_async.tiers.fs.blockio` (``_open``, ``_pwritev``, ``_preadv``) otherwise. Multiprocess
tests use the spawn context and coordinate with barriers and events; their timeouts only keep a
broken test from hanging, they never order anything.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import logging
import mmap
import multiprocessing
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import crc32c
import pytest
from blockbuster import blockbuster_ctx

from kvtier_async.config import ConfigError
from kvtier_async.ledger import make_offload_key
from kvtier_async.memory import RegionInUseError, SharedRegion
from kvtier_async.tiers import blockfile, fs
from kvtier_async.tiers.base import TierContext, make_tier
from kvtier_async.tiers.blockfile import block_relpath
from kvtier_async.tiers.checksum import checksum
from kvtier_async.tiers.fs import (
    HEADER_BYTES,
    FsTier,
    blockio,
    files,
    native_source,
    records,
    tempfiles,
)
from kvtier_async.tiers.fs import native as fs_native
from kvtier_async.tiers.fs import publish as fs_publish

CTX = multiprocessing.get_context("spawn")
WAIT_S = 60.0  # fail-safe only
DISK = Path("/var/tmp")
SHM = Path("/dev/shm")
PAGE = mmap.PAGESIZE


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every test on both I/O paths, except those marked ``single_path``: they inject
    faults through the Python syscall seams, which only the Python path calls, or pick the
    paths themselves."""
    single = metafunc.definition.get_closest_marker("single_path") is not None
    paths = ["python"] if single else ["native", "python"]
    metafunc.parametrize("io_path", paths, indirect=True)


@pytest.fixture(autouse=True)
def io_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``native``: the C batch path (`kvtier_async.tiers.fs.native`); ``python``: the fallback.
    The environment variable reaches spawned processes too."""
    path = str(request.param)
    native = fs_native.native_fsio()  # cached now, before the variable below is set
    if path == "native" and native is None:
        pytest.skip("the native fs I/O helper cannot be built here (no C compiler?)")
    if path == "python":
        monkeypatch.setenv("KVTIER_NATIVE_FS", "0")
        monkeypatch.setattr(files, "_native_fsio", lambda: None)
    return path


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> fs_native.FsIo:
    """The C helper, put back for a ``single_path`` test that is about it."""
    helper = fs_native.native_fsio()
    if helper is None:
        pytest.skip("the native fs I/O helper cannot be built here")
    monkeypatch.setattr(files, "_native_fsio", lambda: helper)
    return helper


@pytest.fixture(autouse=True)
def no_blocking_calls() -> Iterator[None]:
    """Fail any blocking call that the fs tier makes on the asyncio event loop."""
    with blockbuster_ctx("kvtier_async.tiers.fs"):
        yield


def _private_dir(parent: Path) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvtier-fs-test-", dir=parent))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on the real disk, where O_DIRECT works."""
    yield from _private_dir(DISK)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on tmpfs."""
    yield from _private_dir(SHM)


class Slots:
    """Page-aligned block memory from real shared regions, closed at teardown."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.regions: list[SharedRegion] = []

    def make(self, count: int, block_bytes: int, *, fill: bool = True) -> list[memoryview]:
        if count == 0:
            return []
        region = SharedRegion(f"t{uuid.uuid4().hex}", count, block_bytes, directory=self.directory)
        self.regions.append(region)
        views = [region.slot_view(i) for i in range(count)]
        if fill:
            for view in views:
                view[:] = os.urandom(block_bytes)
        return views

    def close(self) -> None:
        for region in self.regions:
            with contextlib.suppress(RegionInUseError):
                region.close()


@pytest.fixture
def slots() -> Iterator[Slots]:
    with contextlib.ExitStack() as stack:
        directory = Path(tempfile.mkdtemp(prefix="kvtier-fs-slots-", dir=SHM))
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        holder = Slots(directory)
        stack.callback(holder.close)
        yield holder


def keys_for(count: int, group: int = 0) -> list[bytes]:
    return [make_offload_key(os.urandom(32), group) for _ in range(count)]


def new_tier(root: Path, block_bytes: int = PAGE, **kwargs: Any) -> FsTier:
    ctx = kwargs.pop("ctx", None) or TierContext(block_bytes=block_bytes)
    return FsTier("fs-test", ctx, 4, 4, root_dir=root, **kwargs)


@contextlib.asynccontextmanager
async def opened(tier: FsTier) -> AsyncIterator[FsTier]:
    await tier.open()
    try:
        yield tier
    finally:
        await tier.aclose()


def block_path(tier: FsTier, key: bytes) -> Path:
    return Path(tier.root_dir) / block_relpath(tier.ctx, key)


def snapshot(views: Sequence[memoryview]) -> list[bytes]:
    return [bytes(view) for view in views]


def wipe(views: Sequence[memoryview]) -> None:
    for view in views:
        view[:] = bytes(len(view))


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def temp_files(root: Path) -> list[Path]:
    return [p for p in files_under(root) if p.name.endswith(".tmp")]


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every O_DIRECT open fail with EINVAL, as older tmpfs and overlayfs do."""
    real_open = blockio._open

    def open_without_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused (test)", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(blockio, "_open", open_without_direct)


def use_publish(monkeypatch: pytest.MonkeyPatch, publish: str) -> None:
    """Make the tier publish new files with ``publish`` (see `fs.PUBLISH_ORDER`)."""
    monkeypatch.setattr(fs_publish, "PUBLISH_ORDER", (publish,))


PUBLISH_MODES = ["rename", "linkat", "proc-linkat"]


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("count", [0, 1, 2, 5])
@pytest.mark.parametrize("block_bytes", [PAGE, 3 * PAGE, 64 << 10, 5000])
async def test_round_trip_is_byte_exact(
    disk_dir: Path, slots: Slots, count: int, block_bytes: int
) -> None:
    keys, views = keys_for(count), slots.make(count, block_bytes)
    stored = snapshot(views)
    async with opened(new_tier(disk_dir, block_bytes)) as tier:
        assert await tier.store(keys, views) == [True] * count
        assert await tier.lookup(keys) == [True] * count
        wipe(views)
        assert await tier.load(keys, views) == [True] * count
        assert snapshot(views) == stored
    assert (tier.counters.written, tier.counters.present) == (count, 0)


@pytest.mark.single_path
@pytest.mark.anyio
@pytest.mark.parametrize("publish", PUBLISH_MODES)
async def test_disk_directory_uses_o_direct_for_loads_and_stores(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, publish: str
) -> None:
    use_publish(monkeypatch, publish)
    flags_seen: list[int] = []
    real_open = blockio._open

    def recording_open(path: Any, flags: int, *args: Any) -> int:
        flags_seen.append(flags)
        return real_open(path, flags, *args)

    keys, views = keys_for(3), slots.make(3, 2 * PAGE)
    async with opened(new_tier(disk_dir, 2 * PAGE)) as tier:
        if "io=O_DIRECT" not in tier.statistics().detail:
            pytest.skip(f"{DISK} refuses O_DIRECT here")
        monkeypatch.setattr(blockio, "_open", recording_open)
        assert await tier.store(keys, views) == [True] * 3
        assert await tier.load(keys, views) == [True] * 3
    assert len(flags_seen) == 6
    assert all(flags & os.O_DIRECT for flags in flags_seen)


def resident_bytes(paths: Sequence[Path]) -> int:
    """Bytes of ``paths`` in the page cache, by ``fincore``."""
    if shutil.which("fincore") is None:
        pytest.skip("fincore (util-linux) is not installed")
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(int(value) for value in out.stdout.split())


@pytest.mark.anyio
async def test_o_direct_bypasses_the_page_cache(disk_dir: Path, slots: Slots, io_path: str) -> None:
    keys, views = keys_for(4), slots.make(4, 16 * PAGE)
    async with opened(new_tier(disk_dir, 16 * PAGE)) as tier:
        detail = tier.statistics().detail
        assert f"path={io_path}" in detail
        if "io=O_DIRECT" not in detail:
            pytest.skip(f"{DISK} refuses O_DIRECT here")
        assert await tier.store(keys, views) == [True] * 4
        paths = [block_path(tier, key) for key in keys]
        assert resident_bytes(paths) == 0  # buffered writes would leave 4 x 68 KiB here
        assert await tier.load(keys, views) == [True] * 4
        assert resident_bytes(paths) == 0
        refused = views[0].toreadonly()
        assert await tier.load(keys[:1], [refused]) == [False]  # never written through
        del refused


@pytest.mark.anyio
async def test_unaligned_and_read_only_memory(disk_dir: Path, slots: Slots) -> None:
    block_bytes = 2 * PAGE
    keys = keys_for(3)
    store_buf, load_buf = bytearray(os.urandom(block_bytes + 1)), bytearray(block_bytes + 1)
    (aligned,) = slots.make(1, block_bytes)
    async with opened(new_tier(disk_dir, block_bytes)) as tier:
        unaligned = memoryview(store_buf)[1:]  # one byte off any page boundary: buffered
        read_only = memoryview(bytes(store_buf[1:]))  # bytes: read-only, any alignment
        aligned_read_only = aligned.toreadonly()  # page-aligned and read-only: O_DIRECT
        sources = [unaligned, read_only, aligned_read_only]
        assert await tier.store(keys, sources) == [True] * 3
        target = memoryview(load_buf)[1:]
        for key, source in zip(keys, sources, strict=True):
            assert await tier.load([key], [target]) == [True]
            assert bytes(target) == bytes(source)
        del unaligned, read_only, aligned_read_only, sources, target


@pytest.mark.anyio
async def test_fsync_round_trip(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, io_path: str
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    keys, views = keys_for(3), slots.make(3, 2 * PAGE)
    stored = snapshot(views)
    async with opened(new_tier(disk_dir, 2 * PAGE, fsync=True)) as tier:
        assert "fsync=on" in tier.statistics().detail
        assert await tier.store(keys, views) == [True] * 3
        wipe(views)
        assert await tier.load(keys, views) == [True] * 3
    assert snapshot(views) == stored
    assert len(synced) == (3 if io_path == "python" else 0)  # the C path calls fsync(2) itself


@pytest.mark.anyio
async def test_tmpfs_round_trip(shm_dir: Path, slots: Slots) -> None:
    keys, views = keys_for(5), slots.make(5, 2 * PAGE)
    stored = snapshot(views)
    async with opened(new_tier(shm_dir, 2 * PAGE)) as tier:
        assert await tier.store(keys, views) == [True] * 5
        wipe(views)
        assert await tier.load(keys, views) == [True] * 5
    assert snapshot(views) == stored


@pytest.mark.single_path
@pytest.mark.anyio
async def test_tmpfs_takes_the_buffered_path_without_o_direct(
    shm_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, native: fs_native.FsIo
) -> None:
    """tmpfs accepts O_DIRECT on recent kernels, but its files are in memory: the tier says
    so and never asks for it, on either path (the Python one is checked through its opens)."""
    assert fs_publish.memory_fs(str(shm_dir)) == "tmpfs"
    assert fs_publish.memory_fs(str(DISK)) == ""
    keys, views = keys_for(3), slots.make(3, 2 * PAGE)
    async with opened(new_tier(shm_dir, 2 * PAGE)) as tier:
        assert "io=buffered(tmpfs)" in tier.statistics().detail
        assert "path=native" in tier.statistics().detail
        assert await tier.store(keys, views) == [True] * 3
    flags_seen: list[int] = []
    real_open = blockio._open

    def recording_open(path: Any, flags: int, *args: Any) -> int:
        flags_seen.append(flags)
        return real_open(path, flags, *args)

    monkeypatch.setattr(files, "_native_fsio", lambda: None)
    monkeypatch.setattr(blockio, "_open", recording_open)
    async with opened(new_tier(shm_dir, 2 * PAGE)) as tier:
        assert "io=buffered(tmpfs)" in tier.statistics().detail
        assert await tier.load(keys, views) == [True] * 3
    assert len(flags_seen) >= 3
    assert not any(flags & os.O_DIRECT for flags in flags_seen)


@pytest.mark.anyio
@pytest.mark.parametrize("publish", PUBLISH_MODES)
async def test_buffered_path_when_o_direct_is_refused(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, publish: str
) -> None:
    refuse_o_direct(monkeypatch)
    use_publish(monkeypatch, publish)
    keys, views = keys_for(5), slots.make(5, 2 * PAGE)
    stored = snapshot(views)
    async with opened(new_tier(disk_dir, 2 * PAGE)) as tier:
        detail = tier.statistics().detail
        assert "io=buffered" in detail
        assert await tier.store(keys, views) == [True] * 5
        wipe(views)
        assert await tier.load(keys, views) == [True] * 5
    assert snapshot(views) == stored
    assert f"publish={publish}" in detail or "publish=rename" in detail  # linkat may be refused
    assert temp_files(disk_dir) == []


# -- damaged, missing and unreadable files ---------------------------------------------------


async def _stored_block(tier: FsTier, slots: Slots) -> tuple[bytes, memoryview, Path]:
    (key,), (view,) = keys_for(1), slots.make(1, tier.ctx.block_bytes)
    assert await tier.store([key], [view]) == [True]
    return key, view, block_path(tier, key)


async def _assert_fails_and_is_gone(tier: FsTier, key: bytes, view: memoryview, path: Path) -> None:
    tier.take_removed()
    assert await tier.load([key], [view]) == [False]
    assert not path.exists() and not path.is_symlink()
    assert await tier.lookup([key]) == [False]
    # removed, counted and reported, once
    assert tier.statistics().removed_damaged == 1
    assert tier.take_removed() == [key]
    assert tier.take_removed() == []


@pytest.mark.anyio
async def test_truncated_file_fails_and_is_deleted(disk_dir: Path, slots: Slots) -> None:
    async with opened(new_tier(disk_dir, 4 * PAGE)) as tier:
        key, view, path = await _stored_block(tier, slots)
        os.truncate(path, HEADER_BYTES + 100)
        await _assert_fails_and_is_gone(tier, key, view, path)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "offset",
    [
        0,  # magic
        9,  # format version
        16,  # payload length
        24,  # payload checksum
        32,  # key checksum
        200,  # padding, covered by the header checksum
        HEADER_BYTES - 1,  # the header checksum itself
        HEADER_BYTES,  # first payload byte
        HEADER_BYTES + 2 * PAGE + 7,  # middle
        HEADER_BYTES + 4 * PAGE - 1,  # last payload byte
    ],
)
async def test_flipped_byte_fails_and_is_deleted(disk_dir: Path, slots: Slots, offset: int) -> None:
    async with opened(new_tier(disk_dir, 4 * PAGE)) as tier:
        key, view, path = await _stored_block(tier, slots)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x01]))
        await _assert_fails_and_is_gone(tier, key, view, path)


# Buffered I/O moves a payload in pieces of 256 KiB (`native_source`): a block of 2.5 pieces.
PIECES = (640 << 10) // PAGE * PAGE


@pytest.mark.anyio
@pytest.mark.parametrize(
    "damage",
    [None, "flip first piece", "flip last piece", "cut in second piece", "cut at a piece end"],
)
async def test_blocks_of_several_pieces_on_tmpfs(
    shm_dir: Path, slots: Slots, damage: str | None
) -> None:
    """Buffered, a block larger than a piece round-trips, and damage in any piece fails it."""
    async with opened(new_tier(shm_dir, PIECES)) as tier:
        assert "io=buffered(tmpfs)" in tier.statistics().detail
        key, view, path = await _stored_block(tier, slots)
        stored = bytes(view)
        assert path.read_bytes()[HEADER_BYTES:] == stored
        if damage is None:
            wipe([view])
            assert await tier.load([key], [view]) == [True]
            assert bytes(view) == stored
            return
        if damage.startswith("flip"):
            offset = HEADER_BYTES + (5 if "first" in damage else PIECES - 5)
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ 0x01]))
        else:
            os.truncate(path, HEADER_BYTES + (300 << 10 if "second" in damage else 512 << 10))
        await _assert_fails_and_is_gone(tier, key, view, path)


def _craft(kind: str, key: bytes, payload: bytes) -> bytes:
    """A damaged block file for ``key``: each kind fails one check of `fs.verify_block`."""
    page = memoryview(bytearray(HEADER_BYTES))
    if kind == "short length":  # a header for a payload one page shorter, full-size file
        fs.pack_header(page, key, memoryview(payload[PAGE:]))
        return bytes(page) + payload
    fs.pack_header(
        page, key if kind != "another key" else bytes([key[0] ^ 1]) + key[1:], memoryview(payload)
    )
    if kind == "foreign magic":  # another format whose header checksum is still right
        page[:8] = b"NOTKVTB\x00"
        page[HEADER_BYTES - 8 :] = checksum(page[: HEADER_BYTES - 8]).to_bytes(8, "little")
    data = bytearray(page) + payload
    if kind == "header bit":
        data[20] ^= 0x10
    if kind == "payload bit":
        data[-1] ^= 0x80
    if kind == "truncated":
        del data[HEADER_BYTES + 100 :]
    if kind == "too long":  # a valid block with bytes after it
        data += b"trailing"
    return bytes(data)


VERDICTS = {
    "header bit": "header checksum mismatch",
    "foreign magic": "not a block file of this format",
    "short length": f"payload is {PAGE} bytes, expected {2 * PAGE}",
    "another key": "the file belongs to another key",
    "payload bit": "payload checksum mismatch",
    "truncated": f"short file: read {HEADER_BYTES + 100} of {HEADER_BYTES + 2 * PAGE} bytes",
    "too long": f"file is {HEADER_BYTES + 2 * PAGE + 8} bytes, expected {HEADER_BYTES + 2 * PAGE}",
}


@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(VERDICTS))
async def test_each_damage_gets_its_own_verdict(
    disk_dir: Path, slots: Slots, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """Both I/O paths check the same things in the same order and say the same."""
    async with opened(new_tier(disk_dir, 2 * PAGE)) as tier:
        key, view, path = await _stored_block(tier, slots)
        path.write_bytes(_craft(kind, key, bytes(view)))
        with caplog.at_level(logging.WARNING, logger="kvtier_async.tiers.fs"):
            await _assert_fails_and_is_gone(tier, key, view, path)
    (record,) = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert f"error={VERDICTS[kind]!r}" in record.getMessage()


@pytest.mark.anyio
@pytest.mark.single_path
@pytest.mark.parametrize("writer", ["native", "python"])
async def test_both_io_paths_write_the_same_files(
    disk_dir: Path,
    slots: Slots,
    monkeypatch: pytest.MonkeyPatch,
    writer: str,
    native: fs_native.FsIo,
) -> None:
    """Files written by one path load on the other, and through `fs.verify_block` (as the
    obj tier reads them)."""
    paths = {"native": lambda: native, "python": lambda: None}
    reader = "python" if writer == "native" else "native"
    keys, views = keys_for(3), slots.make(3, 3 * PAGE)
    stored = snapshot(views)
    monkeypatch.setattr(files, "_native_fsio", paths[writer])
    async with opened(new_tier(disk_dir, 3 * PAGE)) as tier:
        assert f"path={writer}" in tier.statistics().detail
        assert await tier.store(keys, views) == [True] * 3
    for key, expected in zip(keys, stored, strict=True):
        data = block_path(tier, key).read_bytes()
        fs.verify_block(memoryview(data[:HEADER_BYTES]), key, memoryview(data[HEADER_BYTES:]))
        assert data[HEADER_BYTES:] == expected
    monkeypatch.setattr(files, "_native_fsio", paths[reader])
    async with opened(new_tier(disk_dir, 3 * PAGE)) as tier:
        assert f"path={reader}" in tier.statistics().detail
        wipe(views)
        assert await tier.load(keys, views) == [True] * 3
    assert snapshot(views) == stored


@pytest.mark.anyio
async def test_file_of_another_key_fails(disk_dir: Path, slots: Slots) -> None:
    async with opened(new_tier(disk_dir, PAGE)) as tier:
        key, view, path = await _stored_block(tier, slots)
        (other,) = keys_for(1)
        other_path = block_path(tier, other)
        other_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, other_path)
        assert await tier.lookup([other]) == [True]  # same size: only a load can tell
        await _assert_fails_and_is_gone(tier, other, view, other_path)
        assert await tier.load([key], [view]) == [True]


@pytest.mark.anyio
async def test_missing_file_is_a_plain_miss(disk_dir: Path, slots: Slots) -> None:
    (key,), (view,) = keys_for(1), slots.make(1, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.lookup([key]) == [False]
        assert await tier.load([key], [view]) == [False]


@pytest.mark.anyio
async def test_directory_in_place_of_a_block_is_unreadable_and_removed(
    disk_dir: Path, slots: Slots
) -> None:
    # Root ignores file modes, so a directory stands in for an unreadable file.
    async with opened(new_tier(disk_dir)) as tier:
        key, view, path = await _stored_block(tier, slots)
        path.unlink()
        path.mkdir()
        assert await tier.lookup([key]) == [False]
        await _assert_fails_and_is_gone(tier, key, view, path)


@pytest.mark.single_path
@pytest.mark.anyio
@pytest.mark.parametrize("seam", ["_open", "_preadv"])
async def test_io_error_on_load_fails_and_deletes(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, seam: str
) -> None:
    async with opened(new_tier(disk_dir)) as tier:
        key, view, path = await _stored_block(tier, slots)

        def fail(*args: Any) -> int:
            raise OSError(errno.EACCES if seam == "_open" else errno.EIO, "injected")

        monkeypatch.setattr(blockio, seam, fail)
        await _assert_fails_and_is_gone(tier, key, view, path)


@pytest.mark.anyio
async def test_store_remakes_directories_removed_under_it(disk_dir: Path, slots: Slots) -> None:
    keys = [make_offload_key(b"\xab\xcd\xe0" + os.urandom(29), 0) for _ in range(3)]
    views = slots.make(3, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys[:1], views[:1]) == [True]
        shutil.rmtree(block_path(tier, keys[0]).parents[1])  # <rank>/abc, which it knows
        assert await tier.store(keys[1:], views[1:]) == [True, True]
        assert await tier.lookup(keys) == [False, True, True]
        assert await tier.load(keys[1:], views[1:]) == [True, True]


@pytest.mark.anyio
async def test_wrong_sized_file_is_replaced_by_a_store(disk_dir: Path, slots: Slots) -> None:
    async with opened(new_tier(disk_dir)) as tier:
        key, view, path = await _stored_block(tier, slots)
        os.truncate(path, 10)
        assert await tier.store([key], [view]) == [True]
        assert path.stat().st_size == HEADER_BYTES + PAGE
        assert await tier.load([key], [view]) == [True]
        assert tier.take_removed() == [key]
        assert tier.statistics().removed_damaged == 1


@pytest.mark.anyio
@pytest.mark.parametrize("target", ["a good block", "nothing"])
async def test_a_symlink_in_place_of_a_block_is_unlinked_never_followed(
    disk_dir: Path, slots: Slots, target: str
) -> None:
    async with opened(new_tier(disk_dir)) as tier:
        key, view, path = await _stored_block(tier, slots)
        elsewhere = disk_dir / "elsewhere.bin"
        if target == "a good block":
            path.rename(elsewhere)  # the right bytes for this key, behind a link
        good = elsewhere.read_bytes() if elsewhere.exists() else None
        path.unlink(missing_ok=True)
        path.symlink_to(elsewhere)
        assert await tier.lookup([key]) == [False]  # a link is no block
        await _assert_fails_and_is_gone(tier, key, view, path)
        assert (elsewhere.read_bytes() if elsewhere.exists() else None) == good


class _Unblocker:
    """A fail-safe for code that might block opening a FIFO: if ``done`` is not set within
    ``WAIT_S``, open the FIFO for writing (which lets a blocked reader go on) and note it."""

    def __init__(self, fifo: Path) -> None:
        self.done = threading.Event()
        self.had_to = False
        self._fifo = fifo
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if not self.done.wait(WAIT_S):
            self.had_to = True
            with contextlib.suppress(OSError):
                os.close(os.open(self._fifo, os.O_WRONLY | os.O_NONBLOCK))

    def finish(self) -> bool:
        """Whether the code ran without the fail-safe."""
        self.done.set()
        self._thread.join(WAIT_S)
        return not self.had_to


@pytest.mark.anyio
async def test_a_fifo_in_place_of_a_block_is_a_miss_never_a_wait(
    disk_dir: Path, slots: Slots
) -> None:
    """Replaced between lookup and load: the load opens it without waiting for a writer,
    refuses it (not a regular file), removes it and reports the key, as for damage."""
    async with opened(new_tier(disk_dir)) as tier:
        key, view, path = await _stored_block(tier, slots)
        assert await tier.lookup([key]) == [True]
        path.unlink()
        os.mkfifo(path, 0o600)
        unblocker = _Unblocker(path)
        try:
            await _assert_fails_and_is_gone(tier, key, view, path)
        finally:
            assert unblocker.finish(), "the load waited on the FIFO"


@pytest.mark.anyio
@pytest.mark.single_path  # the tier's open, the same on both paths
@pytest.mark.parametrize("planted", ["fifo", "dev-zero-link", "directory", "sparse-8g", "deep"])
async def test_a_config_json_we_did_not_write_refuses_the_root_without_waiting(
    disk_dir: Path, planted: str
) -> None:
    ctx = TierContext(block_bytes=PAGE)
    async with opened(new_tier(disk_dir, ctx=ctx)) as tier:
        config = Path(tier.namespace_dir) / "config.json"
    config.unlink()
    unblocker = None
    if planted == "fifo":
        os.mkfifo(config, 0o600)
        unblocker = _Unblocker(config)
    elif planted == "dev-zero-link":
        config.symlink_to("/dev/zero")
    elif planted == "directory":
        config.mkdir(0o700)
    elif planted == "sparse-8g":
        with open(config, "wb") as f:
            f.truncate(8 << 30)
    else:
        config.write_text("[" * 100_000 + "]" * 100_000)
    try:
        with pytest.raises(fs_publish.UntrustedRootError, match=r"config\.json"):
            await new_tier(disk_dir, ctx=ctx).open()
    finally:
        if unblocker is not None:
            assert unblocker.finish(), "the open waited on the FIFO"


@pytest.mark.anyio
async def test_a_block_the_tier_holds_is_never_rewritten(disk_dir: Path, slots: Slots) -> None:
    """A key stored again (a cascade after a cache reset, another engine on the same root)
    keeps its file: same inode, same bytes, nothing written; the second store succeeds."""
    async with opened(new_tier(disk_dir)) as tier:
        key, view, path = await _stored_block(tier, slots)
        stored, inode = bytes(view), path.stat().st_ino
        written = tier.counters.written
        view[:] = bytes(255 - b for b in stored)  # other bytes under the same key
        assert await tier.store([key], [view]) == [True]
        assert path.stat().st_ino == inode
        assert (tier.counters.written, tier.counters.present) == (written, 1)
        wipe([view])
        assert await tier.load([key], [view]) == [True]
        assert bytes(view) == stored


@pytest.mark.anyio
async def test_a_store_replaces_a_symlink_at_the_block_name(disk_dir: Path, slots: Slots) -> None:
    async with opened(new_tier(disk_dir)) as tier:
        key, view, path = await _stored_block(tier, slots)
        stored = bytes(view)
        elsewhere = disk_dir / "elsewhere.bin"
        path.rename(elsewhere)  # a complete block file of the right size, behind a link
        path.symlink_to(elsewhere)
        assert await tier.store([key], [view]) == [True]
        assert not path.is_symlink() and path.is_file()
        assert tier.take_removed() == [key]
        assert tier.statistics().removed_damaged == 1
        wipe([view])
        assert await tier.load([key], [view]) == [True]
        assert bytes(view) == stored


@pytest.mark.anyio
async def test_removed_keys_beyond_the_queue_are_dropped_and_counted(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "REMOVED_QUEUE", 2)
    keys, views = keys_for(3), slots.make(3, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys, views) == [True] * 3
        for key in keys:
            os.truncate(block_path(tier, key), 10)
        assert await tier.load(keys, views) == [False] * 3
        assert tier.take_removed() == keys[1:]
        stats = tier.statistics()
        assert (stats.removed_damaged, stats.removed_unreported) == (3, 1)


def test_a_tier_reports_no_removals_by_default() -> None:
    tier = make_tier({"type": "memory"}, TierContext(block_bytes=PAGE), "secondary_tiers[0]")
    assert tier.take_removed() == []


# -- directories removed while running --------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("removed", ["root", "namespace", "rank"])
async def test_stores_remake_the_root_and_its_directories_removed_under_them(
    disk_dir: Path, slots: Slots, removed: str
) -> None:
    root = disk_dir / "root"
    keys, views = keys_for(4), slots.make(4, PAGE)
    stored = snapshot(views)
    async with opened(new_tier(root)) as tier:
        assert await tier.store(keys[:2], views[:2]) == [True, True]
        rank_dir = block_path(tier, keys[0]).parents[2]
        doomed = {"root": root, "namespace": rank_dir.parent, "rank": rank_dir}[removed]
        shutil.rmtree(doomed)
        # a known fan-out directory (keys[0]'s) and new ones, on the next store
        assert await tier.store(keys, views) == [True] * 4
        assert await tier.lookup(keys) == [True] * 4
        wipe(views)
        assert await tier.load(keys, views) == [True] * 4
        assert snapshot(views) == stored
        config = json.loads((rank_dir.parent / "config.json").read_text())
        assert config == json.loads(json.dumps(tier.ctx.namespace_fields()))
    assert_private(root)


# -- privacy ---------------------------------------------------------------------------------


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def assert_private(root: Path, file_mode: int = 0o600, dir_mode: int = 0o700) -> None:
    """Everything under ``root`` (and ``root``) has exactly these modes."""
    seen = {"dir": 0, "file": 0}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        want = dir_mode if kind == "dir" else file_mode
        assert stat.S_IMODE(st.st_mode) == want, f"{path}: {stat.S_IMODE(st.st_mode):04o}"
        seen[kind] += 1
    assert seen["dir"] >= 6 and seen["file"] >= 2  # root/a/ns/rank/fan-outs, config + blocks


@pytest.mark.anyio
@pytest.mark.parametrize("publish", ["rename", "linkat"])
async def test_everything_created_is_private_whatever_the_umask(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, publish: str
) -> None:
    use_publish(monkeypatch, publish)
    root = disk_dir / "a" / "root"  # the tier makes both
    keys, views = keys_for(3), slots.make(3, PAGE)
    with umask(0):
        async with opened(new_tier(root)) as tier:
            assert await tier.store(keys, views) == [True] * 3
    assert_private(disk_dir / "a")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mode", "file_mode", "dir_mode"),
    [("0640", 0o640, 0o750), ("group", 0o660, 0o770), (0o644, 0o644, 0o755)],
)
async def test_the_mode_option_shares_a_root_on_purpose(
    disk_dir: Path, slots: Slots, mode: str | int, file_mode: int, dir_mode: int
) -> None:
    root = disk_dir / "a" / "root"
    keys, views = keys_for(3), slots.make(3, PAGE)
    with umask(0o077):  # would narrow them: the tier sets them anyway
        async with opened(new_tier(root, mode=mode)) as tier:
            assert await tier.store(keys, views) == [True] * 3
            wipe(views)
            assert await tier.load(keys, views) == [True] * 3
    assert_private(disk_dir / "a", file_mode, dir_mode)


@pytest.mark.anyio
async def test_open_narrows_an_existing_namespace_directory(disk_dir: Path) -> None:
    disk_dir.chmod(0o755)  # the operator's root
    tier = new_tier(disk_dir)
    ns_dir = Path(tier.namespace_dir)
    ns_dir.mkdir(mode=0o755)
    ns_dir.chmod(0o755)  # as an older version left it
    async with opened(tier):
        assert stat.S_IMODE(ns_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(disk_dir.stat().st_mode) == 0o755  # not ours to change


# -- failed and cancelled stores -------------------------------------------------------------


@pytest.mark.single_path
@pytest.mark.anyio
@pytest.mark.parametrize("publish", PUBLISH_MODES)
async def test_injected_enospc_fails_the_key_and_leaves_nothing(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, publish: str
) -> None:
    use_publish(monkeypatch, publish)
    keys, views = keys_for(3), slots.make(3, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        real_pwritev = blockio._pwritev

        def full_for_second(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
            if bytes(buffers[-1][:16]) == bytes(views[1][:16]):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real_pwritev(fd, buffers, offset)

        monkeypatch.setattr(blockio, "_pwritev", full_for_second)
        assert await tier.store(keys, views) == [True, False, True]
        assert await tier.lookup(keys) == [True, False, True]
    assert temp_files(disk_dir) == []
    assert not block_path(tier, keys[1]).exists()


@contextlib.contextmanager
def tiny_tmpfs(size: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvtier-fs-tiny-"))
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=True)
    finally:
        path.rmdir()


@pytest.mark.anyio
async def test_real_enospc_on_a_full_file_system(slots: Slots) -> None:
    block_bytes = 64 << 10
    keys, views = keys_for(12), slots.make(12, block_bytes)
    stored = snapshot(views)
    with tiny_tmpfs("512k") as root:
        async with opened(new_tier(root, block_bytes)) as tier:
            results = [(await tier.store([key], [view]))[0] for key, view in zip(keys, views)]
            assert True in results and False in results
            assert await tier.lookup(keys) == results
            wipe(views)
            loaded = await tier.load(keys, views)
            assert loaded == results
            assert all(
                snapshot([view]) == [data] for view, data, ok in zip(views, stored, results) if ok
            )
        assert temp_files(root) == []
        sizes = {p.stat().st_size for p in files_under(root) if p.suffix == ".bin"}
        assert sizes == {HEADER_BYTES + block_bytes}


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fs store failed" in r.getMessage()]


@pytest.mark.anyio
async def test_a_full_file_system_shows_in_statistics_with_one_warning(
    slots: Slots, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk: one warning line for all its failed stores (the rest counted), the
    failures for lack of space counted, and ENOSPC as the last store error until a store
    succeeds again."""
    block_bytes = 64 << 10
    keys, views = keys_for(12), slots.make(12, block_bytes)
    with tiny_tmpfs("512k") as root, caplog.at_level(logging.WARNING, "kvtier_async.tiers.fs"):
        async with opened(new_tier(root, block_bytes)) as tier:
            assert tier.statistics().last_store_error == ""
            results = [(await tier.store([key], [view]))[0] for key, view in zip(keys, views)]
            failed = results.count(False)
            assert failed >= 2 and results[0]
            stats = tier.statistics()
            assert (stats.no_space_failures, stats.last_store_error) == (failed, "ENOSPC")
            assert len(store_warnings(caplog)) == 1 and "No space left" in caplog.text
            assert stats.warnings_suppressed == failed - 1
            os.unlink(block_path(tier, keys[0]))  # room for one block again
            retry = results.index(False)
            assert await tier.store([keys[retry]], [views[retry]]) == [True]
            stats = tier.statistics()
            assert (stats.no_space_failures, stats.last_store_error) == (failed, "")


@pytest.mark.single_path
@pytest.mark.anyio
async def test_store_errors_in_statistics_name_the_last_one(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys, views = keys_for(9), slots.make(9, PAGE)
    real_pwritev = blockio._pwritev
    error = [errno.ENOSPC]

    def failing(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        raise OSError(error[0], os.strerror(error[0]))

    with caplog.at_level(logging.WARNING, "kvtier_async.tiers.fs"):
        async with opened(new_tier(disk_dir)) as tier:
            monkeypatch.setattr(blockio, "_pwritev", failing)
            assert await tier.store(keys[:3], views[:3]) == [False] * 3
            stats = tier.statistics()
            assert (stats.no_space_failures, stats.last_store_error) == (3, "ENOSPC")
            error[0] = errno.EACCES
            assert await tier.store(keys[3:6], views[3:6]) == [False] * 3
            stats = tier.statistics()
            assert (stats.no_space_failures, stats.last_store_error) == (3, "EACCES")
            assert stats.warnings_suppressed == 5
            monkeypatch.setattr(blockio, "_pwritev", real_pwritev)
            assert await tier.store(keys[6:], views[6:]) == [True] * 3
            assert tier.statistics().last_store_error == ""
    assert len(store_warnings(caplog)) == 1


@pytest.mark.single_path
@pytest.mark.anyio
async def test_cancelled_store_leaves_only_complete_files(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, views = keys_for(8), slots.make(8, PAGE)
    real_pwritev = blockio._pwritev
    async with opened(new_tier(disk_dir)) as tier:
        with anyio.CancelScope() as scope:

            def cancel_then_write(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
                anyio.from_thread.run_sync(scope.cancel)
                return real_pwritev(fd, buffers, offset)

            monkeypatch.setattr(blockio, "_pwritev", cancel_then_write)
            await tier.store(keys, views)
        assert scope.cancel_called  # whether the call then raised depends on the backend
        monkeypatch.setattr(blockio, "_pwritev", real_pwritev)
        present = await tier.lookup(keys)
        assert temp_files(disk_dir) == []
        wipe(views)
        assert await tier.load(keys, views) == present


# -- restart, leftovers, namespaces ----------------------------------------------------------


@pytest.mark.anyio
async def test_a_new_instance_finds_stored_blocks(disk_dir: Path, slots: Slots) -> None:
    keys, views = keys_for(4), slots.make(4, PAGE)
    stored = snapshot(views)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys, views) == [True] * 4
    wipe(views)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.lookup(keys) == [True] * 4
        assert await tier.load(keys, views) == [True] * 4
        assert await tier.store(keys, views) == [True] * 4
        assert (tier.counters.written, tier.counters.present) == (0, 4)  # nothing written
    assert snapshot(views) == stored


@pytest.mark.anyio
async def test_config_json_records_the_namespace_fields(disk_dir: Path) -> None:
    ctx = TierContext(block_bytes=PAGE, model="org/My Model", dtype="bfloat16")
    async with opened(new_tier(disk_dir, ctx=ctx)) as tier:
        config = Path(tier.namespace_dir) / "config.json"
        assert json.loads(config.read_text()) == ctx.namespace_fields()
    async with opened(new_tier(disk_dir, ctx=ctx)):
        pass  # an existing config.json is kept
    assert json.loads(config.read_text()) == ctx.namespace_fields()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "other",
    [
        {"dtype": "bfloat16"},
        {"block_tokens": 32},
        {"model": "another-model"},
        {"tp_size": 2},
        {"rank": 1},
    ],
)
async def test_another_context_does_not_see_the_blocks(
    disk_dir: Path, slots: Slots, other: dict[str, Any]
) -> None:
    keys, views = keys_for(2), slots.make(2, PAGE)
    base = TierContext(block_bytes=PAGE)
    async with opened(new_tier(disk_dir, ctx=base)) as tier:
        assert await tier.store(keys, views) == [True, True]
    changed = TierContext(**{**base.__dict__, **other})
    async with opened(new_tier(disk_dir, ctx=changed)) as tier:
        assert await tier.lookup(keys) == [False, False]
        assert await tier.load(keys, views) == [False, False]


def _temp_name(token: str, pid: int, start: int) -> str:
    return f".{'ab' * 32}.{token}-{pid}-{start}-0.tmp"


def _crash_with_a_temp_file(directory: Path) -> None:
    """A process that creates a named temporary as a store does, then dies at once."""
    code = (
        "import os, sys; from kvtier_async.tiers.fs import publish; "
        "fd, name = publish.create_file(sys.argv[1], 'rename', False); "
        "os.write(fd, b'partial'); print(name, flush=True); os._exit(1)"
    )
    src = str(Path(fs.__file__).parents[3])
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run(
        [sys.executable, "-c", code, str(directory)], capture_output=True, env=env, check=False
    )
    assert done.returncode == 1, done.stderr
    name = done.stdout.decode().strip()
    assert name and Path(name).is_file(), done.stderr


@pytest.mark.anyio
async def test_open_removes_only_temp_files_of_dead_writers(disk_dir: Path) -> None:
    tier = new_tier(disk_dir)
    rank_dir = Path(tier.namespace_dir) / "r0"
    leaf = rank_dir / "abc" / "de_g0"
    leaf.mkdir(parents=True)
    _crash_with_a_temp_file(leaf)
    me = await anyio.to_thread.run_sync(tempfiles.identity)
    peer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip
    try:
        peer_start = await anyio.to_thread.run_sync(tempfiles.process_start, peer.pid)
        assert peer_start is not None
        names = {
            "live peer": _temp_name(me.token, peer.pid, peer_start),
            "this process": _temp_name(me.token, me.pid, me.start),
            "reused pid": _temp_name(me.token, me.pid, me.start + 1),
            "other host": _temp_name("0badf00d", 1, 1),
        }
        for name in names.values():
            (leaf / name).write_bytes(b"x")
        async with opened(tier):
            left = {p.name for p in temp_files(disk_dir)}
        assert left == {names["live peer"], names["this process"], names["other host"]}
    finally:
        assert peer.stdin is not None
        peer.stdin.close()
        peer.wait(WAIT_S)
    async with opened(new_tier(disk_dir)):  # the peer is gone now
        left = {p.name for p in temp_files(disk_dir)}
    assert left == {names["this process"], names["other host"]}


# -- sharing one root ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("publish", PUBLISH_MODES)
async def test_two_instances_store_the_same_keys_at_once(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, publish: str
) -> None:
    use_publish(monkeypatch, publish)
    keys, views = keys_for(16), slots.make(16, PAGE)
    stored = snapshot(views)
    results: list[list[bool]] = []
    async with opened(new_tier(disk_dir)) as one, opened(new_tier(disk_dir)) as two:

        async def store(tier: FsTier) -> None:
            results.append(await tier.store(keys, views))

        async with anyio.create_task_group() as tg:
            tg.start_soon(store, one)
            tg.start_soon(store, two)
        assert results == [[True] * 16] * 2
        wipe(views)
        assert await two.load(keys, views) == [True] * 16
    assert snapshot(views) == stored
    assert temp_files(disk_dir) == []


def _block_data(seed: int, index: int, block_bytes: int) -> bytes:
    return (seed * 1000 + index).to_bytes(8, "big") * (block_bytes // 8)


def _aligned_views(count: int, block_bytes: int) -> tuple[mmap.mmap, list[memoryview]]:
    buf = mmap.mmap(-1, count * block_bytes)
    return buf, [memoryview(buf)[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]


def _writer(root: str, keys: list[bytes], block_bytes: int, barrier: Barrier) -> None:
    _buf, views = _aligned_views(len(keys), block_bytes)
    for i, view in enumerate(views):
        view[:] = _block_data(7, i, block_bytes)

    async def main() -> None:
        async with opened(new_tier(Path(root), block_bytes)) as tier:
            barrier.wait(WAIT_S)
            assert await tier.store(keys, views) == [True] * len(keys)

    anyio.run(main)


def _reader(
    root: str, keys: list[bytes], block_bytes: int, barrier: Barrier, done: Event, out: Any
) -> None:
    _buf, views = _aligned_views(len(keys), block_bytes)
    checks = 0

    async def main() -> None:
        nonlocal checks
        async with opened(new_tier(Path(root), block_bytes)) as tier:
            barrier.wait(WAIT_S)
            while True:
                finished = done.is_set()
                for i, found in enumerate(await tier.lookup(keys)):
                    if found:
                        assert await tier.load([keys[i]], [views[i]]) == [True]
                        assert bytes(views[i]) == _block_data(7, i, block_bytes)
                        checks += 1
                if finished:
                    return

    anyio.run(main)
    out.put(checks)


def test_two_processes_sharing_a_root_never_see_a_torn_file(disk_dir: Path) -> None:
    block_bytes, keys = 64 << 10, keys_for(64)
    barrier, done, out = CTX.Barrier(3), CTX.Event(), CTX.Queue()
    writers = [
        CTX.Process(target=_writer, args=(str(disk_dir), keys, block_bytes, barrier))
        for _ in range(2)
    ]
    reader = CTX.Process(
        target=_reader, args=(str(disk_dir), keys, block_bytes, barrier, done, out)
    )
    for proc in [*writers, reader]:
        proc.start()
    for proc in writers:
        proc.join(WAIT_S)
    done.set()
    reader.join(WAIT_S)
    for proc in [*writers, reader]:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert [p.exitcode for p in [*writers, reader]] == [0, 0, 0]
    assert out.get(timeout=WAIT_S) >= len(keys)  # the final pass saw every block
    assert temp_files(disk_dir) == []


# -- names, lookups, capacity ----------------------------------------------------------------


ODD_KEYS = [
    b"../../../etc/passwd" + bytes(4),
    b"/\x00\\..\n" + (7).to_bytes(4, "big"),
    b"\xff" * 40 + (2**32 - 1).to_bytes(4, "big"),
    b"a" + (1).to_bytes(4, "big"),
]


@pytest.mark.anyio
async def test_odd_keys_make_only_hex_names_under_the_root(disk_dir: Path, slots: Slots) -> None:
    ctx = TierContext(block_bytes=PAGE, model="../../evil/model\x00")
    views = slots.make(len(ODD_KEYS), PAGE)
    async with opened(new_tier(disk_dir, ctx=ctx)) as tier:
        assert await tier.store(ODD_KEYS, views) == [True] * len(ODD_KEYS)
        assert await tier.lookup(ODD_KEYS) == [True] * len(ODD_KEYS)
        namespace = tier.ctx.namespace
    assert "/" not in namespace and namespace not in (".", "..")
    blocks = [p for p in files_under(disk_dir) if p.suffix == ".bin"]
    assert len(blocks) == len(ODD_KEYS)
    for path in blocks:
        rel = path.relative_to(disk_dir / namespace / "r0")
        assert re.fullmatch(r"[0-9a-f]{1,3}/[0-9a-f]{0,2}_g\d+/[0-9a-f]+\.bin", str(rel)), rel


@pytest.mark.anyio
async def test_malformed_keys_fail_alone(disk_dir: Path, slots: Slots) -> None:
    good, bad = keys_for(1)[0], b"\x01\x02"
    views = slots.make(2, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store([bad, good], views) == [False, True]
        assert await tier.lookup([bad, good]) == [False, True]
        assert await tier.load([bad, good], views) == [False, True]


@pytest.mark.anyio
async def test_lookups_are_one_thread_call_per_batch_and_loads_are_chunked(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, io_path: str
) -> None:
    calls: list[int] = []
    real_run_sync = anyio.to_thread.run_sync

    async def counting(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[0]) if args else 0)
        return await real_run_sync(fn, *args, **kwargs)

    block_bytes = 2 << 20  # MIN_CHUNK_BYTES (4 MiB) = 2 blocks per thread call
    keys, views = keys_for(12), slots.make(12, block_bytes, fill=False)
    tier = FsTier("chunks", TierContext(block_bytes=block_bytes), 4, 4, root_dir=disk_dir)
    async with opened(tier):
        monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
        await tier.lookup(keys_for(100))
        assert calls == [100]
        calls.clear()
        assert await tier.store(keys[:2], views[:2]) == [True] * 2
        assert calls == [2]
        calls.clear()
        assert await tier.store(keys, views) == [True] * 12
        if io_path == "python":
            assert calls == [3, 3, 3, 3]  # at most one chunk per worker
        else:  # one call; the C pool's 4 writers share its blocks
            assert calls == [12]
            assert pool_threads("chunks") == {"kvfs-w-chunks": 4}


@pytest.mark.anyio
async def test_a_native_lookup_batch_makes_no_system_call_from_python(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, io_path: str
) -> None:
    """Each ``lstat`` made from Python gives the GIL up and waits to take it back: with the
    C helper a batch is one call. Its answers are the Python path's (the tests above run on
    both): present, absent, a link, a directory, a file of another size."""
    keys, views = keys_for(5), slots.make(5, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys[:4], views[:4]) == [True] * 4
        paths = [Path(tier._ready().path(key)) for key in keys]
        paths[1].unlink()
        paths[1].symlink_to(paths[0])
        paths[2].unlink()
        paths[2].mkdir()
        with paths[3].open("ab") as extra:
            extra.write(b"x")
        python_calls: list[str] = []
        real_lstat = os.lstat

        def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            python_calls.append(str(path))
            return real_lstat(path, *args, **kwargs)

        monkeypatch.setattr(files.os, "lstat", counting)
        assert await tier.lookup(keys) == [True, False, False, False, False]
        assert (python_calls == []) == (io_path == "native"), python_calls


@pytest.mark.anyio
@pytest.mark.parametrize("mode", [None, 0o640])
async def test_a_native_store_batch_makes_its_directories_in_one_call(
    disk_dir: Path, slots: Slots, monkeypatch: pytest.MonkeyPatch, io_path: str, mode: int | None
) -> None:
    """The new directories of a store batch (a block's two levels, as a rule) are made by
    the C helper, with the tier's directory mode, and none by a ``mkdir`` from Python; one
    whose rank directory is gone too is made by the Python path (which knows the parents)."""
    keys, views = keys_for(16), slots.make(16, PAGE)
    options = {} if mode is None else {"mode": mode}
    python_calls: list[str] = []
    real_mkdir = os.mkdir

    def counting(path: Any, *args: Any, **kwargs: Any) -> None:
        python_calls.append(str(path))
        real_mkdir(path, *args, **kwargs)

    async with opened(new_tier(disk_dir, **options)) as tier:
        monkeypatch.setattr(fs_publish.os, "mkdir", counting)
        assert await tier.store(keys[:8], views[:8]) == [True] * 8
        assert (python_calls == []) == (io_path == "native"), python_calls
        want = 0o700 if mode is None else 0o750
        for key in keys[:8]:
            leaf = Path(tier._ready().path(key)).parent
            for directory in (leaf, leaf.parent):
                assert stat.S_IMODE(directory.stat().st_mode) == want, directory
        rank_dir = Path(tier._ready().path(keys[0])).parent.parent.parent
        shutil.rmtree(rank_dir)
        python_calls.clear()
        assert await tier.store(keys[8:], views[8:]) == [True] * 8
        assert str(rank_dir) in python_calls  # made again by the Python path
        assert await tier.lookup(keys) == [False] * 8 + [True] * 8


def pool_threads(tier: str) -> dict[str, int]:
    """This process's threads of the C pools of the tier named ``tier``, counted by name."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            names.append((task / "comm").read_text().strip())
    ours = (f"kvfs-r-{tier}", f"kvfs-w-{tier}")
    return dict(collections.Counter(name for name in names if name in ours))


@pytest.mark.anyio
async def test_the_c_pools_start_at_first_use_with_the_worker_counts_and_stop_at_close(
    disk_dir: Path, slots: Slots, io_path: str
) -> None:
    keys, views = keys_for(9), slots.make(9, PAGE)
    tier = FsTier("pools", TierContext(block_bytes=PAGE), 3, 5, root_dir=disk_dir)
    async with opened(tier):
        assert await tier.lookup(keys) == [False] * 9
        assert pool_threads("pools") == {}  # lookups start no pool
        assert await tier.store(keys, views) == [True] * 9
        want_writers = {} if io_path == "python" else {"kvfs-w-pools": 5}
        assert pool_threads("pools") == want_writers
        assert await tier.load(keys, views) == [True] * 9
        want_all = {} if io_path == "python" else {"kvfs-r-pools": 3, "kvfs-w-pools": 5}
        assert pool_threads("pools") == want_all
    # aclose joined them; a joined thread can stay listed in /proc for a moment after its
    # exit (the kernel reaps it after waking the joiner), longer on a loaded machine
    deadline = time.monotonic() + 30
    while pool_threads("pools") and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    assert pool_threads("pools") == {}


@pytest.mark.anyio
async def test_max_bytes_evicts_the_least_recently_used(disk_dir: Path, slots: Slots) -> None:
    file_bytes = HEADER_BYTES + PAGE
    keys, views = keys_for(5), slots.make(5, PAGE)
    async with opened(new_tier(disk_dir, max_bytes=3 * file_bytes)) as tier:
        assert await tier.store(keys[:3], views[:3]) == [True] * 3
        assert await tier.load(keys[:1], views[:1]) == [True]  # key 0 is now the newest
        assert await tier.store(keys[3:4], views[3:4]) == [True]
        assert await tier.lookup(keys[:4]) == [True, False, True, True]
        assert await tier.lookup(keys[:1]) == [True]  # lookups do not count as use
        assert await tier.store(keys[4:], views[4:]) == [True]
        assert await tier.lookup(keys) == [True, False, False, True, True]
        assert "evicted=2" in tier.statistics().detail
        assert tier.take_removed() == [keys[1], keys[2]]
        assert tier.statistics().removed_evicted == 2


@pytest.mark.anyio
async def test_max_bytes_is_rebuilt_from_mtimes_at_open(disk_dir: Path, slots: Slots) -> None:
    file_bytes = HEADER_BYTES + PAGE
    keys, views = keys_for(4), slots.make(4, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys, views) == [True] * 4
        paths = [block_path(tier, key) for key in keys]
    for age, path in zip([10, 40, 20, 30], paths):  # oldest: key 1, then 3, 2, 0
        os.utime(path, ns=(0, (1_000_000 - age) * 10**9))
    async with opened(new_tier(disk_dir, max_bytes=2 * file_bytes)) as tier:
        assert await tier.lookup(keys) == [True, False, True, False]
        assert "evicted=2" in tier.statistics().detail
        assert tier.take_removed() == [keys[1], keys[3]]


@pytest.mark.anyio
async def test_max_bytes_below_one_file_fails_each_store_alone(
    disk_dir: Path, slots: Slots
) -> None:
    """Built directly (the config refuses such a limit), every store fails by itself."""
    keys, views = keys_for(2), slots.make(2, PAGE)
    async with opened(new_tier(disk_dir, max_bytes=PAGE)) as tier:
        assert await tier.store(keys, views) == [False, False]
        assert await tier.lookup(keys) == [False, False]


@pytest.mark.anyio
async def test_without_max_bytes_nothing_is_deleted(disk_dir: Path, slots: Slots) -> None:
    keys, views = keys_for(20), slots.make(20, PAGE)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys, views) == [True] * 20
        assert await tier.lookup(keys) == [True] * 20
        assert "capacity=unlimited" in tier.statistics().detail


# -- configuration and open errors -----------------------------------------------------------


def _config(**fields: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": "/var/tmp/kvtier-never-created", **fields}


def test_config_builds_the_tier() -> None:
    ctx = TierContext(block_bytes=PAGE)
    config = _config(name="disk", n_read_workers=8, n_write_workers=2, max_bytes=1 << 30,
                     fsync=True)  # fmt: skip
    tier = make_tier(config, ctx, "secondary_tiers[1]")
    assert isinstance(tier, FsTier)
    assert (tier.name, tier.read_workers, tier.write_workers) == ("disk", 8, 2)
    assert (tier.max_bytes, tier.fsync) == (1 << 30, True)
    assert tier.root_dir == "/var/tmp/kvtier-never-created"
    default = make_tier(_config(), ctx, "secondary_tiers[0]")
    assert isinstance(default, FsTier)
    assert (default.name, default.max_bytes, default.fsync) == ("fs[0]", None, False)
    assert default.mode == 0o600
    for value, mode in [("0640", 0o640), ("660", 0o660), ("0o644", 0o644), (0o600, 0o600),
                        ("private", 0o600), ("group", 0o660)]:  # fmt: skip
        assert make_tier(_config(mode=value), ctx, "t").mode == mode


def test_a_bad_mode_argument_names_it() -> None:
    with pytest.raises(ValueError, match=r"^mode must be a file mode"):
        new_tier(Path("/var/tmp/kvtier-never-created"), mode=0o777)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"type": "fs"}, "root_dir"),
        (_config(root_dir=""), "root_dir"),
        (_config(root_dir=3), "root_dir"),
        (_config(root_dir="/tmp/a\x00b"), "root_dir"),
        (_config(rootdir="/tmp"), "rootdir"),
        (_config(n_read_workers=0), "n_read_workers"),
        (_config(n_read_workers="4"), "n_read_workers"),
        (_config(n_write_workers=True), "n_write_workers"),
        (_config(max_bytes=-1), "max_bytes"),
        (_config(max_bytes=100), "max_bytes"),
        (_config(max_bytes="1G"), "max_bytes"),
        (_config(fsync="yes"), "fsync"),
        (_config(mode="0700"), "mode"),  # no x bits
        (_config(mode="0400"), "mode"),  # the owner must write
        (_config(mode="0o4600"), "mode"),  # no setuid
        (_config(mode="rw-------"), "mode"),
        (_config(mode="shared"), "mode"),
        (_config(mode=True), "mode"),
        (_config(mode=1.5), "mode"),
    ],
)
def test_config_errors_name_the_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_tier(config, TierContext(block_bytes=PAGE), "secondary_tiers[0]")
    assert info.value.field == f"secondary_tiers[0].{field}"


@pytest.mark.anyio
async def test_open_fails_clearly_when_root_dir_is_a_file(disk_dir: Path) -> None:
    root = disk_dir / "a-file"
    root.write_bytes(b"")
    with pytest.raises(OSError, match=r"root_dir .* is unusable"):
        await new_tier(root).open()


@pytest.mark.anyio
async def test_calls_before_open_raise(disk_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="not open"):
        await new_tier(disk_dir).lookup(keys_for(1))


# -- the C helper ----------------------------------------------------------------------------


@pytest.mark.single_path
def test_native_crc32c_folds_where_the_cpu_can() -> None:
    """Where a C compiler is and the CPU has AVX-512 and VPCLMULQDQ, the helper loads (it
    passed its check against the crc32c package: a wrong fold would lose the C path) and
    folds."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    if not {"avx512f", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= set(flags):
        pytest.skip("this CPU cannot fold CRC-32C with VPCLMULQDQ")
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler here")
    helper = fs_native.native_fsio()
    assert helper is not None
    assert helper.folding_crc and "+vpclmulqdq" in helper.describe()


@pytest.mark.single_path
@pytest.mark.parametrize(
    "length",
    [0, 1, 7, 8, 9, 63, 64, 255, 256, 257, 271, 447, 448, 449, 511, 767, 768, 769, 1000,
     3 * 8192 - 1, 3 * 8192, 3 * 8192 + 771, (256 << 10) + 77, 1 << 20],
)  # fmt: skip
def test_native_crc32c_matches_the_crc32c_package(length: int, native: fs_native.FsIo) -> None:
    """Around every stride of the interleaved loops and of the folding ones (256, 64 and 16
    bytes, from 256 bytes on), at every alignment mod 8."""
    data = os.urandom(length + 8)
    buffer = ctypes.create_string_buffer(data, len(data))
    for start in range(8):
        expected = crc32c.crc32c(data[start : start + length])
        assert native.crc32c(ctypes.addressof(buffer) + start, length) == expected


@pytest.mark.single_path
@pytest.mark.anyio
async def test_the_c_helper_writes_the_header_python_packs(
    disk_dir: Path, slots: Slots, native: fs_native.FsIo
) -> None:
    """Byte for byte: the C store fills in the sums of the header Python laid out, and the
    page equals the one `pack_header` makes for the same key and payload."""
    keys, views = keys_for(3), slots.make(3, 3 * PAGE)
    async with opened(new_tier(disk_dir, 3 * PAGE)) as tier:
        assert "path=native" in tier.statistics().detail
        assert await tier.store(keys, views) == [True] * 3
    for key, view in zip(keys, views, strict=True):
        page = memoryview(bytearray(HEADER_BYTES))
        fs.pack_header(page, key, view)
        assert block_path(tier, key).read_bytes()[:HEADER_BYTES] == bytes(page)


def _with_field_changed(data: bytes, name: str) -> bytes:
    """``data`` (a block file) with one bit of header field ``name`` flipped and the header
    checksum made right again, so only that field's check can fail."""
    spot = blockfile.field(name).offset
    page = bytearray(data[:HEADER_BYTES])
    page[spot] ^= 0x01
    page[blockfile.HEADER_SUM_AT :] = checksum(page[: blockfile.HEADER_SUM_AT]).to_bytes(
        8, "little"
    )
    return bytes(page) + data[HEADER_BYTES:]


@pytest.mark.anyio
@pytest.mark.parametrize("name", [f.name for f in blockfile.FIELDS])
async def test_every_header_field_is_checked_as_the_python_verifier_does(
    disk_dir: Path, slots: Slots, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    """For each field of the layout, on both I/O paths, a load passes or fails with the
    verdict `verify_block` gives: the C side reads every offset from the same table."""
    async with opened(new_tier(disk_dir, 2 * PAGE)) as tier:
        key, view, path = await _stored_block(tier, slots)
        damaged = _with_field_changed(path.read_bytes(), name)
        path.write_bytes(damaged)
        try:
            fs.verify_block(
                memoryview(damaged[:HEADER_BYTES]), key, memoryview(damaged[HEADER_BYTES:])
            )
            verdict = None
        except fs.CorruptBlockError as exc:
            verdict = str(exc)
        assert (verdict is None) == (blockfile.field(name).check is None)
        with caplog.at_level(logging.WARNING, logger="kvtier_async.tiers.fs"):
            assert await tier.load([key], [view]) == [verdict is None]
    errors = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert errors == ([] if verdict is None else [errors[0]])
    if verdict is not None:
        assert f"error={verdict!r}" in errors[0]


@pytest.mark.single_path
def test_the_c_code_writes_no_header_offset_of_its_own() -> None:
    """The store and load loops take every offset, size and code from the generated header:
    no integer literal but 0 and 1 is left in them."""
    code = (Path(fs_native.__file__).parent / "_fsio.c").read_text()
    loops = code[code.index("static void store_one") : code.index("static void run_one")]
    loops = re.sub(r"/\*.*?\*/", "", loops, flags=re.DOTALL)
    assert set(re.findall(r"(?<![\w.])\d+(?![\w.])", loops)) <= {"0", "1"}
    assert '#include "_fsio_defs.h"' in code
    header = native_source.generated_header()
    for f in blockfile.FIELDS:
        assert f"#define KVB_{f.name.upper()}_AT {f.offset}\n" in header


@pytest.mark.single_path
def test_without_its_helper_the_python_path_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVTIER_NATIVE_FS", raising=False)
    monkeypatch.setenv("KVTIER_NATIVE_DIR", str(tmp_path))  # as if built without a compiler
    with caplog.at_level(logging.INFO, logger="kvtier_async.tiers.fs.native"):
        assert fs_native.native_fsio.__wrapped__() is None
    assert "native fs I/O unavailable" in caplog.text
    monkeypatch.delenv("KVTIER_NATIVE_DIR")
    monkeypatch.setenv("KVTIER_NATIVE_FS", "0")
    assert fs_native.native_fsio.__wrapped__() is None


@pytest.mark.single_path
def test_closing_a_pool_waits_for_the_batches_in_flight(native: fs_native.FsIo) -> None:
    pool = native.pool(2, "kvfs-r-waits")
    assert pool is not None and pool.threads == 2
    assert pool_threads("waits") == {"kvfs-r-waits": 2}
    closer = threading.Thread(target=pool.close)
    with pool.use():
        closer.start()
        with pool._idle:  # close() takes the handle away, then waits for this batch
            assert pool._idle.wait_for(lambda: pool._handle is None, timeout=WAIT_S)
        assert closer.is_alive()  # it cannot return while a batch is in flight
        assert pool_threads("waits") == {"kvfs-r-waits": 2}
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert pool_threads("waits") == {}
    with pytest.raises(fs_native.PoolClosedError, match="kvfs-r-waits"), pool.use():
        pass
    pool.close()  # twice is harmless


@pytest.mark.single_path
@pytest.mark.anyio
async def test_batches_run_in_the_callers_thread_when_the_pools_are_gone(
    disk_dir: Path, slots: Slots, native: fs_native.FsIo
) -> None:
    keys, views = keys_for(6), slots.make(6, PAGE)
    expected = snapshot(views)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys[:3], views[:3]) == [True] * 3
        files = tier._ready()
        await anyio.to_thread.run_sync(files.workers.close)  # as if closed under a call
        assert await tier.store(keys[3:], views[3:]) == [True] * 3
        wipe(views)
        assert await tier.load(keys, views) == [True] * 6
        assert snapshot(views) == expected
        assert tier.statistics().detail.count("path=native") == 1


@pytest.mark.single_path
@pytest.mark.anyio
async def test_no_pool_thread_starting_leaves_the_batches_in_the_callers_thread(
    disk_dir: Path,
    slots: Slots,
    native: fs_native.FsIo,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(type(native), "pool", lambda self, threads, name: None)
    keys, views = keys_for(4), slots.make(4, PAGE)
    expected = snapshot(views)
    with caplog.at_level(logging.WARNING, logger="kvtier_async.tiers.fs"):
        async with opened(FsTier("nopool", TierContext(block_bytes=PAGE), 2, 2,
                                 root_dir=disk_dir)) as tier:  # fmt: skip
            assert await tier.store(keys, views) == [True] * 4
            wipe(views)
            assert await tier.load(keys, views) == [True] * 4
    assert snapshot(views) == expected
    assert pool_threads("nopool") == {}
    assert caplog.text.count("no worker thread started") == 2  # once per pool, not per batch


@pytest.mark.single_path
@pytest.mark.anyio
async def test_a_forked_child_loads_without_the_parents_pool_threads(
    disk_dir: Path, slots: Slots, native: fs_native.FsIo
) -> None:
    keys, views = keys_for(4), slots.make(4, PAGE)
    expected = snapshot(views)
    async with opened(new_tier(disk_dir)) as tier:
        assert await tier.store(keys, views) == [True] * 4  # the write pool runs now
        files = tier._ready()
        wipe(views)
        pid = os.fork()
        if pid == 0:  # the child: no pool threads here; a wait on them would hang
            try:
                good = files.load_many(keys, views) == [1] * 4 and snapshot(views) == expected
                stored = files.store_many(keys_for(2), views[:2]) == [2, 2]
                os._exit(0 if good and stored else 1)
            finally:
                os._exit(2)
        pidfd = os.pidfd_open(pid)
        try:
            with anyio.move_on_after(WAIT_S):
                await anyio.wait_readable(pidfd)  # the child has exited
        finally:
            os.close(pidfd)
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child did not finish in {WAIT_S} s")
        assert os.waitstatus_to_exitcode(status) == 0
        assert snapshot(views) == expected  # the child loaded into the shared slots


@pytest.mark.single_path
def test_a_pool_of_the_most_workers_the_config_allows_starts_whole(
    native: fs_native.FsIo,
) -> None:
    pool = native.pool(1024, "kvfs-w-most")  # n_*_workers: at most 1024
    assert pool is not None
    try:
        assert pool.threads == 1024
        assert pool_threads("most") == {"kvfs-w-most": 1024}
    finally:
        pool.close()
    assert pool_threads("most") == {}
