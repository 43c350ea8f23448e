"""The fs tier's batch I/O in C, seen from Python: the helper's binding (`FsIo`), its pools of
C worker threads (`Pool`) and a tier's pair of them (`Workers`).

`FsTier` hands each store or load batch to this helper. In Python each block costs about
ten system calls and their wrappers, a CRC-32C pass, header packing and, between every
step, a fight for the GIL with 15 other workers and the event loop: on the 2-core dev box
that held 256 KiB stores to 0.55-0.74x of parallel ``dd``. Here the same steps run in C
(`FsIo.run`; the source and what it does per block: `kvtier_async.tiers.fs.native_source`),
called through ctypes, which releases the GIL for the whole batch; Python keeps what needs its
data structures (paths, the directory cache, the access record, logging:
`kvtier_async.tiers.fs.native_batch` prepares a batch and reads its results). The file format
and the outcome of every step are those of the Python path (`kvtier_async.tiers.fs.blockio`),
which remains the fallback (no C compiler, ``KVTIER_NATIVE_FS=0``) and the reference the tests
hold this one to.

A batch runs on a `Pool`: ``n`` C threads (named ``kvfs-r-<tier>`` / ``kvfs-w-<tier>``)
that take the blocks of the queued batches one at a time, in order, while the calling
thread waits; so one worker-thread call per batch keeps ``n`` blocks in flight, and a
2 MiB block costs no thread hop of its own (per 2 MiB load: 0.19 instead of 0.27 core-s/GB
measured, with one call per two blocks before). Without a pool (none could start, it is
closed, or this is a forked child, which has none of its threads) a batch runs in the
calling thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import crc32c

from kvtier_async._log import get_logger
from kvtier_async._native import BUILD_ERRORS, disabled, load_library
from kvtier_async.tiers.fs.native_source import KIND_LOAD, KIND_STORE

__all__ = [
    "FsIo",
    "LoadArgs",
    "Pool",
    "PoolClosedError",
    "StoreArgs",
    "Workers",
    "native_fsio",
]

log = get_logger(__name__)

MODULE: Final = "kvtier_async.tiers.fs._fsio"  # _fsio.c, built with the package

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32


class StoreArgs(ctypes.Structure):
    """``struct store_args``: one batch of stores (arrays by address, one entry per block)."""

    _fields_ = [
        ("n", _I64), ("temps", _P), ("finals", _P), ("check", _P), ("heads", _P),
        ("bodies", _P), ("flags", _P), ("body_n", _I64), ("do_fsync", _I32), ("file_mode", _I32),
        ("fix_mode", _I32), ("result", _P), ("step", _P), ("noted", _P),
    ]  # fmt: skip


class LoadArgs(ctypes.Structure):
    """``struct load_args``: one batch of loads (arrays by address, one entry per block)."""

    _fields_ = [
        ("n", _I64), ("paths", _P), ("heads", _P), ("bodies", _P), ("flags", _P),
        ("expect", _P), ("body_n", _I64), ("result", _P), ("step", _P), ("got", _P), ("dev", _P),
        ("ino", _P),
    ]  # fmt: skip


@dataclass(frozen=True)
class FsIo:
    """The compiled helper: `run` a batch (what C does per block: `native_source`),
    `crc32c`, and the worker pools (`Pool`)."""

    library: ctypes.CDLL
    hardware_crc: bool
    folding_crc: bool = False  # VPCLMULQDQ folding for buffers from 256 bytes

    def crc32c(self, address: int, nbytes: int) -> int:
        value: int = self.library.kvtier_crc32c(address, nbytes)
        return value

    def exists_many(self, paths: list[bytes], file_bytes: int) -> list[bool]:
        """Whether each path names a regular file of ``file_bytes`` bytes (``lstat``: a link
        is no block file), in this thread with the GIL released once for the batch."""
        n = len(paths)
        found = (ctypes.c_ubyte * n)()
        self.library.kvtier_exists_many(n, (ctypes.c_char_p * n)(*paths), file_bytes, found)
        return [bool(flag) for flag in found]

    def make_dirs(self, dirs: list[str], mode: int, fix: bool) -> list[int]:
        """``mkdir`` each directory with ``mode`` (its parent first if missing; ``fix``:
        ``chmod`` them to it too), in this thread with the GIL released once: 1 made, 0
        there already, -errno failed (-ENOENT: more than the parent is missing)."""
        n = len(dirs)
        codes = (ctypes.c_int32 * n)()
        names = (ctypes.c_char_p * n)(*map(os.fsencode, dirs))
        parents = (ctypes.c_char_p * n)(*(os.fsencode(os.path.dirname(d)) for d in dirs))
        self.library.kvtier_make_dirs(n, names, parents, mode, int(fix), codes)
        return list(codes)

    def run(self, pool: Pool | None, args: StoreArgs | LoadArgs) -> None:
        """Run one batch on ``pool``'s workers (None: in this thread); returns when done."""
        kind = KIND_STORE if isinstance(args, StoreArgs) else KIND_LOAD
        if pool is not None:
            try:
                with pool.use() as handle:
                    self.library.kvtier_run(handle, kind, ctypes.byref(args))
                return
            except PoolClosedError:
                pass  # closed under a call in flight, or a forked child: this thread
        self.library.kvtier_run(None, kind, ctypes.byref(args))

    def pool(self, threads: int, name: str) -> Pool | None:
        """A pool of ``threads`` workers named ``name``; None if no thread could start."""
        handle = self.library.kvtier_pool_new(threads, name.encode()[:15])
        if not handle:
            return None
        return Pool(self.library, handle, self.library.kvtier_pool_threads(handle), name)

    def describe(self) -> str:
        crc = "hardware" if self.hardware_crc else "table"
        return f"native(crc32c={crc}{'+vpclmulqdq' if self.folding_crc else ''})"


