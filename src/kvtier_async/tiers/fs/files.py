"""The blocking half of the fs tier: `BlockFiles`, plain synchronous code that any worker
thread may call, for one open root.

*Store.* Skip when a complete file is there (a wrong-sized one or a link is deleted and
reported: names appear only with the whole file behind them). Otherwise write header + payload
in one call to a new file in the target directory, optionally ``fsync``, and publish it
atomically (`kvtier_async.tiers.fs.publish`). On any error the temporary is gone (unlinked, or
never linked) and only that key fails.

*Load.* Read into the slot itself, opened ``O_NOFOLLOW``; on a short read, a file of the
wrong size, a bad header or a checksum mismatch the key fails and its file is deleted
(only if it is still the file that was read), so later lookups answer False; a symbolic
link is never followed, only unlinked. A missing file is a plain miss. Lookups ``lstat``:
a link is no block.

*Deleting.* Every file the tier deletes on its own (a damaged block, a ``max_bytes``
victim, a dead writer's temporary) is reached through the descriptors of its parent
directories, never through a link below the root (`kvtier_async._beneath`), and the open
scan never enters one: a rank or fan-out directory swapped for a link to elsewhere cannot
make the tier delete outside its root.

*Two paths, one outcome.* When the C helper could be built and files are published by rename,
a batch goes to it (`kvtier_async.tiers.fs.native_batch`), spread over its worker threads;
otherwise the Python path (`kvtier_async.tiers.fs.blockio`) runs the same steps block by block.
Both report the same outcomes, delete the same files and log the same warnings.

*Directories come back.* If an operator removes the root, the namespace or a rank directory
while the tier runs, the next store's create fails with ``ENOENT``: the tier forgets what it
knew, makes every missing level again (``config.json`` with a new namespace directory) and
retries that block once, on both I/O paths.

*Warnings* about single blocks (a failed store, an unreadable file...) are rate-limited
(`kvtier_async._log.RateLimited`, per tier: one line per event per `WARN_INTERVAL_S`, then
a count), so a full disk or a dead root does not log a line per block.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvtier_async._beneath import discard, unlink_all
from kvtier_async._log import RateLimited, get_logger
from kvtier_async._safefile import SAFE_READ_FLAGS
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.blockfile import (
    HEADER_BYTES,
    CorruptBlockError,
    block_relpath,
    pack_header,
)
from kvtier_async.tiers.checksum import CHECKSUM_NAME
from kvtier_async.tiers.fs import native
from kvtier_async.tiers.fs.blockio import (
    O_DIRECT,
    header_page,
    identity_of,
    is_aligned,
    open_file,
    open_problem,
    read_block,
    write_all,
)
from kvtier_async.tiers.fs.native import FsIo, Workers
from kvtier_async.tiers.fs.native_batch import NativeBatch, Pages, scratch_pages
from kvtier_async.tiers.fs.native_source import (
    LOAD_OK,
    STEP_NAMES,
    STEP_OPEN,
    STORE_FAILED,
    STORE_PRESENT,
    STORE_WRITTEN,
)
from kvtier_async.tiers.fs.publish import (
    PUBLISHERS,
    Directories,
    IoMode,
    Perms,
    check_own_dirs,
    create_file,
    make_dirs,
    narrow_dir,
    probe,
    write_config,
)
from kvtier_async.tiers.fs.records import (
    REMOVED_DAMAGED,
    REMOVED_EVICTED,
    Removed,
    StoreErrors,
    Usage,
    scan,
)
from kvtier_async.tiers.fs.tempfiles import remove_dead_temps

__all__ = [
    "STORE_FAILED",
    "STORE_PRESENT",
    "STORE_WRITTEN",
    "WARN_INTERVAL_S",
    "BlockFiles",
    "Reports",
    "python_io",
]

log = get_logger(__name__)

WARN_INTERVAL_S: Final = 10.0
# Tests that inject faults through the seams of `blockio` switch the C path off with it.
_native_fsio: Callable[[], FsIo | None] = native.native_fsio


@contextlib.contextmanager
def python_io() -> Iterator[None]:
    """Tiers opened in the body run the Python I/O path, as with ``KVTIER_NATIVE_FS=0``
    (what `kvtier bench fs` compares the C path with). Not thread-safe: for one caller that
    opens tiers, not for a running service."""
    global _native_fsio
    saved = _native_fsio
    _native_fsio = _no_native
    try:
        yield
    finally:
        _native_fsio = saved


def _no_native() -> FsIo | None:
    return None


def _warnings() -> RateLimited:
    return RateLimited(log, WARN_INTERVAL_S)


@dataclass(frozen=True)
class Reports:
    """What the blocking half tells its tier, which outlives each open: the keys it removed,
    why stores failed, and its rate-limited warnings (``warn.suppressed``: lines not logged)."""

    removed: Removed = field(default_factory=Removed)
    store_errors: StoreErrors = field(default_factory=StoreErrors)
    warn: RateLimited = field(default_factory=_warnings)


class BlockFiles:
    """Blocking block-file operations; every method may run in any worker thread. The C
    path (`_store_batch`, `_load_batch`, below) runs its batches with the public methods the
    Python path uses for each block: one set of checks, records and warnings."""

    def __init__(
        self,
        name: str,
        root: str,
        ctx: TierContext,
        mode: IoMode,
        fsync: bool,
        usage: Usage | None,
        workers: tuple[int, int],
        perms: Perms,
        reports: Reports,
    ) -> None:
        self.name = name
        self.root = root
        self.ctx = ctx
        self.mode = mode
        self.fsync = fsync
        self.usage = usage
        self.perms = perms
        self.removed = reports.removed
        self.store_errors = reports.store_errors
        self.warn = reports.warn
        self.file_bytes = HEADER_BYTES + ctx.block_bytes
        ns_dir = os.path.join(root, ctx.namespace)
        known = {root, ns_dir, os.path.join(ns_dir, f"r{ctx.rank}")}
        # The C batch path publishes by rename; the O_TMPFILE ways stay in Python. Lookups
        # use the helper whenever it could be built.
        self.lookup_io = _native_fsio()
        self.fsio = self.lookup_io if mode.publish == "rename" else None
        make_many = self.fsio.make_dirs if self.fsio is not None else None
        self.dirs = Directories(ns_dir, known, ctx, perms, self.warn, make_many)
        self._publish = PUBLISHERS[mode.publish]
        self.workers = Workers(self.fsio, name, *workers)

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
        perms: Perms,
        reports: Reports,
    ) -> BlockFiles:
        """Blocking: directories, config.json, probe, clean-up, access record."""
        ns_dir = os.path.join(root, ctx.namespace)
        rank_dir = os.path.join(ns_dir, f"r{ctx.rank}")
        make_dirs(rank_dir, perms)
        check_own_dirs(root, f"{ctx.namespace}/r{ctx.rank}")  # no link: refused
        narrow_dir(ns_dir, perms)
        write_config(ns_dir, ctx, perms)
        mode = probe(rank_dir, perms)
        found = scan(root, ctx.namespace, f"r{ctx.rank}", want_blocks=max_bytes is not None)
        blocks, temps = found
        remove_dead_temps(root, temps)
        usage = None if max_bytes is None else Usage(max_bytes)
        if usage is not None:
            usage.seed(blocks)
            reports.removed.add_paths(unlink_all(root, usage.trim()), REMOVED_EVICTED)
        return cls(name, root, ctx, mode, fsync, usage, workers, perms, reports)

    def describe(self) -> str:
        io = self.mode.describe()
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
        """Whether each key's block file is there (a regular file of a block file's size).
        With the C helper, one call for the batch: a system call per key in Python gives
        the GIL up and takes it back each time, which costs a switch interval per key
        while another thread computes (the scheduler's)."""
        native = self.lookup_io
        if native is None:
            return [self._exists(key) for key in keys]
        paths: list[bytes] = []
        valid: list[int] = []
        for index, key in enumerate(keys):
            try:
                paths.append(os.fsencode(self.path(key)))
            except ValueError:  # not an offload key: no block
                continue
            valid.append(index)
        found = [False] * len(keys)
        if paths:
            for index, flag in zip(valid, native.exists_many(paths, self.file_bytes)):
                found[index] = flag
        return found

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
        """Store each block: `STORE_FAILED`, `STORE_PRESENT` or `STORE_WRITTEN` per key."""
        if self.fsio is not None:
            outcomes = _store_batch(self, self.fsio, keys, blocks)
        else:
            pairs = zip(keys, blocks, strict=True)
            outcomes = [self._store_or_fail(key, block) for key, block in pairs]
        if STORE_WRITTEN in outcomes and STORE_FAILED not in outcomes:
            self.store_errors.wrote()
        return outcomes

    def _store_or_fail(self, key: bytes, block: memoryview) -> int:
        try:
            return self._store(key, block)
        except (OSError, ValueError) as exc:
            self.store_failed(key, exc)
            return STORE_FAILED

    def store_failed(self, key: bytes, exc: Exception) -> None:
        self.store_errors.failed(exc)
        self.warn("fs store failed", tier=self.name, key=key.hex(), error=str(exc))

    def _store(self, key: bytes, block: memoryview) -> int:
        self.check_block(block)
        path = self.path(key)
        made_dir = self.dirs.ensure(os.path.dirname(path))
        if not made_dir and self._present(key, path):  # a directory made just now is empty
            self.touch(path)
            return STORE_PRESENT
        if self.usage is not None:
            self.evict(self.usage.admit(path, self.file_bytes))
        try:
            return self._write(path, key, block)
        except BaseException:
            self.forget(path)
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
            self.warn("fs block file has the wrong size or is a link, deleting it", path=path)
            if discard(self.root, path):
                self.removed.add(key, REMOVED_DAMAGED)
            return False
        return stat.S_ISREG(st.st_mode)

    def _write(self, path: str, key: bytes, block: memoryview) -> int:
        """Write a new file for ``key`` and publish it at ``path``."""
        page = header_page()
        pack_header(page, key, block)
        directory = os.path.dirname(path)
        fd, temp = self._create(directory, self.mode.direct and is_aligned(block))
        try:
            write_all(fd, [page, block])
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
            return STORE_WRITTEN
        if self._is_block_file(path):  # a peer published the same key first
            return STORE_PRESENT
        raise FileExistsError(errno.EEXIST, "something that is not a block file is there", path)

    def _create(self, directory: str, direct: bool) -> tuple[int, str | None]:
        """A new file open for writing in ``directory`` (made by the caller): ``(fd, temp name
        or None)``."""
        try:
            return create_file(directory, self.mode.publish, direct, self.perms)
        except FileNotFoundError:  # directories vanished under us: forget them, make them
            self.dirs.forget()
            self.dirs.ensure(directory)
            return create_file(directory, self.mode.publish, direct, self.perms)

    def check_block(self, block: memoryview, *, into: bool = False) -> None:
        if block.nbytes != self.ctx.block_bytes:
            raise ValueError(f"block is {block.nbytes} bytes, expected {self.ctx.block_bytes}")
        if not block.c_contiguous:
            raise ValueError("block memory must be C-contiguous")
        if into and block.readonly:
            raise ValueError("cannot load into read-only block memory")

    # -- loads ---------------------------------------------------------------------------

    def load_many(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[int]:
        if self.fsio is not None:
            return _load_batch(self, self.fsio, keys, blocks)
        return [int(self._load(key, block)) for key, block in zip(keys, blocks, strict=True)]

    def _load(self, key: bytes, block: memoryview) -> bool:
        try:
            self.check_block(block, into=True)
            path = self.path(key)
            direct = self.mode.direct and is_aligned(block)
        except ValueError as exc:
            self.refuse_load(key, exc)
            return False
        try:
            fd = open_file(path, SAFE_READ_FLAGS | (O_DIRECT if direct else 0))  # FIFO: no wait
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.fail_load(key, path, None, open_problem(exc))
            return False
        try:
            read_block(fd, key, block)
        except (OSError, CorruptBlockError) as exc:
            self.fail_load(key, path, identity_of(fd), exc)
            return False
        finally:
            os.close(fd)
        self.touch(path)
        return True

    def fail_load(
        self, key: bytes, path: str, identity: tuple[int, int] | None, exc: Exception
    ) -> None:
        self.warn("fs block unreadable, deleting it", tier=self.name, path=path, error=str(exc))
        self.forget(path)
        if discard(self.root, path, identity):
            self.removed.add(key, REMOVED_DAMAGED)

    def refuse_load(self, key: bytes, exc: Exception) -> None:
        self.warn("fs load refused", tier=self.name, key=key.hex(), error=str(exc))

    # -- access record -------------------------------------------------------------------

    def touch(self, path: str) -> None:
        if self.usage is not None:
            self.usage.touch(path, self.file_bytes)

    def forget(self, path: str) -> None:
        if self.usage is not None:
            self.usage.forget(path)

    def evict(self, victims: Sequence[str]) -> None:
        self.removed.add_paths(unlink_all(self.root, victims), REMOVED_EVICTED)


# -- the C path's batches -------------------------------------------------------------------

# A store's result when its temporary could not be created for lack of a directory.
_GONE: Final = (-errno.ENOENT, STEP_OPEN)


def _store_batch(
    files: BlockFiles, fsio: FsIo, keys: Sequence[bytes], blocks: Sequence[memoryview]
) -> list[int]:
    """`BlockFiles.store_many` through the C loop: Python prepares names, directories and
    headers, C stores, Python applies the results (access record, removals, warnings)."""
    outcomes = [STORE_FAILED] * len(keys)
    batch = _batch_of_stores(files, keys, blocks)
    if not batch.indexes:
        return outcomes
    heads = scratch_pages("store", len(batch.indexes))
    batch.fill_headers(heads)
    results = _run_stores(files, fsio, batch, heads)
    for j, (code, step) in enumerate(results):
        index, path = batch.indexes[j], batch.paths[j]
        if batch.noted[j]:
            files.warn("fs block file had the wrong size or was a link, replaced it",
                       path=path)  # fmt: skip
            files.removed.add(batch.keys[j], REMOVED_DAMAGED)
        if code == STORE_WRITTEN:
            outcomes[index] = STORE_WRITTEN
        elif code == STORE_PRESENT:
            files.touch(path)
            outcomes[index] = STORE_PRESENT
        else:
            files.forget(path)
            call = STEP_NAMES.get(step, "store")
            error = OSError(-code, f"{call}: {os.strerror(-code)}", path)
            files.store_failed(keys[index], error)
    return outcomes


def _batch_of_stores(
    files: BlockFiles, keys: Sequence[bytes], blocks: Sequence[memoryview]
) -> NativeBatch:
    """The batch of the blocks that may be stored (the others fail here); their directories
    exist."""
    wanted: list[tuple[int, bytes, memoryview, str, str]] = []
    for index, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        try:
            files.check_block(block)
            path = files.path(key)
        except (OSError, ValueError) as exc:
            files.store_failed(key, exc)
            continue
        wanted.append((index, key, block, path, os.path.dirname(path)))
    made, failed = files.dirs.ensure_many(directory for *_, directory in wanted)
    batch = NativeBatch()
    for index, key, block, path, directory in wanted:
        error = failed.get(directory)
        if error is not None:
            files.store_failed(key, error)
            continue
        new_dir = directory in made  # a new directory holds no block: no lstat first
        made.discard(directory)
        batch.add(
            index, key, block, path, directory=directory, check=not new_dir,
            direct=files.mode.direct,
        )  # fmt: skip
    return batch


def _run_stores(
    files: BlockFiles, fsio: FsIo, batch: NativeBatch, heads: Pages
) -> list[tuple[int, int]]:
    """Store every block of ``batch``: ``(result, failed step)`` each. With ``max_bytes``,
    one block at a time, so that evictions never hit a block of this batch; blocks whose
    directories vanished under us are tried once more after making them again."""
    pool = files.workers.pool("write")
    if files.usage is None:
        everything = range(len(batch.indexes))
        results = batch.store(fsio, pool, heads, files.fsync, files.perms, everything)
    else:
        results = []
        for j, path in enumerate(batch.paths):
            try:
                files.evict(files.usage.admit(path, files.file_bytes))
            except OSError as exc:  # a block file larger than max_bytes
                results.append((-(exc.errno or errno.EIO), 0))
                continue
            results += batch.store(fsio, pool, heads, files.fsync, files.perms, [j])
    retry = [j for j, (code, step) in enumerate(results) if (code, step) == _GONE]
    if retry:  # forget the directories known, make them, once more
        files.dirs.forget()
        try:
            for j in retry:
                files.dirs.ensure(batch.dirs[j])
        except OSError as exc:
            files.warn("fs tier cannot make its directories again", tier=files.name,
                       error=str(exc))  # fmt: skip
        again = batch.store(fsio, pool, heads, files.fsync, files.perms, retry)
        for j, result in zip(retry, again, strict=True):
            results[j] = result
    return results


def _load_batch(
    files: BlockFiles, fsio: FsIo, keys: Sequence[bytes], blocks: Sequence[memoryview]
) -> list[int]:
    """`BlockFiles.load_many` through the C loop, with the checks of `verify_block`."""
    outcomes = [0] * len(keys)
    batch = NativeBatch()
    for index, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        try:
            files.check_block(block, into=True)
            path = files.path(key)
        except ValueError as exc:
            files.refuse_load(key, exc)
            continue
        batch.add(index, key, block, path, direct=files.mode.direct)
    if not batch.indexes:
        return outcomes
    heads = scratch_pages("load", len(batch.indexes))
    pool = files.workers.pool("read")
    for j, (code, problem, identity) in enumerate(batch.load(fsio, pool, heads)):
        path = batch.paths[j]
        if code == LOAD_OK:
            files.touch(path)
            outcomes[batch.indexes[j]] = 1
        elif problem is not None:  # not a plain miss
            files.fail_load(batch.keys[j], path, identity, problem)
    return outcomes
