"""The file-system secondary tier: one checksummed file per block, O_DIRECT where possible.

Theory of operation
-------------------
*Layout.* Block ``key`` lives at ``<root_dir>/`` + `block_relpath` (``<model>_<digest>/r<rank>/
<hhh>/<hh>_g<group>/<hex key>.bin``), and ``<root_dir>/<model>_<digest>/config.json`` records
``ctx.namespace_fields()``. Every name below the root is built from hex digits and the
sanitised namespace, so no key can escape the root; another digest is another namespace.

*File format* (`pack_header`, `verify_block`; the obj tier's objects use it too). A block
file is one 4096-byte header page, then the payload (``block_bytes``). The header holds the
magic, format version, header size, payload length, payload checksum, checksum of the key
and checksum name, and in the page's last 8 bytes a checksum of the rest of the page. The payload
starts page-aligned, so an O_DIRECT ``preadv`` fills [a page-aligned header buffer, the slot]
in one call and an O_DIRECT ``pwritev`` writes both from there: no staging copy. A load
verifies everything before it reports success, so a torn, truncated, corrupt or misplaced file
is never handed out.

*Store.* Skip when a complete file is there. Otherwise write header + payload in one call to a
new file in the target directory, optionally ``fsync``, and publish it atomically, so the name
appears only with the whole content behind it: by default a named temporary
(``.<hex>.<host>-<pid>-<start>-<seq>.tmp``, created ``O_CREAT | O_EXCL``) moved into place
with ``os.replace`` (another writer's copy of the same key holds the same bytes); or, per
`PUBLISH_ORDER`, an anonymous ``O_TMPFILE`` linked in with ``linkat`` (``AT_EMPTY_PATH`` or
``/proc/self/fd``), which never replaces a file. On any error the temporary is gone
(unlinked, or never linked) and only that key fails.

*Load.* Read into the slot itself, opened ``O_NOFOLLOW``; on a short read, a file of the
wrong size, a bad header or a checksum mismatch the key fails and its file is deleted
(only if it is still the file that was read), so later lookups answer False; a symbolic
link is never followed, only unlinked. A missing file is a plain miss. Lookups ``lstat``:
a link is no block.

*Removals are reported.* Every block file the tier deletes on its own (it failed
verification on a load, was a wrong-sized file or a link found by a store, or was evicted
for ``max_bytes``) is counted in `FsTierStatistics` and its key queued for
`FsTier.take_removed` (the owner turns them into KV events; at most `REMOVED_QUEUE` keys
wait, older ones are dropped and counted).

*Privacy.* Prompt-derived data is private by default: every file the tier creates (block
files and their temporaries, on both I/O paths; ``config.json``; probes) is mode 0600 and
every directory (the root if missing, the namespace, rank and fan-out directories) 0700,
whatever the umask (which can only narrow them). The ``mode`` option widens them for a
root shared between users on purpose (``"0640"``, ``"0660"`` or ``"group"``...):
directories get an x bit for each class that may read or write, and both are set with
``fchmod``/``chmod`` after creation, since the umask may have narrowed them. ``open``
narrows an existing namespace directory of this user to the directory mode, so blocks
written by older versions become private too.

*Directories come back.* The tier remembers which directories exist, so a new fan-out
directory costs one ``mkdir``. If an operator removes the root, the namespace or a rank
directory while it runs, the next store's create fails with ``ENOENT``: the tier forgets
what it knew, makes every missing level again (``config.json`` with a new namespace
directory) and retries that block once, on both I/O paths.

*Probe.* `FsTier.open` creates the directories (see *Privacy*), writes ``config.json``,
then, in the rank directory, picks the first way to publish in `PUBLISH_ORDER` that works
and checks that an O_DIRECT write and read work; it falls back to buffered I/O where the
file system refuses (older tmpfs, overlayfs, some NFS). `FsTier.statistics` tells which in
``detail``. A block whose memory is not page-aligned is moved with buffered I/O.

*Leftovers.* ``open`` deletes named temporaries of dead processes in its rank directory and
namespace directory. A temporary's name carries its writer's host token, pid and process start
time, so a live peer's file in progress is left alone, pid reuse is recognised, and files of
other hosts or pid namespaces are never judged.

*Capacity.* With ``max_bytes`` the tier keeps its own access record (stores and loads, not
lookups; never ``atime``), rebuilt at ``open`` from a scan of its rank directory ordered by
``mtime``, and deletes least-recently-used files before a store would exceed the limit. The
record covers what this process has seen: blocks a live peer adds later count once this
process touches them. Without ``max_bytes`` nothing is deleted but corrupt files.

*Threads.* Every system call runs off the event loop, under two `anyio.CapacityLimiter`\\ s
sized ``read_workers`` and ``write_workers``; lookups are one worker-thread call per batch.
The blocking half (`_BlockFiles`) is plain synchronous code, safe to call from many threads.
When the C helper `kvtier_async.tiers._fsio` could be built and files are published by
rename, a load or store batch is one worker-thread call that hands the file work to the
helper's pool of ``read_workers`` or ``write_workers`` C threads (started at the first
batch, joined by `FsTier.aclose`), which move its blocks in parallel with no GIL held.
Otherwise the Python path runs the same steps, the batch split into chunks of at least
`MIN_CHUNK_BYTES`, at most one per worker (``path=`` in ``detail`` says which).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import functools
import hashlib
import itertools
import json
import mmap
import os
import re
import socket
import stat
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.to_thread
import numpy as np

from kvtier_async._log import get_logger
from kvtier_async.config import ConfigError, Section
from kvtier_async.ledger import make_offload_key
from kvtier_async.tiers import _fsio
from kvtier_async.tiers._checksum import CHECKSUM_NAME, checksum
from kvtier_async.tiers._fsio import FsIo, Pool
from kvtier_async.tiers.base import SecondaryTier, TierContext, TierStatistics, block_relpath

__all__ = [
    "DEFAULT_READ_WORKERS",
    "DEFAULT_WRITE_WORKERS",
    "HEADER_BYTES",
    "MIN_CHUNK_BYTES",
    "PUBLISH_ORDER",
    "REMOVED_QUEUE",
    "CorruptBlockError",
    "FsTier",
    "FsTierStatistics",
    "from_config",
    "pack_header",
    "parse_mode",
    "verify_block",
]

log = get_logger(__name__)

HEADER_BYTES: Final = 4096
# Measured on a virtio ext4 disk (2 vCPUs), 256 KiB blocks, C path: loads best at 16; stores
# with 32 writers at or above 16 in two of three interleaved A/B runs (medians 1.33 vs 1.25
# GB/s, 0.83 vs 0.70, 0.59 vs 0.68; 64 no better): a file creation waits on metadata, so more
# in flight keep the disk busier. The run-to-run noise of that disk is larger than the gap.
DEFAULT_READ_WORKERS: Final = 16
DEFAULT_WRITE_WORKERS: Final = 32
# Python path: bytes per worker-thread call at least, when a batch is split across workers
# (the C path makes one call per batch and spreads the blocks over its own threads). A hop
# costs 50-300 us of CPU on the 2-core development box (more under trio); 4 MiB takes ~3 ms
# of disk time. Measured (256 KiB blocks, jobs of 16): one block per call used 2x the CPU of
# 16 per call, and loads ran up to 1.5x slower.
MIN_CHUNK_BYTES: Final = 4 << 20

_MAGIC: Final = b"KVTIERB\x00"
_FILE_VERSION: Final = 1
# magic, version, reserved, header bytes, payload bytes, payload sum, key sum, checksum name
_HEADER: Final = struct.Struct("<8sHHIQQQ16s")
_SUM: Final = struct.Struct("<Q")
_HEADER_SUM_AT: Final = HEADER_BYTES - _SUM.size
_SUM_NAME: Final = CHECKSUM_NAME.encode().ljust(16, b"\0")
_ZERO_PAGE: Final = bytes(HEADER_BYTES)
_ALIGN: Final = 4096  # O_DIRECT: buffer address and length, and file offsets
_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)
_O_TMPFILE: Final = getattr(os, "O_TMPFILE", 0)
_AT_FDCWD: Final = -100
_AT_EMPTY_PATH: Final = 0x1000
_AT_SYMLINK_FOLLOW: Final = 0x400
_TEMP_RE: Final = re.compile(r"\..+\.([0-9a-f]{8})-(\d+)-(\d+)-(\d+)\.tmp")
# How to publish a new file, in order of preference; the first that works in the rank
# directory wins. O_TMPFILE + linkat never shows a temporary name and leaves nothing behind
# a crash, but measured 5-15% slower than a named temporary + rename with 16 writers on ext4
# (virtio disk, 256 KiB and 2 MiB blocks; likely ext4's journaled orphan list, which every
# O_TMPFILE inode joins and leaves), for the same four system calls per block. So rename
# goes first.
PUBLISH_ORDER: tuple[str, ...] = ("rename", "linkat", "proc-linkat")
_CONFIG_KEYS: Final = ("type", "name", "root_dir", "n_read_workers", "n_write_workers",
                       "max_bytes", "fsync", "mode")  # fmt: skip
PRIVATE_MODE: Final = 0o600
# ``mode`` presets: "private" (the default), "group" (group members read and write too).
_MODE_PRESETS: Final = {"private": PRIVATE_MODE, "group": 0o660}
# Keys of removed blocks waiting for `FsTier.take_removed`; beyond it the oldest are dropped.
REMOVED_QUEUE: Final = 1 << 16

# Seams for fault-injection tests (like `memory.region._sleep`): tests replace them.
_open: Callable[..., int] = os.open
_pwritev: Callable[[int, Sequence[memoryview], int], int] = os.pwritev
_preadv: Callable[[int, Sequence[memoryview], int], int] = os.preadv
# Tests that inject faults through the seams above switch the C path off with it.
_native_fsio: Callable[[], FsIo | None] = _fsio.native_fsio

_STORE_FAILED, _STORE_PRESENT, _STORE_WRITTEN = 0, 1, 2
_REMOVED_DAMAGED, _REMOVED_EVICTED = "damaged", "evicted"


class CorruptBlockError(ValueError):
    """A block file is short, malformed or fails its checksum."""


# -- configuration ---------------------------------------------------------------------------


def from_config(section: Section, name: str, ctx: TierContext) -> FsTier:
    """Build an `FsTier` from ``{"type": "fs", "root_dir": ..., ...}`` (see the README)."""
    section.allow_only(_CONFIG_KEYS)
    root_dir = section.get_str("root_dir")
    if "\x00" in root_dir:
        raise ConfigError(section.name("root_dir"), "must not contain NUL characters")
    return FsTier(
        name,
        ctx,
        read_workers=section.get_int("n_read_workers", DEFAULT_READ_WORKERS, low=1, high=1024),
        write_workers=section.get_int("n_write_workers", DEFAULT_WRITE_WORKERS, low=1, high=1024),
        root_dir=root_dir,
        max_bytes=section.get_int("max_bytes", None, low=HEADER_BYTES + ctx.block_bytes),
        fsync=section.get_bool("fsync", False),
        mode=_config_mode(section),
    )


def _config_mode(section: Section) -> int:
    try:
        return parse_mode(section.data.get("mode", "private"))
    except ValueError as exc:
        raise ConfigError(section.name("mode"), str(exc)) from None


def parse_mode(value: object) -> int:
    """The file mode of ``value``: an int, an octal string (``"0640"``, ``"640"``,
    ``"0o640"``) or a preset (``"private"``: 0600, ``"group"``: 0660). Read and write bits
    only, the owner's both included. ValueError says what is allowed."""
    mode: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in _MODE_PRESETS:
            mode = _MODE_PRESETS[text]
        elif re.fullmatch(r"(0o)?[0-7]{1,4}", text):
            mode = int(text.removeprefix("0o"), 8)
    if mode is None or mode & ~0o666 or mode & 0o600 != 0o600:
        raise ValueError(
            "must be a file mode with read/write bits only and the owner's read and write "
            f"(an octal string like '0600', '0640', '0660'), or one of "
            f"{sorted(_MODE_PRESETS)}; got {value!r}"
        )
    return mode