class Pool:
    """C worker threads for batches (``kvtier_pool_*``). `use` counts the calls in flight,
    so `close` frees the threads only after the last one has returned; after `close`, or in
    a child process after ``fork`` (which has none of the threads), `use` raises
    `PoolClosedError` and callers run the batch in their own thread instead."""

    def __init__(self, library: ctypes.CDLL, handle: int, threads: int, name: str) -> None:
        self._library = library
        self._handle: int | None = handle
        self._pid = os.getpid()
        self._busy = 0
        self._idle = threading.Condition()
        self.threads = threads
        self.name = name

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        """The pool's handle, counted as in use for the ``with`` body."""
        with self._idle:
            if self._handle is None or self._pid != os.getpid():
                raise PoolClosedError(f"worker pool {self.name!r} is closed")
            self._busy += 1
            handle = self._handle
        try:
            yield handle
        finally:
            with self._idle:
                self._busy -= 1
                if not self._busy:
                    self._idle.notify_all()

    def close(self) -> None:
        """Blocking: wait for the calls in flight, then stop and join the workers."""
        with self._idle:
            handle, self._handle = self._handle, None
            self._idle.wait_for(lambda: not self._busy)
        if handle is not None and self._pid == os.getpid():
            self._library.kvtier_pool_free(handle)


class PoolClosedError(RuntimeError):
    """A batch was given to a `Pool` that is closed (or belongs to the parent process)."""


@functools.cache
def native_fsio() -> FsIo | None:
    """The compiled helper, or None when disabled (``KVTIER_NATIVE_FS=0``), not Linux, or
    it was not built with the package, or its CRC-32C disagrees with the ``crc32c`` package."""
    if disabled("KVTIER_NATIVE_FS") or not hasattr(os, "O_DIRECT"):
        return None
    try:
        library = load_library(MODULE)
    except BUILD_ERRORS as exc:
        log.info("native fs I/O unavailable; using the Python path", error=str(exc))
        return None
    library.kvtier_crc32c.argtypes = [_P, ctypes.c_size_t]
    library.kvtier_crc32c.restype = ctypes.c_uint32
    library.kvtier_crc32c_hardware.argtypes = []
    library.kvtier_crc32c_hardware.restype = ctypes.c_int
    library.kvtier_make_dirs.argtypes = [_I64, _P, _P, _I32, _I32, _P]
    library.kvtier_make_dirs.restype = None
    library.kvtier_exists_many.argtypes = [_I64, _P, _I64, _P]
    library.kvtier_exists_many.restype = None
    library.kvtier_run.argtypes = [_P, _I32, _P]
    library.kvtier_run.restype = None
    library.kvtier_pool_new.argtypes = [_I32, ctypes.c_char_p]
    library.kvtier_pool_new.restype = _P
    library.kvtier_pool_threads.argtypes = [_P]
    library.kvtier_pool_threads.restype = _I32
    library.kvtier_pool_free.argtypes = [_P]
    library.kvtier_pool_free.restype = None
    level = library.kvtier_crc32c_hardware()  # 0 table, 1 CRC instruction, 2 and folding
    fsio = FsIo(library, level >= 1, level >= 2)
    sample = bytes(range(256)) * 17 + b"123456789"
    buffer = ctypes.create_string_buffer(sample, len(sample))
    for start in (0, 1, 3, 8, len(sample) - 9):
        address = ctypes.addressof(buffer) + start
        if fsio.crc32c(address, len(sample) - start) != crc32c.crc32c(sample[start:]):
            log.warning("native CRC-32C disagrees with the crc32c package; not using it",
                        machine=platform.machine())  # fmt: skip
            return None
    return fsio


class Workers:
    """The C worker pools of one open tier (`Pool`), ``read`` and ``write``, each started
    at its first batch, so a tier that only answers lookups starts no thread. Both are joined
    by `close`, or when the tier is collected without one."""

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