# -- the async tier --------------------------------------------------------------------------


@dataclass
class _Counts:
    blocks_stored: int = 0
    blocks_present: int = 0
    blocks_loaded: int = 0
    store_failures: int = 0
    load_failures: int = 0
    lookups: int = 0
    lookup_hits: int = 0


@dataclass(frozen=True)
class FsTierStatistics(TierStatistics):
    """`TierStatistics` plus the block files the fs tier deleted on its own."""

    removed_damaged: int = 0  # failed verification, wrong size, a link (deleted)
    removed_evicted: int = 0  # least recently used, for max_bytes
    removed_unreported: int = 0  # keys dropped from the `take_removed` queue (overflow)


class FsTier(SecondaryTier):
    """Blocks as files under ``root_dir`` (see the module docstring)."""

    kind = "fs"

    def __init__(
        self,
        name: str,
        ctx: TierContext,
        read_workers: int = DEFAULT_READ_WORKERS,
        write_workers: int = DEFAULT_WRITE_WORKERS,
        *,
        root_dir: str | os.PathLike[str],
        max_bytes: int | None = None,
        fsync: bool = False,
        mode: int | str = PRIVATE_MODE,
    ) -> None:
        super().__init__(name, ctx, read_workers, write_workers)
        self.root_dir = os.fspath(root_dir)  # made absolute at open (getcwd may block)
        self.max_bytes = max_bytes
        self.fsync = fsync
        try:
            self.mode = parse_mode(mode)
        except ValueError as exc:
            raise ValueError(f"mode {exc}") from None
        self._removed = _Removed()
        self._read_limiter = anyio.CapacityLimiter(read_workers)
        self._write_limiter = anyio.CapacityLimiter(write_workers)
        self._lookup_limiter = anyio.CapacityLimiter(1)
        self._files: _BlockFiles | None = None
        self._counts = _Counts()
        self._chunk_blocks = max(1, MIN_CHUNK_BYTES // max(1, ctx.block_bytes))

    @property
    def namespace_dir(self) -> str:
        """``<root_dir>/<model>_<digest>``: this configuration's directory."""
        return os.path.join(self.root_dir, self.ctx.namespace)

    async def open(self) -> None:
        if self._files is not None:
            raise RuntimeError(f"{self!r} is already open")
        self._files = await anyio.to_thread.run_sync(self._open_files)
        log.info("fs tier open", tier=self.name, detail=self._files.describe())

    async def aclose(self) -> None:
        files, self._files = self._files, None
        if files is not None:
            await anyio.to_thread.run_sync(files.close)

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        files = self._ready()
        if not keys:
            return []
        found = await anyio.to_thread.run_sync(
            files.exists_many, list(keys), limiter=self._lookup_limiter
        )
        self._counts.lookups += len(found)
        self._counts.lookup_hits += sum(found)
        return found

    async def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        outcomes = await self._in_chunks(
            self._ready().store_many, keys, blocks, self._write_limiter
        )
        counts = self._counts
        counts.blocks_stored += outcomes.count(_STORE_WRITTEN)
        counts.blocks_present += outcomes.count(_STORE_PRESENT)
        counts.store_failures += outcomes.count(_STORE_FAILED)
        return [outcome != _STORE_FAILED for outcome in outcomes]

    async def load(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        outcomes = await self._in_chunks(self._ready().load_many, keys, blocks, self._read_limiter)
        self._counts.blocks_loaded += sum(outcomes)
        self._counts.load_failures += len(outcomes) - sum(outcomes)
        return [bool(outcome) for outcome in outcomes]

    def take_removed(self) -> list[bytes]:
        return self._removed.take()

    def statistics(self) -> FsTierStatistics:
        counts, files, removed = self._counts, self._files, self._removed
        detail = "closed" if files is None else files.describe()
        return FsTierStatistics(
            name=self.name,
            kind=self.kind,
            blocks_stored=counts.blocks_stored,
            blocks_loaded=counts.blocks_loaded,
            bytes_written=counts.blocks_stored * self.ctx.block_bytes,
            bytes_read=counts.blocks_loaded * self.ctx.block_bytes,
            store_failures=counts.store_failures,
            load_failures=counts.load_failures,
            lookups=counts.lookups,
            lookup_hits=counts.lookup_hits,
            detail=f"{detail} already_present={counts.blocks_present}",
            removed_damaged=removed.counts[_REMOVED_DAMAGED],
            removed_evicted=removed.counts[_REMOVED_EVICTED],
            removed_unreported=removed.dropped,
        )

    # -- internals -----------------------------------------------------------------------

    def _ready(self) -> _BlockFiles:
        if self._files is None:
            raise RuntimeError(f"{self!r} is not open")
        return self._files

    def _open_files(self) -> _BlockFiles:
        """Blocking: directories, config.json, probe, clean-up, access record."""
        try:
            root = os.path.abspath(self.root_dir)
            return _BlockFiles.open(
                self.name,
                root,
                _path_context(self.ctx),
                self.max_bytes,
                self.fsync,
                (self.read_workers, self.write_workers),
                _Perms.of(self.mode),
                self._removed,
            )
        except OSError as exc:
            raise OSError(
                exc.errno, f"fs tier {self.name!r}: root_dir {self.root_dir!r} is unusable: {exc}"
            ) from exc

    async def _in_chunks(
        self,
        fn: Callable[[Sequence[bytes], Sequence[memoryview]], list[int]],
        keys: Sequence[bytes],
        blocks: Sequence[memoryview],
        limiter: anyio.CapacityLimiter,
    ) -> list[int]:
        """Run ``fn`` over ``keys``/``blocks`` in worker threads: the whole batch in one call
        on the C path (its pool spreads the blocks), else a chunk per thread call."""
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        if not keys:
            return []
        if self._ready().fsio is not None:  # the C pool spreads the blocks over its threads
            spans = [(0, len(keys))]
        else:
            spans = _spans(len(keys), self._chunk_blocks, int(limiter.total_tokens))
        if len(spans) <= 1:
            return await anyio.to_thread.run_sync(fn, keys, blocks, limiter=limiter)
        results: list[list[int]] = [[] for _ in spans]

        async def run(index: int, start: int, stop: int) -> None:
            results[index] = await anyio.to_thread.run_sync(
                fn, keys[start:stop], blocks[start:stop], limiter=limiter
            )

        async with anyio.create_task_group() as tg:
            for index, (start, stop) in enumerate(spans):
                tg.start_soon(run, index, start, stop)
        return [outcome for chunk in results for outcome in chunk]


def _spans(count: int, min_size: int, workers: int) -> list[tuple[int, int]]:
    """Split ``range(count)`` into at most ``workers`` spans of at least ``min_size``."""
    size = max(min_size, -(-count // max(1, workers)))
    return [(start, min(start + size, count)) for start in range(0, count, size)]


class _PathContext(TierContext):
    """A `TierContext` that computes `namespace` (JSON + SHA-256, ~40 us) once, so that
    `block_relpath` costs about a microsecond per key."""

    @functools.cached_property
    def namespace(self) -> str:
        return str(TierContext.namespace.__get__(self))


def _path_context(ctx: TierContext) -> TierContext:
    return _PathContext(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})


# -- the blocking half -----------------------------------------------------------------------


@dataclass(frozen=True)
class _IoMode:
    """How this root is driven, decided by the probe at open."""

    direct: bool
    publish: str  # "linkat" (AT_EMPTY_PATH), "proc-linkat" (/proc/self/fd) or "rename"


class _Workers:
    """The C worker pools of one open tier (`_fsio.Pool`), ``read`` and ``write``, each
    started at its first batch, so a tier that only answers lookups starts no thread. Both
    are joined by `close`, or when the tier is collected without one."""

    def __init__(self, fsio: FsIo | None, name: str, reads: int, writes: int) -> None:
        self._fsio = fsio
        self._sizes = {"read": reads, "write": writes}
        self._names = {"read": f"kvfs-r-{name}", "write": f"kvfs-w-{name}"}
        self._pools: dict[str, Pool | None] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_pools, self._pools)

    def pool(self, way: str) -> Pool | None:
        """The pool for ``way``; None without the C helper, after `close`, or if no thread
        could start (then each batch runs in its caller's thread)."""
        if way in self._pools:  # started, or failed to
            return self._pools[way]
        with self._lock:
            if self._fsio is None or self._closed:
                return None
            if way not in self._pools:
                pool = self._fsio.pool(self._sizes[way], self._names[way])
                if pool is None:
                    log.warning("fs tier: no worker thread started; batches run in the"
                                " caller's thread", pool=self._names[way])  # fmt: skip
                self._pools[way] = pool
            return self._pools[way]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._finalizer()


def _close_pools(pools: dict[str, Pool | None]) -> None:
    for pool in pools.values():
        if pool is not None:
            pool.close()


class _BlockFiles:
    """Blocking block-file operations; every method may run in any worker thread."""

    def __init__(
        self,
        name: str,
        root: str,
        ctx: TierContext,
        mode: _IoMode,
        fsync: bool,
        usage: _Usage | None,
        workers: tuple[int, int],
        perms: _Perms,
        removed: _Removed,
    ) -> None:
        self.name = name
        self.root = root
        self.ctx = ctx
        self.mode = mode
        self.fsync = fsync
        self.usage = usage
        self.perms = perms
        self.removed = removed
        self.file_bytes = HEADER_BYTES + ctx.block_bytes
        self._ns_dir = os.path.join(root, ctx.namespace)
        self._rank_dir = os.path.join(self._ns_dir, f"r{ctx.rank}")
        # Known to exist (set.add is atomic); forgotten when a create finds one gone.
        self._dirs: set[str] = {root, self._ns_dir, self._rank_dir}
        self._publish = _PUBLISHERS[mode.publish]
        # The C batch path publishes by rename; the O_TMPFILE ways stay in Python.
        self.fsio = _native_fsio() if mode.publish == "rename" else None
        self.workers = _Workers(self.fsio, name, *workers)

    def close(self) -> None:
        """Blocking: stop the C worker threads once the calls in flight have returned."""
        self.workers.close()

    @classmethod
    def open(
        cls,
        name: str,
        root: str,
        ctx: TierContext,
        max_bytes: int | None,
        fsync: bool,
        workers: tuple[int, int],
        perms: _Perms,
        removed: _Removed,
    ) -> _BlockFiles:
        ns_dir = os.path.join(root, ctx.namespace)
        rank_dir = os.path.join(ns_dir, f"r{ctx.rank}")
        _make_dirs(rank_dir, perms)
        _narrow_dir(ns_dir, perms)
        _write_config(ns_dir, ctx, perms)
        mode = _probe(rank_dir, perms)
        blocks, temps = _scan(ns_dir, rank_dir, want_blocks=max_bytes is not None)
        _remove_dead_temps(temps)
        usage = None if max_bytes is None else _Usage(max_bytes)
        if usage is not None:
            usage.seed(blocks)
            removed.add_paths(_unlink_all(usage.trim()), _REMOVED_EVICTED)
        return cls(name, root, ctx, mode, fsync, usage, workers, perms, removed)

    def describe(self) -> str:
        io = "O_DIRECT" if self.mode.direct else "buffered"
        capacity = "unlimited" if self.usage is None else self.usage.describe()
        fsync = "on" if self.fsync else "off"
        path = "python" if self.fsio is None else self.fsio.describe()
        return (
            f"io={io} publish={self.mode.publish} fsync={fsync} checksum={CHECKSUM_NAME} "
            f"path={path} capacity={capacity} root={self.root}"
        )

    def path(self, key: bytes) -> str:
        return f"{self.root}/{block_relpath(self.ctx, key)}"

    # -- lookups -------------------------------------------------------------------------

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self._exists(key) for key in keys]

    def _exists(self, key: bytes) -> bool:
        try:
            return self._is_block_file(self.path(key))
        except ValueError:  # not an offload key
            return False

    def _is_block_file(self, path: str) -> bool:
        try:
            st = os.lstat(path)  # a link is no block
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == self.file_bytes

    # -- stores --------------------------------------------------------------------------

    def store_many(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[int]:
        if self.fsio is not None:
            return self._store_native(self.fsio, keys, blocks)
        outcomes = []
        for key, block in zip(keys, blocks, strict=True):
            try:
                outcomes.append(self._store(key, block))
            except (OSError, ValueError) as exc:
                self._store_failed(key, exc)
                outcomes.append(_STORE_FAILED)
        return outcomes

    def _store_failed(self, key: bytes, exc: Exception) -> None:
        log.warning("fs store failed", tier=self.name, key=key.hex(), error=str(exc))

    def _store_native(
        self, fsio: FsIo, keys: Sequence[bytes], blocks: Sequence[memoryview]
    ) -> list[int]:
        """`store_many` through the C loop: Python prepares names, directories and headers."""
        outcomes = [_STORE_FAILED] * len(keys)
        batch = _NativeBatch()
        for index, (key, block) in enumerate(zip(keys, blocks, strict=True)):
            try:
                self._check_block(block)
                path = self.path(key)
                directory = os.path.dirname(path)
                made_dir = self._ensure_dir(directory)
            except (OSError, ValueError) as exc:
                self._store_failed(key, exc)
                continue
            batch.add(
                index,
                key,
                block,
                path,
                directory=directory,
                check=not made_dir,
                direct=self.mode.direct,
            )
        if not batch.indexes:
            return outcomes
        heads = _scratch_pages("store", len(batch.indexes))
        batch.fill_headers(heads)
        pool = self.workers.pool("write")
        if self.usage is None:
            results = batch.store(
                fsio, pool, heads, self.fsync, self.perms, range(len(batch.indexes))
            )
        else:  # one block at a time, so that evictions never hit a block of this batch
            results = []
            for j, path in enumerate(batch.paths):
                try:
                    self._evict(self.usage.admit(path, self.file_bytes))
                except OSError as exc:  # a block file larger than max_bytes
                    results.append((-(exc.errno or errno.EIO), 0))
                    continue
                results += batch.store(fsio, pool, heads, self.fsync, self.perms, [j])
        retry = [j for j, (code, step) in enumerate(results) if code == -errno.ENOENT and step == 1]
        if retry:  # directories vanished under us: forget them, make them, once more
            self._forget_dirs()
            try:
                for j in retry:
                    self._ensure_dir(batch.dirs[j])
            except OSError as exc:
                log.warning("fs tier cannot make its directories again", tier=self.name,
                            error=str(exc))  # fmt: skip
            again = batch.store(fsio, pool, heads, self.fsync, self.perms, retry)
            for j, result in zip(retry, again, strict=True):
                results[j] = result
        for j, (code, step) in enumerate(results):
            index, path = batch.indexes[j], batch.paths[j]
            if batch.noted[j]:
                log.warning("fs block file had the wrong size or was a link, replaced it",
                            path=path)  # fmt: skip
                self.removed.add(batch.keys[j], _REMOVED_DAMAGED)
            if code == _fsio.STORE_WRITTEN:
                outcomes[index] = _STORE_WRITTEN
            elif code == _fsio.STORE_PRESENT:
                self._touch(path)
                outcomes[index] = _STORE_PRESENT
            else:
                self._forget(path)
                call = _fsio.STEP_NAMES.get(step, "store")
                self._store_failed(
                    keys[index], OSError(-code, f"{call}: {os.strerror(-code)}", path)
                )
        return outcomes

    def _store(self, key: bytes, block: memoryview) -> int:
        self._check_block(block)
        path = self.path(key)
        made_dir = self._ensure_dir(os.path.dirname(path))
        if not made_dir and self._present(key, path):  # a directory made just now is empty
            self._touch(path)
            return _STORE_PRESENT
        if self.usage is not None:
            self._evict(self.usage.admit(path, self.file_bytes))
        try:
            return self._write(path, key, block)
        except BaseException:
            self._forget(path)
            raise

    def _present(self, key: bytes, path: str) -> bool:
        """Whether a complete block file is at ``path``; a wrong-sized one or a link is
        deleted (it cannot be a write in progress: names appear only with the whole file
        behind them)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        wrong_size = stat.S_ISREG(st.st_mode) and st.st_size != self.file_bytes
        if wrong_size or stat.S_ISLNK(st.st_mode):
            log.warning("fs block file has the wrong size or is a link, deleting it", path=path)
            if _unlink_all([path]):
                self.removed.add(key, _REMOVED_DAMAGED)
            return False
        return stat.S_ISREG(st.st_mode)

    def _write(self, path: str, key: bytes, block: memoryview) -> int:
        """Write a new file for ``key`` and publish it at ``path``."""
        page = _header_page()
        pack_header(page, key, block)
        directory = os.path.dirname(path)
        fd, temp = self._create(directory, self.mode.direct and _is_aligned(block))
        try:
            _write_all(fd, [page, block])
            if self.fsync:
                os.fsync(fd)
            published = self._publish(fd, temp, path)
        except BaseException:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            raise
        finally:
            os.close(fd)
        if published:
            return _STORE_WRITTEN
        if self._is_block_file(path):  # a peer published the same key first
            return _STORE_PRESENT
        raise FileExistsError(errno.EEXIST, "something that is not a block file is there", path)

    def _create(self, directory: str, direct: bool) -> tuple[int, str | None]:
        """A new file open for writing in ``directory`` (made by the caller): ``(fd, temp name
        or None)``."""
        try:
            return _create_file(directory, self.mode.publish, direct, self.perms)
        except FileNotFoundError:  # directories vanished under us: forget them, make them
            self._forget_dirs()
            self._ensure_dir(directory)
            return _create_file(directory, self.mode.publish, direct, self.perms)

    def _forget_dirs(self) -> None:
        """Forget every directory known to exist (one was removed under us)."""
        self._dirs.clear()

    def _ensure_dir(self, directory: str) -> bool:
        """Make ``directory`` unless known; True if made by this call.

        One ``mkdir`` (``os.makedirs`` stats every level first): a new leaf costs one system
        call, a known one none; missing parents are made when it says ``ENOENT``. A new
        namespace directory gets its ``config.json``."""
        if directory in self._dirs:
            return False
        made = _make_dirs(directory, self.perms, self._made_dir)
        self._dirs.add(directory)
        return made

    def _made_dir(self, directory: str) -> None:
        if directory == self._ns_dir:
            log.warning("fs tier made its namespace directory again", path=directory)
            _write_config(directory, self.ctx, self.perms)

    def _check_block(self, block: memoryview, *, into: bool = False) -> None:
        if block.nbytes != self.ctx.block_bytes:
            raise ValueError(f"block is {block.nbytes} bytes, expected {self.ctx.block_bytes}")
        if not block.c_contiguous:
            raise ValueError("block memory must be C-contiguous")
        if into and block.readonly:
            raise ValueError("cannot load into read-only block memory")

    # -- loads ---------------------------------------------------------------------------

    def load_many(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[int]:
        if self.fsio is not None:
            return self._load_native(self.fsio, keys, blocks)
        return [int(self._load(key, block)) for key, block in zip(keys, blocks, strict=True)]

    def _load_native(
        self, fsio: FsIo, keys: Sequence[bytes], blocks: Sequence[memoryview]
    ) -> list[int]:
        """`load_many` through the C loop, with the checks of `verify_block`."""
        outcomes = [0] * len(keys)
        batch = _NativeBatch()
        for index, (key, block) in enumerate(zip(keys, blocks, strict=True)):
            try:
                self._check_block(block, into=True)
                path = self.path(key)
            except ValueError as exc:
                log.warning("fs load refused", tier=self.name, key=key.hex(), error=str(exc))
                continue
            batch.add(index, key, block, path, direct=self.mode.direct)
        if not batch.indexes:
            return outcomes
        heads = _scratch_pages("load", len(batch.indexes))
        pool = self.workers.pool("read")
        for j, (code, problem, identity) in enumerate(batch.load(fsio, pool, heads)):
            path = batch.paths[j]
            if code == _fsio.LOAD_OK:
                self._touch(path)
                outcomes[batch.indexes[j]] = 1
            elif problem is not None:  # not a plain miss
                self._fail_load(batch.keys[j], path, identity, problem)
        return outcomes

    def _load(self, key: bytes, block: memoryview) -> bool:
        try:
            self._check_block(block, into=True)
            path = self.path(key)
            direct = self.mode.direct and _is_aligned(block)
        except ValueError as exc:
            log.warning("fs load refused", tier=self.name, key=key.hex(), error=str(exc))
            return False
        try:
            fd = _open(path, os.O_RDONLY | os.O_NOFOLLOW | (_O_DIRECT if direct else 0))
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._fail_load(key, path, None, _open_problem(exc))
            return False
        try:
            _read_block(fd, key, block)
        except (OSError, CorruptBlockError) as exc:
            self._fail_load(key, path, _identity_of(fd), exc)
            return False
        finally:
            os.close(fd)
        self._touch(path)
        return True

    def _fail_load(
        self, key: bytes, path: str, identity: tuple[int, int] | None, exc: Exception
    ) -> None:
        log.warning("fs block unreadable, deleting it", tier=self.name, path=path, error=str(exc))
        self._forget(path)
        if _discard(path, identity):
            self.removed.add(key, _REMOVED_DAMAGED)

    # -- access record -------------------------------------------------------------------

    def _touch(self, path: str) -> None:
        if self.usage is not None:
            self.usage.touch(path, self.file_bytes)

    def _forget(self, path: str) -> None:
        if self.usage is not None:
            self.usage.forget(path)

    def _evict(self, victims: Sequence[str]) -> None:
        self.removed.add_paths(_unlink_all(victims), _REMOVED_EVICTED)


# -- file format -----------------------------------------------------------------------------


def pack_header(page: memoryview, key: bytes, payload: memoryview) -> None:
    """Fill ``page`` (`HEADER_BYTES` long) with the header of ``key``'s block ``payload``."""
    page[:] = _ZERO_PAGE
    _pack_fields(page, 0, key, payload.nbytes, checksum(payload))
    _SUM.pack_into(page, _HEADER_SUM_AT, checksum(page[:_HEADER_SUM_AT]))


def _pack_fields(
    buffer: memoryview | mmap.mmap | bytearray,
    offset: int,
    key: bytes,
    payload_bytes: int,
    payload_sum: int,
) -> None:
    """The header's fields (`_HEADER`) for ``key`` at ``offset`` of ``buffer``."""
    _HEADER.pack_into(buffer, offset, _MAGIC, _FILE_VERSION, 0, HEADER_BYTES, payload_bytes,
                      payload_sum, checksum(key), _SUM_NAME)  # fmt: skip


def verify_block(page: memoryview, key: bytes, payload: memoryview) -> None:
    """Raise `CorruptBlockError` unless ``page`` is a valid header for ``key``'s ``payload``."""
    (header_sum,) = _SUM.unpack_from(page, _HEADER_SUM_AT)
    if checksum(page[:_HEADER_SUM_AT]) != header_sum:
        raise CorruptBlockError(_VERDICTS[_fsio.LOAD_BAD_HEADER])
    magic, version, _, header_bytes, length, payload_sum, key_sum, name = _HEADER.unpack_from(page)
    if (magic, version, header_bytes, name) != (_MAGIC, _FILE_VERSION, HEADER_BYTES, _SUM_NAME):
        raise CorruptBlockError(_VERDICTS[_fsio.LOAD_FOREIGN])
    if length != payload.nbytes:
        raise _wrong_length(length, payload.nbytes)
    if key_sum != checksum(key):
        raise CorruptBlockError(_VERDICTS[_fsio.LOAD_WRONG_KEY])
    if checksum(payload) != payload_sum:
        raise CorruptBlockError(_VERDICTS[_fsio.LOAD_BAD_PAYLOAD])


# What each failed check says, on both I/O paths (keys: the C path's load results).
_VERDICTS: Final = {
    _fsio.LOAD_BAD_HEADER: "header checksum mismatch",
    _fsio.LOAD_FOREIGN: "not a block file of this format",
    _fsio.LOAD_WRONG_KEY: "the file belongs to another key",
    _fsio.LOAD_BAD_PAYLOAD: "payload checksum mismatch",
}


def _short_file(got: int, expected: int) -> CorruptBlockError:
    return CorruptBlockError(f"short file: read {got} of {expected} bytes")


def _wrong_length(length: int, expected: int) -> CorruptBlockError:
    return CorruptBlockError(f"payload is {length} bytes, expected {expected}")


def _wrong_size(size: int, expected: int) -> CorruptBlockError:
    return CorruptBlockError(f"file is {size} bytes, expected {expected}")


def _read_block(fd: int, key: bytes, block: memoryview) -> None:
    page = _header_page()
    expected = HEADER_BYTES + block.nbytes
    st = os.fstat(fd)
    got = _read_all(fd, [page, block])
    if got != expected:
        raise _short_file(got, expected)
    if not stat.S_ISREG(st.st_mode) or st.st_size != expected:
        raise _wrong_size(st.st_size, expected)
    verify_block(page, key, block)


def _open_problem(exc: OSError) -> Exception:
    """What a failed open of a block file says (a link is refused, not followed)."""
    if exc.errno == errno.ELOOP:
        return CorruptBlockError("a symbolic link (not followed)")
    return exc


# The names the obj tier imported first.
_pack_header, _verify = pack_header, verify_block

_scratch = threading.local()


def _header_page() -> memoryview:
    """This thread's page-aligned header buffer (an anonymous mapping)."""
    page: memoryview | None = getattr(_scratch, "page", None)
    if page is None:
        page = _scratch.page = memoryview(mmap.mmap(-1, HEADER_BYTES))
    return page


def _is_aligned(block: memoryview) -> bool:
    return _aligned(block.nbytes, _address(block))


def _aligned(nbytes: int, address: int) -> bool:
    """Whether a buffer of ``nbytes`` at ``address`` can take O_DIRECT I/O."""
    return nbytes % _ALIGN == 0 and address % _ALIGN == 0


def _address(block: memoryview) -> int:
    """Address of ``block``'s first byte (the buffer export is dropped at once)."""
    return _anchored_address(block)[0]


def _rest(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    rest = []
    for view in views:
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        rest.append(view[skip:] if skip else view)
        skip = 0
    return rest


def _write_all(fd: int, views: Sequence[memoryview]) -> None:
    total, done = sum(view.nbytes for view in views), 0
    while done < total:
        written = _pwritev(fd, _rest(views, done), done)
        if written <= 0:
            raise OSError(errno.EIO, f"write stopped at {done} of {total} bytes")
        done += written


def _read_all(fd: int, views: Sequence[memoryview]) -> int:
    total, done = sum(view.nbytes for view in views), 0
    while done < total:
        got = _preadv(fd, _rest(views, done), done)
        if got <= 0:
            break
        done += got
    return done


# -- the C path's batches --------------------------------------------------------------------

_PREFIX_BYTES: Final = _HEADER.size  # the header fields; the payload sum is among them
_PAYLOAD_SUM_AT: Final = struct.calcsize("<8sHHIQ")  # the fields of _HEADER before it


class _NativeBatch:
    """The blocks of one call into `_fsio`: their places in the caller's lists, and their
    arguments. Holds a buffer export of every block until it is dropped, so that no block
    memory can be unmapped while C works on it."""

    def __init__(self) -> None:
        self.indexes: list[int] = []
        self.keys: list[bytes] = []
        self.paths: list[str] = []
        self.dirs: list[str] = []
        self.noted: list[int] = []
        self._bodies: list[int] = []
        self._flags: list[int] = []
        self._check: list[int] = []
        self._anchors: list[object] = []
        self._nbytes = 0

    def add(
        self,
        index: int,
        key: bytes,
        block: memoryview,
        path: str,
        *,
        directory: str = "",
        check: bool = False,
        direct: bool,
    ) -> None:
        """Add a block; a store needs ``directory`` (where its temporary goes) and ``check``
        (look for a complete file first)."""
        address, anchor = _anchored_address(block)
        aligned = _aligned(block.nbytes, address)
        self.indexes.append(index)
        self.keys.append(key)
        self.paths.append(path)
        self.dirs.append(directory)
        self.noted.append(0)
        self._bodies.append(address)
        self._flags.append(_O_DIRECT if direct and aligned else 0)
        self._check.append(int(check))
        self._anchors.append(anchor)
        self._nbytes = block.nbytes

    def fill_headers(self, heads: _Pages) -> None:
        """Write each block's header fields (payload sum zero) at the start of its page."""
        for j, key in enumerate(self.keys):
            self._pack_prefix(heads.mapping, j * HEADER_BYTES, key)

    def _pack_prefix(self, buffer: mmap.mmap | bytearray, offset: int, key: bytes) -> None:
        _pack_fields(buffer, offset, key, self._nbytes, 0)  # the C loop fills in the sum

    def store(
        self,
        fsio: FsIo,
        pool: Pool | None,
        heads: _Pages,
        fsync: bool,
        perms: _Perms,
        subset: Sequence[int],
    ) -> list[tuple[int, int]]:
        """Store the blocks at positions ``subset``: ``(result, failed step)`` for each."""
        count = len(subset)
        c_temps = _c_array(ctypes.c_char_p, [
            os.fsencode(os.path.join(self.dirs[j], _temp_name("blk"))) for j in subset
        ])  # fmt: skip
        c_finals = _c_array(ctypes.c_char_p, [os.fsencode(self.paths[j]) for j in subset])
        c_check = _c_array(ctypes.c_int32, [self._check[j] for j in subset])
        c_heads = _c_array(ctypes.c_void_p, [heads.address + j * HEADER_BYTES for j in subset])
        c_bodies = _c_array(ctypes.c_void_p, [self._bodies[j] for j in subset])
        c_flags = _c_array(ctypes.c_int32, [self._flags[j] for j in subset])
        result, step, noted = (_c_array(ctypes.c_int32, [0] * count) for _ in range(3))
        args = _fsio.StoreArgs(
            count, _at(c_temps), _at(c_finals), _at(c_check), _at(c_heads), _at(c_bodies),
            _at(c_flags), HEADER_BYTES, self._nbytes, _PAYLOAD_SUM_AT, int(fsync), perms.file,
            int(perms.fix), _at(result), _at(step), _at(noted),
        )  # fmt: skip
        fsio.run(pool, args)
        for k, j in enumerate(subset):
            self.noted[j] = noted[k]
        return list(zip(result, step, strict=True))

    def load(
        self, fsio: FsIo, pool: Pool | None, heads: _Pages
    ) -> list[tuple[int, Exception | None, tuple[int, int] | None]]:
        """Load every block: ``(result, the problem, (device, inode) of the file read)``."""
        count = len(self.keys)
        expect = bytearray(_PREFIX_BYTES * count)
        for j, key in enumerate(self.keys):
            self._pack_prefix(expect, j * _PREFIX_BYTES, key)
        c_expect = (ctypes.c_char * len(expect)).from_buffer(expect)
        c_paths = _c_array(ctypes.c_char_p, [os.fsencode(path) for path in self.paths])
        c_heads = _c_array(
            ctypes.c_void_p, [heads.address + j * HEADER_BYTES for j in range(count)]
        )
        c_bodies = _c_array(ctypes.c_void_p, self._bodies)
        c_flags = _c_array(ctypes.c_int32, self._flags)
        result, step = _c_array(ctypes.c_int32, [0] * count), _c_array(ctypes.c_int32, [0] * count)
        got = _c_array(ctypes.c_int64, [0] * count)
        dev, ino = _c_array(ctypes.c_uint64, [0] * count), _c_array(ctypes.c_uint64, [0] * count)
        args = _fsio.LoadArgs(
            count, _at(c_paths), _at(c_heads), _at(c_bodies), _at(c_flags),
            ctypes.addressof(c_expect), HEADER_BYTES, self._nbytes, _PAYLOAD_SUM_AT,
            _at(result), _at(step), _at(got), _at(dev), _at(ino),
        )  # fmt: skip
        fsio.run(pool, args)
        del c_expect
        outcomes: list[tuple[int, Exception | None, tuple[int, int] | None]] = []
        for j in range(count):
            code = result[j]
            if code in (_fsio.LOAD_OK, _fsio.LOAD_MISSING):
                outcomes.append((code, None, None))
                continue
            problem = self._problem(code, got[j], heads, j)
            identity = None if step[j] == 1 else (dev[j], ino[j])
            outcomes.append((code, problem, identity))
        return outcomes

    def _problem(self, code: int, got: int, heads: _Pages, j: int) -> Exception:
        """The error the Python path raises for load result ``code``."""
        if code < 0:
            return _open_problem(OSError(-code, os.strerror(-code), self.paths[j]))
        if code == _fsio.LOAD_SHORT:
            return _short_file(got, HEADER_BYTES + self._nbytes)
        if code == _fsio.LOAD_BAD_SIZE:
            return _wrong_size(got, HEADER_BYTES + self._nbytes)
        if code == _fsio.LOAD_BAD_LENGTH:
            length = _HEADER.unpack_from(heads.mapping, j * HEADER_BYTES)[4]
            return _wrong_length(length, self._nbytes)
        return CorruptBlockError(_VERDICTS.get(code, f"unknown load result {code}"))


@dataclass
class _Pages:
    """A thread's page-aligned header pages for the C path (an anonymous mapping)."""

    mapping: mmap.mmap
    address: int
    count: int


def _scratch_pages(kind: str, count: int) -> _Pages:
    """This thread's ``kind`` pages ("store" or "load": a store page is zero past the
    header fields, a load page holds whatever was read), at least ``count`` of them."""
    pages: _Pages | None = getattr(_scratch, kind, None)
    if pages is None or pages.count < count:
        size = 1 << max(4, (count - 1).bit_length())
        mapping = mmap.mmap(-1, size * HEADER_BYTES)
        anchor = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(anchor)
        del anchor
        pages = _Pages(mapping, address, size)
        setattr(_scratch, kind, pages)
    return pages


def _anchored_address(block: memoryview) -> tuple[int, object]:
    """Address of ``block``'s first byte (ctypes: ~1.5 us; numpy for read-only buffers) and
    an object holding a buffer export of it."""
    if block.readonly:
        array = np.frombuffer(block, dtype=np.uint8)
        return int(array.ctypes.data), array
    anchor = ctypes.c_char.from_buffer(block)
    return ctypes.addressof(anchor), anchor


def _c_array(ctype: Any, values: Sequence[Any]) -> ctypes.Array[Any]:
    """A C array of ``ctype`` holding ``values`` (it keeps byte strings alive)."""
    array: ctypes.Array[Any] = (ctype * len(values))(*values)
    return array


def _at(array: ctypes.Array[Any]) -> int:
    return ctypes.addressof(array)


# -- creating and publishing -----------------------------------------------------------------


@dataclass(frozen=True)
class _Perms:
    """Modes of what the tier creates: ``file`` for files, ``dir`` for directories (x for
    each class that may read or write); ``fix``: set them explicitly after creation, as the
    umask may have narrowed them (any mode but the private default)."""

    file: int
    dir: int
    fix: bool

    @classmethod
    def of(cls, mode: int) -> _Perms:
        search = ((mode >> 1) | (mode >> 2)) & 0o111
        return cls(file=mode, dir=mode | search, fix=mode != PRIVATE_MODE)


_PRIVATE: Final = _Perms.of(PRIVATE_MODE)


def _make_dirs(directory: str, perms: _Perms, made: Callable[[str], None] | None = None) -> bool:
    """``mkdir`` ``directory`` with ``perms.dir``, and its missing parents first if it says
    ``ENOENT``; True if this call made ``directory``. ``made`` hears of each one made,
    parents first."""
    try:
        os.mkdir(directory, perms.dir)
    except FileExistsError:
        return False
    except FileNotFoundError:
        parent = os.path.dirname(directory)
        if parent == directory:
            raise
        _make_dirs(parent, perms, made)
        try:
            os.mkdir(directory, perms.dir)
        except FileExistsError:
            return False
    if perms.fix:
        os.chmod(directory, perms.dir)
    if made is not None:
        made(directory)
    return True


def _narrow_dir(directory: str, perms: _Perms) -> None:
    """Take from ``directory``, if it is this user's, what ``perms.dir`` does not allow."""
    st = os.lstat(directory)
    extra = stat.S_IMODE(st.st_mode) & 0o777 & ~perms.dir
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and extra:
        os.chmod(directory, stat.S_IMODE(st.st_mode) & ~extra)
        log.info("fs tier narrowed the mode of its namespace directory", path=directory,
                 mode=f"{stat.S_IMODE(st.st_mode) & ~extra:04o}")  # fmt: skip


def _create_file(
    directory: str,
    publish: str,
    direct: bool,
    perms: _Perms = _PRIVATE,
    access: int = os.O_WRONLY,
) -> tuple[int, str | None]:
    flags = access | (_O_DIRECT if direct else 0)
    if publish != "rename":
        fd, temp = _open(directory, flags | _O_TMPFILE, perms.file), None
    else:
        temp = os.path.join(directory, _temp_name("blk"))
        fd = _open(temp, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, perms.file)
    if perms.fix:
        try:
            os.fchmod(fd, perms.file)
        except BaseException:
            os.close(fd)
            if temp is not None:
                _unlink_all([temp])
            raise
    return fd, temp


def _publish_linkat(fd: int, temp: str | None, path: str) -> bool:
    return _linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH)


def _publish_proc(fd: int, temp: str | None, path: str) -> bool:
    source = f"/proc/self/fd/{fd}".encode()
    return _linkat(_AT_FDCWD, source, _AT_FDCWD, os.fsencode(path), _AT_SYMLINK_FOLLOW)


def _publish_rename(fd: int, temp: str | None, path: str) -> bool:
    if temp is None:
        raise ValueError("rename publishing needs a named temporary file")
    os.replace(temp, path)
    return True


_PUBLISHERS: Final[dict[str, Callable[[int, str | None, str], bool]]] = {
    "linkat": _publish_linkat,
    "proc-linkat": _publish_proc,
    "rename": _publish_rename,
}


@functools.cache
def _libc_linkat() -> Callable[..., int]:
    linkat = ctypes.CDLL(None, use_errno=True).linkat
    linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    linkat.restype = ctypes.c_int
    function: Callable[..., int] = linkat
    return function


def _linkat(old_dir: int, old: bytes, new_dir: int, new: bytes, flags: int) -> bool:
    """``linkat(2)``; False if ``new`` exists already, OSError on other failures."""
    if _libc_linkat()(old_dir, old, new_dir, new, flags) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    raise OSError(code, os.strerror(code), os.fsdecode(new))


# -- probing ---------------------------------------------------------------------------------


def _probe(directory: str, perms: _Perms) -> _IoMode:
    publish = _probe_publish(directory, perms)
    return _IoMode(direct=_probe_direct(directory, publish, perms), publish=publish)


def _probe_publish(directory: str, perms: _Perms) -> str:
    """The first way in `PUBLISH_ORDER` to publish a file that works in ``directory``."""
    for publish in PUBLISH_ORDER:
        if publish == "rename" or _can_link_tmpfile(directory, publish, perms):
            return publish
    return "rename"


def _can_link_tmpfile(directory: str, publish: str, perms: _Perms) -> bool:
    if not _O_TMPFILE:
        return False
    try:
        fd = _open(directory, os.O_WRONLY | _O_TMPFILE, perms.file)
    except OSError:
        return False  # EOPNOTSUPP, EISDIR (old kernels), EINVAL
    target = os.path.join(directory, _temp_name("probe"))
    try:
        return _PUBLISHERS[publish](fd, None, target)
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)


def _probe_direct(directory: str, publish: str, perms: _Perms) -> bool:
    """Whether an aligned O_DIRECT write and read work in ``directory``."""
    if not _O_DIRECT:
        return False
    page = memoryview(mmap.mmap(-1, _ALIGN))
    try:
        fd, temp = _create_file(directory, publish, True, perms, access=os.O_RDWR)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    try:
        _write_all(fd, [page])
        return _read_all(fd, [page]) == _ALIGN
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        os.close(fd)
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        page.release()


# -- start-up: config.json, leftovers, access record -----------------------------------------


def _write_config(ns_dir: str, ctx: TierContext, perms: _Perms) -> None:
    """Create ``config.json`` once (atomically); warn if an existing one differs."""
    path = os.path.join(ns_dir, "config.json")
    fields = ctx.namespace_fields()
    data = json.dumps(fields, indent=2, sort_keys=True).encode() + b"\n"
    temp = os.path.join(ns_dir, _temp_name("config.json"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, perms.file)
    with open(fd, "wb") as f:
        if perms.fix:
            os.fchmod(fd, perms.file)
        f.write(data)
    try:
        os.link(temp, path)
    except FileExistsError:
        _check_config(path, fields)
    except OSError:  # no hard links here: a rename is atomic too
        if not os.path.exists(path):
            os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _check_config(path: str, fields: dict[str, object]) -> None:
    try:
        with open(path, "rb") as f:
            existing = json.load(f)
    except (OSError, ValueError) as exc:
        log.warning("fs tier config.json unreadable", path=path, error=str(exc))
        return
    if existing != json.loads(json.dumps(fields)):
        log.warning("fs tier config.json differs from this configuration", path=path)


def _scan(
    ns_dir: str, rank_dir: str, *, want_blocks: bool
) -> tuple[list[tuple[int, str, int]], list[str]]:
    """Block files ``(mtime_ns, path, size)`` (if wanted) and temporaries, in one walk."""
    temps = [entry.path for entry in _scandir(ns_dir) if _TEMP_RE.fullmatch(entry.name)]
    blocks = []
    for directory, _dirs, names in os.walk(rank_dir):
        for name in names:
            path = os.path.join(directory, name)
            if _TEMP_RE.fullmatch(name):
                temps.append(path)
            elif want_blocks and name.endswith(".bin"):
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode):
                        blocks.append((st.st_mtime_ns, path, st.st_size))
    return blocks, temps


def _scandir(directory: str) -> Iterator[os.DirEntry[str]]:
    with os.scandir(directory) as entries:
        yield from entries


def _remove_dead_temps(temps: Sequence[str]) -> None:
    removed = 0
    for path in temps:
        match = _TEMP_RE.fullmatch(os.path.basename(path))
        if match is None or not _writer_is_dead(match[1], int(match[2]), int(match[3])):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    if removed:
        log.info("fs tier removed leftover temporary files", count=removed)


def _writer_is_dead(token: str, pid: int, start: int) -> bool:
    """Provably dead only: same host and pid namespace, and no such pid with that start."""
    if token != _identity().token:
        return False
    return _process_start(pid) != start


@dataclass(frozen=True)
class _Identity:
    token: str  # host + pid namespace
    pid: int
    start: int  # start time in clock ticks since boot


_sequence = itertools.count()
_me: list[_Identity] = []  # this process's identity, computed once; a forked child resets it
os.register_at_fork(after_in_child=_me.clear)


def _identity() -> _Identity:
    if not _me:
        pid = os.getpid()
        try:
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = ""
        token = hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]
        _me[:] = [_Identity(token, pid, _process_start(pid) or 0)]
    return _me[0]


def _temp_name(stem: str) -> str:
    me = _identity()
    return f".{stem}.{me.token}-{me.pid}-{me.start}-{next(_sequence)}.tmp"


def _process_start(pid: int) -> int | None:
    """Start time of live process ``pid`` (field 22 of /proc/<pid>/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _identity_of(fd: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the open file ``fd``."""
    try:
        opened = os.fstat(fd)
    except OSError:
        return None
    return opened.st_dev, opened.st_ino


def _discard(path: str, identity: tuple[int, int] | None) -> bool:
    """Delete ``path`` (a link itself, never its target); with ``identity`` (device,
    inode), only if it still is the file that was read (a peer may have published a good
    one since). True if deleted."""
    try:
        current = os.lstat(path)
        if identity is not None and identity != (current.st_dev, current.st_ino):
            return False
        if stat.S_ISDIR(current.st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        return False
    return True


def _unlink_all(paths: Sequence[str]) -> list[str]:
    """Unlink each of ``paths``; the ones that were there."""
    gone = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone.append(path)
    return gone


def _key_of(path: str) -> bytes | None:
    """The key of the block file at ``path`` (the inverse of `block_relpath`)."""
    directory, name = os.path.split(path)
    hexkey, dot, ext = name.rpartition(".")
    _, sep, group = os.path.basename(directory).rpartition("_g")
    try:
        if not (dot and ext == "bin" and sep):
            return None
        return make_offload_key(bytes.fromhex(hexkey), int(group))
    except ValueError:
        return None


class _Removed:
    """Keys of block files the tier deleted on its own, for `FsTier.take_removed`, and
    counts by reason (thread-safe)."""

    def __init__(self) -> None:
        self._keys: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        self.counts = {_REMOVED_DAMAGED: 0, _REMOVED_EVICTED: 0}
        self.dropped = 0

    def add(self, key: bytes, reason: str) -> None:
        with self._lock:
            self.counts[reason] += 1
            if len(self._keys) >= REMOVED_QUEUE:
                self._keys.popleft()
                self.dropped += 1
            self._keys.append(key)

    def add_paths(self, paths: Sequence[str], reason: str) -> None:
        for path in paths:
            key = _key_of(path)
            if key is not None:
                self.add(key, reason)

    def take(self) -> list[bytes]:
        with self._lock:
            keys = list(self._keys)
            self._keys.clear()
        return keys


class _Usage:
    """The LRU access record for ``max_bytes`` (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self.evicted = 0
        self._files: OrderedDict[str, int] = OrderedDict()  # path -> bytes, LRU first
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"{self.used}/{self.max_bytes}B evicted={self.evicted}"

    def seed(self, files: Sequence[tuple[int, str, int]]) -> None:
        for _mtime, path, size in sorted(files):
            self.touch(path, size)

    def touch(self, path: str, size: int) -> None:
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
            else:
                self._files[path] = size
                self.used += size

    def forget(self, path: str) -> None:
        with self._lock:
            self.used -= self._files.pop(path, 0)

    def admit(self, path: str, size: int) -> list[str]:
        """Record ``path`` as newest; return the files to delete to stay under the limit."""
        if size > self.max_bytes:
            raise OSError(errno.EFBIG, f"a block file of {size} bytes exceeds max_bytes")
        self.touch(path, size)
        return self.trim()

    def trim(self) -> list[str]:
        with self._lock:
            victims = []
            while self.used > self.max_bytes and len(self._files) > 1:
                victim, size = self._files.popitem(last=False)
                self.used -= size
                victims.append(victim)
            self.evicted += len(victims)
            return victims
