"""The CPU tier's physical store: one shared, page-aligned mmap file per instance.

Theory of operation
-------------------
Every worker (TP rank, usually a separate process) of an engine instance maps the
same file, ``<directory>/kvtier_<instance_id>.mmap`` (``/dev/shm`` by default), so
a secondary tier in any process can read any slot without a copy.

*Creation race.* Each worker tries ``open(O_CREAT | O_EXCL | O_NOFOLLOW)``, mode
0600. The one that wins is the creator: it checks free space, writes an owner record
beside the file (``.owner``, see :mod:`._owner`), then ``ftruncate``\\ s the file to
its final size, which is what the others wait for. The others open the existing file
(``O_NOFOLLOW``: a symbolic link there is refused) and refuse it unless it is a regular
file owned by this user that nobody else may read or write (mode 0600 or narrower), then
poll ``fstat`` until the size is right (a constructor at process start-up, not the event
loop, so a short poll is fine). They fail fast when the creator unlinked the file
(``st_nlink == 0``: it failed) or when the size or layout differs from theirs (another
configuration). If the creator fails after winning, it removes the file so waiters fail
fast.

*Mappers hold a lock.* Every handle holds ``flock(LOCK_SH)`` on the region file for as
long as it maps it (the descriptor stays open until the mapping is gone; a forked child
shares it). So ``flock(LOCK_EX | LOCK_NB)`` succeeds only when no live process maps the
file: the kernel drops a process's locks when it dies, ``kill -9`` included.

*One owner.* A handle made with a ``role`` (every product face makes one: the cache of
:class:`~kvtier_async.TieredKVCache` as worker 0, a vLLM worker as its rank, vLLM's
scheduler as ``"scheduler"``) claims its place in the region with an open-file-description
write lock (``F_OFD_SETLK``) on one byte of the region file: byte 0 for the scheduler,
``1 + rank`` for a worker. The lock lives on the descriptor the mapping keeps, so it is
held exactly as long as the mapping and dropped by the kernel when the process dies
(``kill -9`` and ``SIGTERM`` included): nothing is left on disk. A second handle for a
place already held, in this process or another, is refused with
:class:`RegionClaimedError` naming the ``instance_id`` and the creator's pid. A handle with a
``token`` (the engine's: vLLM's ``engine_id``; a random one per cache) also refuses a region
whose creator recorded another token: another engine that picked the same ``instance_id``.
Without a role (benchmarks, tests of the mapping itself) nothing is claimed.

*Reclaim.* A handle that finds the region of a creator that is provably dead (its owner
record names this file, and its process is gone: see :func:`._owner.is_alive`) removes it
and races to create it anew, but only when no live process maps it: reclaimers serialise
on ``flock(LOCK_EX)`` of the owner record, re-check everything under it, then take
``LOCK_EX | LOCK_NB`` on the region. If that fails, a live process still maps the region
and the handle raises :class:`StaleRegionError` instead. So a restart after a crash
(``kill -9``) with the same ``instance_id`` just works, in every face that builds a
``SharedRegion``. A joiner takes its shared lock only after judging the owner alive and
then checks that the file is still linked at its path, so it never maps a file that was
reclaimed under it. A creator also sweeps its directory once (:func:`remove_stale_regions`),
so the regions of dead processes with other ids (a fresh id each start) do not pile up.

*Layout.* A slot is padded to a page-aligned row of ``row_bytes`` and rows are
interleaved by worker: slot ``b`` of worker ``w`` is row ``b * num_workers + w``::

    w0_b0 | w1_b0 | ... | w{n-1}_b0 | w0_b1 | w1_b1 | ...

Every slot starts on a page boundary, so O_DIRECT reads may target it.

*Prefaulting.* Each worker pre-faults its own rows with
``madvise(MADV_POPULATE_WRITE)`` (one call when it is the only worker), falling
back on older kernels to a read-modify-write of one byte per page, which keeps
whatever a peer has already written.

*Views.* ``rows``, ``slot_view``, ``numpy`` and ``torch`` all alias the mapping
(checked against its address, never copied). Each one pins the mapping: a mapping
cannot be unmapped while any of them, or any slice of them, is alive, so callers
must drop them before :meth:`SharedRegion.close`, which otherwise raises
:class:`RegionInUseError` (after unlinking the file; call it again once the views
are gone).

*Clean-up.* The creator unlinks the file on close; peers keep their mappings
until they close. If the creator dies without closing, its reaper (a helper process per
creating process, :mod:`._reaper`) removes the file once no live process maps it. If the
reaper could not run, the file outlives its creator until it is reclaimed, or:
:func:`find_stale_regions` reports such files and :func:`remove_stale_regions` deletes
those that no live process maps. A region whose creator is alive is never reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import math
import mmap
import operator
import os
import re
import stat
import struct
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal

import numpy as np
import numpy.typing as npt

from kvtier_async._cudart import runtime
from kvtier_async._log import get_logger
from kvtier_async.memory import _reaper
from kvtier_async.memory._owner import (
    OwnerRecord,
    is_alive,
    read_owner,
    read_owner_fd,
    write_owner,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "RegionClaimedError",
    "RegionError",
    "RegionInUseError",
    "RegionLayoutError",
    "SharedRegion",
    "StaleRegionError",
    "close_region",
    "find_stale_regions",
    "region_path",
    "remove_stale_regions",
]

log = get_logger(__name__)

PAGE_SIZE: Final = mmap.PAGESIZE
# MADV_POPULATE_WRITE appeared in Linux 5.14; Python's mmap exports it from 3.13.
_MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_ID_PATTERN: Final = r"[A-Za-z0-9_.-]{1,200}"
_ID_RE: Final = re.compile(_ID_PATTERN)
_FILE_RE: Final = re.compile(rf"kvtier_{_ID_PATTERN}\.mmap")
_OWNER_SUFFIX: Final = ".owner"
_POLL_MAX_S: Final = 0.05
_NOFOLLOW: Final = os.O_NOFOLLOW | os.O_CLOEXEC
_sleep: Callable[[float], None] = time.sleep  # the size poll's wait; tests replace it
# ``F_OFD_SETLK`` is 37 on Linux; Python exports it from 3.9 (on Linux only).
_OFD_SETLK: Final[int] = getattr(fcntl, "F_OFD_SETLK", 37)
Role = Literal["worker", "scheduler"]


class RegionError(RuntimeError):
    """A shared region could not be created, joined or used."""


class RegionLayoutError(RegionError):
    """An existing region file was created with a different size or layout."""


class StaleRegionError(RegionError):
    """An existing region file belongs to a creator that is no longer running, and another
    live process still maps it, so it cannot be reclaimed."""


class RegionClaimedError(RegionError):
    """Another live handle already holds this place in the region (same ``instance_id``,
    same role and rank), or the region belongs to another engine (another token)."""


class RegionInUseError(RegionError, BufferError):
    """The mapping cannot be unmapped: views of it are still alive."""


def region_path(directory: str | os.PathLike[str], instance_id: str) -> Path:
    """Path of the region file of ``instance_id`` in ``directory``."""
    return Path(directory) / f"kvtier_{_check_instance_id(instance_id)}.mmap"


class SharedRegion:
    """One worker's handle on an instance's shared CPU region.

    Args:
        instance_id: Names the region; 1-200 characters from ``[A-Za-z0-9_.-]``.
        num_slots: Slots per worker (>= 1).
        slot_bytes: Usable bytes per slot (>= 1); rows are padded to whole pages.
        num_workers: Workers sharing the region (>= 1).
        worker_rank: This worker, ``0 <= worker_rank < num_workers``.
        directory: Where the file lives; ``/dev/shm`` keeps it in RAM.
        wait_timeout_s: How long a non-creator waits for the creator to size the file.
        role: Claim this handle's place, ``"worker"`` (at ``worker_rank``) or
            ``"scheduler"``, for as long as it maps the region (see *One owner* in the
            module docstring); None claims nothing.
        token: What every handle of one engine shares; a region created with another
            token is refused. None checks nothing.

    Raises:
        ValueError: An argument is invalid (the message names it).
        TimeoutError: The creator did not size the file within ``wait_timeout_s``.
        RegionLayoutError: The file was sized for a different configuration.
        StaleRegionError: The file's creator is dead but a live process still maps it.
        RegionError: The creator removed the file before sizing it, prefaulting failed, or
            the file is not this user's private regular file (a symbolic link, another
            owner, a mode wider than 0600).
        RegionClaimedError: The place ``role`` names is held by another live handle, or
            the region was created with another ``token``.
        OSError: The directory lacks space or permissions.
    """

    def __init__(
        self,
        instance_id: str,
        num_slots: int,
        slot_bytes: int,
        *,
        num_workers: int = 1,
        worker_rank: int = 0,
        directory: str | os.PathLike[str] = "/dev/shm",
        wait_timeout_s: float = 30.0,
        role: Role | None = None,
        token: str | None = None,
    ) -> None:
        self._instance_id = _check_instance_id(instance_id)
        if role not in (None, "worker", "scheduler"):
            raise ValueError(f"role must be 'worker', 'scheduler' or None, got {role!r}")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError(f"token must be a non-empty string or None, got {token!r}")
        self._role = role
        self._token = token
        self._num_slots = _check_int("num_slots", num_slots, low=1)
        self._slot_bytes = _check_int("slot_bytes", slot_bytes, low=1)
        self._num_workers = _check_int("num_workers", num_workers, low=1)
        self._rank = _check_int("worker_rank", worker_rank, low=0, high=self._num_workers)
        self._row_bytes = _round_up(self._slot_bytes, PAGE_SIZE)
        self._size = self._num_slots * self._num_workers * self._row_bytes
        self._path = region_path(_check_directory(directory), instance_id)
        deadline = time.monotonic() + _check_timeout(wait_timeout_s)
        self._closed = False
        self._cuda_registered = False
        self._pid = os.getpid()  # a forked child inherits the handle, not the ownership
        fd, self._creator = self._acquire(deadline)
        try:
            self._claim(fd)
            self._mm: mmap.mmap | None = self._map(fd)
        except BaseException:
            if self._creator:
                self._unlink()
            os.close(fd)
            raise
        # The descriptor (and its shared lock) lives as long as the mapping: closed by
        # close(), or when the mapping is collected after its last view.
        self._release_fd = weakref.finalize(self._mm, os.close, fd)
        if self._creator:
            _reaper.watch(self._path, self._inode)  # removed even if this process is killed
            _sweep(self._path.parent)
        self._address = _buffer_address(self._mm)
        log.info(
            "shared region ready",
            path=str(self._path),
            creator=self._creator,
            worker_rank=self._rank,
            size_bytes=self._size,
        )

    # -- properties -------------------------------------------------------------

    @property
    def instance_id(self) -> str:
        return self._instance_id

    @property
    def path(self) -> Path:
        return self._path

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes per row: ``slot_bytes`` rounded up to whole pages."""
        return self._row_bytes

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def worker_rank(self) -> int:
        return self._rank

    @property
    def size_bytes(self) -> int:
        """Size of the file and mapping: ``num_slots * num_workers * row_bytes``."""
        return self._size

    @property
    def is_creator(self) -> bool:
        """Whether this handle created the file (and so unlinks it on close).

        Only in the creating process: a copy inherited through ``fork`` never unlinks.
        """
        return self._creator and os.getpid() == self._pid

    @property
    def is_cuda_registered(self) -> bool:
        return self._cuda_registered

    @property
    def closed(self) -> bool:
        return self._closed

    # -- zero-copy views --------------------------------------------------------

    @property
    def rows(self) -> memoryview:
        """Every worker's rows: shape ``(num_slots * num_workers, row_bytes)``, format ``B``.

        CPython cannot index a 2-D memoryview by row (``rows[r]`` raises
        NotImplementedError); use ``rows.cast("B")`` with byte offsets,
        ``np.asarray(rows)[r]``, or :meth:`slot_view` for this worker's slots.
        """
        return memoryview(self._mapping()).cast(
            "B", (self._num_slots * self._num_workers, self._row_bytes)
        )

    def slot_view(self, slot: int, *, padded: bool = False) -> memoryview:
        """This worker's slot ``slot``: ``slot_bytes`` long, or ``row_bytes`` if ``padded``.

        The padded view spans whole pages, as O_DIRECT reads and writes need.
        """
        start = self._slot_offset(slot)
        end = start + (self._row_bytes if padded else self._slot_bytes)
        return memoryview(self._mapping())[start:end]

    def slot_address(self, slot: int) -> int:
        """Virtual address of this worker's slot ``slot`` (page-aligned)."""
        offset = self._slot_offset(slot)
        self._mapping()
        return self._address + offset

    def numpy(self) -> npt.NDArray[np.uint8]:
        """This worker's slots as a ``(num_slots, slot_bytes)`` uint8 strided array."""
        arr: npt.NDArray[np.uint8] = np.ndarray(
            (self._num_slots, self._slot_bytes),
            dtype=np.uint8,
            buffer=self._mapping(),
            offset=self._rank * self._row_bytes,
            strides=(self._row_bytes * self._num_workers, 1),
        )
        _check_zero_copy("numpy()", arr.ctypes.data, self._address + self._rank * self._row_bytes)
        return arr

    def torch(self) -> torch.Tensor:
        """:meth:`numpy` as a CPU ``torch.uint8`` tensor over the same memory."""
        import torch

        tensor = torch.from_numpy(self.numpy())
        _check_zero_copy("torch()", tensor.data_ptr(), self._address + self._rank * self._row_bytes)
        return tensor

    # -- CUDA -------------------------------------------------------------------

    def register_cuda(self) -> bool:
        """Pin the whole mapping for DMA with ``cudaHostRegister``; True on success.

        Without CUDA this does nothing and returns False. A failed registration is
        logged and not fatal: copies still work, from pageable memory, more slowly.
        """
        self._mapping()
        if self._cuda_registered:
            return True
        cudart = runtime()
        if cudart is None:
            return False
        code = int(cudart.cudaHostRegister(self._address, self._size, 0))
        if code != 0:
            log.warning(
                "cudaHostRegister failed; copies will use pageable memory",
                path=str(self._path),
                code=code,
            )
            return False
        self._cuda_registered = True
        return True

    def _unregister_cuda(self) -> None:
        if not self._cuda_registered:
            return
        self._cuda_registered = False
        cudart = runtime()
        code = -1 if cudart is None else int(cudart.cudaHostUnregister(self._address))
        if code != 0:
            log.warning("cudaHostUnregister failed", path=str(self._path), code=code)

    # -- life cycle -------------------------------------------------------------

    def close(self) -> None:
        """Unregister, unlink (if creator) and unmap. Idempotent.

        Raises:
            RegionInUseError: Views of the mapping are still alive. The region is
                closed for new views and the file is already unlinked; drop the
                views and call ``close()`` again to unmap.
        """
        mm = self._mm
        if mm is None:
            return
        if not self._closed:
            self._closed = True
            self._unregister_cuda()
            if self.is_creator:
                self._unlink()
        try:
            mm.close()
        except BufferError as exc:
            raise RegionInUseError(
                f"cannot unmap {self._path}: memoryviews, numpy arrays or tensors "
                "obtained from this region (or slices of them) are still alive; "
                "drop them and call close() again"
            ) from exc
        self._mm = None
        self._release_fd()
        log.debug("shared region closed", path=str(self._path))

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SharedRegion({self._instance_id!r}, num_slots={self._num_slots}, "
            f"slot_bytes={self._slot_bytes}, worker={self._rank}/{self._num_workers}, "
            f"creator={self._creator}, closed={self._closed})"
        )

    # -- internals --------------------------------------------------------------

    def _mapping(self) -> mmap.mmap:
        if self._closed or self._mm is None:
            raise ValueError(f"region {self._path} is closed")
        return self._mm

    def _slot_offset(self, slot: int) -> int:
        index = operator.index(slot)
        if isinstance(slot, bool) or not 0 <= index < self._num_slots:
            raise IndexError(f"slot {slot!r} out of range [0, {self._num_slots})")
        return (index * self._num_workers + self._rank) * self._row_bytes

    def _owner_path(self) -> Path:
        return _owner_path(self._path)

    def _acquire(self, deadline: float) -> tuple[int, bool]:
        """The region file open and locked shared, sized and checked; True if created."""
        while True:
            fd, created = _open_or_create(self._path, deadline)
            try:
                self._inode = os.fstat(fd).st_ino
                if created:
                    self._init_as_creator(fd)
                    return fd, True
                if self._join(fd, deadline):
                    return fd, False
            except BaseException:
                if created:
                    self._unlink()
                os.close(fd)
                raise
            os.close(fd)  # reclaimed, or gone under us: race again
            _retry_pause(self._path, deadline)

    def _init_as_creator(self, fd: int) -> None:
        _check_free_space(self._path.parent, self._size)
        os.fchmod(fd, 0o600)  # whatever the umask
        record = OwnerRecord.for_current_process(
            inode=self._inode,
            num_slots=self._num_slots,
            num_workers=self._num_workers,
            row_bytes=self._row_bytes,
            token=self._token,
        )
        write_owner(self._owner_path(), record)  # before sizing: joiners see it
        os.ftruncate(fd, self._size)

    def _join(self, fd: int, deadline: float) -> bool:
        """Join the region open at ``fd``: wait until it is sized, check its creator and
        layout, take the shared lock. False when the caller must race again: the region
        was a dead creator's and is removed now, or it went away under us."""
        delay = 0.001
        while True:
            owner = self._owner()
            if owner is not None and not is_alive(owner):
                _reclaim(self._path, fd, self._inode, owner, deadline)
                return False
            if _sized(fd, self._path, self._size):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"timed out waiting for the creator to size {self._path} to "
                    f"{self._size} bytes (it is 0 bytes)"
                )
            _sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX_S)
        owner = owner or self._owner()  # written before the file is sized
        if owner is None:
            log.warning("shared region has no owner record", path=str(self._path))
        else:
            theirs = (owner.num_slots, owner.num_workers, owner.row_bytes)
            ours = (self._num_slots, self._num_workers, self._row_bytes)
            if theirs != ours:
                raise RegionLayoutError(
                    f"{self._path} has layout (num_slots, num_workers, row_bytes)={theirs}, "
                    f"this worker expects {ours}"
                )
            if None not in (owner.token, self._token) and owner.token != self._token:
                raise RegionClaimedError(
                    f"instance_id {self._instance_id!r} is in use by another cache or engine: "
                    f"process {owner.pid} created {self._path} for it; pick another "
                    "instance_id (each cache or engine needs its own)"
                )
        return _lock(fd, fcntl.LOCK_SH) and _still_linked(fd, self._path)

    def _claim(self, fd: int) -> None:
        """Take this handle's place in the region (see *One owner*), or refuse."""
        if self._role is None:
            return
        offset = 0 if self._role == "scheduler" else 1 + self._rank
        if _claim_byte(fd, offset):
            return
        owner = self._owner()
        place = (
            "the scheduler's place" if self._role == "scheduler" else f"worker rank {self._rank}"
        )
        created = f"process {owner.pid}" if owner is not None else "a process with no owner record"
        raise RegionClaimedError(
            f"instance_id {self._instance_id!r} is in use: {place} in {self._path} is held by "
            f"another live cache or engine ({created} created the region); close it, or pick "
            "another instance_id (each cache or engine needs its own)"
        )

    def _owner(self) -> OwnerRecord | None:
        """The owner record of this region file, None if there is none (or another's)."""
        owner = read_owner(self._owner_path())
        return owner if owner is not None and owner.inode == self._inode else None

    def _map(self, fd: int) -> mmap.mmap:
        mm = mmap.mmap(fd, self._size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            _prefault(mm, *self._own_rows())
        except BaseException:
            mm.close()
            raise
        return mm

    def _own_rows(self) -> tuple[int, int, int, int]:
        """This worker's rows as (first offset, stride, count, length)."""
        if self._num_workers == 1:
            return 0, self._size, 1, self._size
        stride = self._row_bytes * self._num_workers
        return self._rank * self._row_bytes, stride, self._num_slots, self._row_bytes

    def _unlink(self) -> None:
        """Remove the owner record, then the file (so no new creator races us)."""
        _unlink_region(self._path, self._inode)


# -- stale regions -------------------------------------------------------------


def close_region(region: SharedRegion) -> bool:
    """Close ``region``; views still held by dead frames (a cancelled job's traceback) are
    dropped by a collection first. Returns False, leaving the mapping to go with its last
    view, if some survive (the file is unlinked either way)."""
    try:
        region.close()
    except RegionInUseError:
        gc.collect()
        try:
            region.close()
        except RegionInUseError:
            log.warning(
                "region views outlive their owner; unmapped with the last one",
                path=str(region.path),
            )
            return False
    return True


def find_stale_regions(
    directory: str | os.PathLike[str] = "/dev/shm", *, missing_owner_grace_s: float = 60.0
) -> list[Path]:
    """Region files in ``directory`` whose creator process is no longer running.

    A file without a (matching) owner record is reported once it is older than
    ``missing_owner_grace_s``: its creator died between creating it and writing the
    record, which takes microseconds. A region whose creator is alive is never
    reported; neither is one whose creator is in another pid namespace, nor a file of
    another user. A reported region may still be mapped by a live peer of its creator
    (:func:`remove_stale_regions` leaves those).
    """
    now = time.time()
    return [
        path
        for path in sorted(Path(directory).glob("kvtier_*.mmap"))
        if _FILE_RE.fullmatch(path.name) and _stale_inode(path, now, missing_owner_grace_s)
    ]


def remove_stale_regions(
    directory: str | os.PathLike[str] = "/dev/shm", *, missing_owner_grace_s: float = 60.0
) -> list[Path]:
    """Delete what :func:`find_stale_regions` reports (with owner records), unless a live
    process still maps it (a peer of the dead creator); return what was deleted.

    Each file is re-checked just before removal, under the same locks as a reclaim, so a
    region re-created under the same name in between is left alone.
    """
    removed: list[Path] = []
    now = time.time()
    for path in find_stale_regions(directory, missing_owner_grace_s=missing_owner_grace_s):
        if _remove_stale(path, now, missing_owner_grace_s):
            log.info("removed stale shared region", path=str(path))
            removed.append(path)
    return removed


def _sweep(directory: Path) -> None:
    """Remove the stale regions in ``directory``; a failure is logged, never raised."""
    try:
        remove_stale_regions(directory)
    except OSError as exc:
        log.warning("could not remove stale shared regions", directory=str(directory),
                    error=str(exc))  # fmt: skip


def _remove_stale(path: Path, now: float, grace_s: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        inode = os.fstat(fd).st_ino
        if _stale_inode(path, now, grace_s) != inode:
            return False
        owner = read_owner(_owner_path(path))
        if owner is None or owner.inode != inode:  # no record: nobody reclaims it
            if not _lock(fd, fcntl.LOCK_EX):
                log.info("stale shared region is still mapped; left alone", path=str(path))
                return False
            return _unlink_region(path, inode)
        try:
            return _reclaim(path, fd, inode, owner, None)
        except StaleRegionError:
            log.info("stale shared region is still mapped; left alone", path=str(path))
            return False
    finally:
        os.close(fd)


def _stale_inode(path: Path, now: float, grace_s: float) -> int | None:
    """The inode of ``path`` if it is a stale region file, else None."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return None  # another user's file is not ours to judge
    owner = read_owner(_owner_path(path))
    if owner is None or owner.inode != st.st_ino:
        return st.st_ino if now - st.st_mtime >= grace_s else None
    return None if is_alive(owner) else st.st_ino


def _unlink_region(path: Path, inode: int) -> bool:
    """Unlink ``path`` and its owner record if they still belong to ``inode``."""
    owner_path = _owner_path(path)
    owner = read_owner(owner_path)
    if owner is None or owner.inode == inode:
        with contextlib.suppress(FileNotFoundError):
            owner_path.unlink()
    try:
        if path.lstat().st_ino != inode:
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True


# -- helpers ------------------------------------------------------------------


def _owner_path(path: Path) -> Path:
    return path.with_name(path.name + _OWNER_SUFFIX)


def _open_or_create(path: Path, deadline: float) -> tuple[int, bool]:
    """Open ``path`` read-write; True if this call created it (won the race), and then
    holds its shared lock. An existing file must be this user's private regular file."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            _lock(fd, fcntl.LOCK_SH)  # a new inode: nobody else has a lock on it
            return fd, True
        try:
            fd = os.open(path, os.O_RDWR | _NOFOLLOW)
        except FileNotFoundError:
            # The creator gave up and unlinked it between our two opens: race again.
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not open or create {path}") from None
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RegionError(
                    f"{path} is a symbolic link; refusing to follow it (region files are "
                    "created by kvtier_async, never linked)"
                ) from None
            if exc.errno == errno.EISDIR:
                raise RegionError(f"refusing to map {path}: it is not a regular file") from None
            raise
        try:
            _check_private(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd, False


def _check_private(fd: int, path: Path) -> None:
    """Refuse a region file that is not this user's, or that others may read or write."""
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "it is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600"
    if problem is not None:
        raise RegionError(f"refusing to map {path}: {problem}; remove it or pick another "
                          "instance_id")  # fmt: skip


def _lock(fd: int, operation: int) -> bool:
    """``flock(fd, operation | LOCK_NB)``; False if another descriptor's lock conflicts."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _claim_byte(fd: int, offset: int) -> bool:
    """An open-file-description write lock on byte ``offset`` of the file open at ``fd``;
    False if another open file description holds it. Held until the last descriptor of this
    description closes (so by a child forked with it too), dropped when the process dies."""
    # struct flock on 64-bit Linux: short l_type, l_whence; off_t l_start, l_len; pid_t l_pid
    # (0 for OFD locks); padded to 32 bytes.
    request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    try:
        fcntl.fcntl(fd, _OFD_SETLK, request)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _still_linked(fd: int, path: Path) -> bool:
    """Whether the file open at ``fd`` is still the one at ``path``."""
    st = os.fstat(fd)
    try:
        return st.st_nlink > 0 and path.lstat().st_ino == st.st_ino
    except FileNotFoundError:
        return False


def _retry_pause(path: Path, deadline: float) -> None:
    """A short pause before racing for ``path`` again; TimeoutError past ``deadline``."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"could not open or create {path}: it kept changing under us")
    _sleep(min(0.001, remaining))


def _reclaim(path: Path, fd: int, inode: int, owner: OwnerRecord, deadline: float | None) -> bool:
    """Remove the region file open at ``fd`` (``inode``), whose creator ``owner`` is dead,
    unless a live process maps it (then raise StaleRegionError); True if removed. False
    when something changed meanwhile (another reclaimer won): the caller looks again.
    Without ``deadline``, False at once if another reclaim holds the record."""
    owner_path = _owner_path(path)
    try:
        owner_fd = os.open(owner_path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return False  # removed meanwhile
    try:
        if not _lock_until(owner_fd, path, deadline):
            return False
        record = read_owner_fd(owner_fd)
        if (
            record is None
            or record.inode != inode
            or is_alive(record)
            or not _still_linked(owner_fd, owner_path)
            or not _still_linked(fd, path)
        ):
            return False
        if not _lock_briefly(fd, fcntl.LOCK_EX):
            if not _still_linked(fd, path):
                return False  # the reaper removed it meanwhile (see `._reaper`)
            raise StaleRegionError(
                f"{path} was created by process {owner.pid}, which is no longer running, but "
                "another live process still maps it; stop that process or use another "
                "instance_id"
            )
        owner_path.unlink()
        path.unlink()
    finally:
        os.close(owner_fd)
    log.warning("reclaimed the shared region of a dead process", path=str(path), pid=owner.pid)
    return True


def _lock_briefly(fd: int, operation: int, within_s: float = 0.1) -> bool:
    """`_lock`, tried for ``within_s``: the region reaper holds a dead region's lock for
    the moment it takes to remove it (see `._reaper`)."""
    deadline = time.monotonic() + within_s
    while not _lock(fd, operation):
        if time.monotonic() >= deadline:
            return False
        _sleep(0.001)
    return True


def _lock_until(fd: int, path: Path, deadline: float | None) -> bool:
    """``flock(fd, LOCK_EX)`` on ``path``'s owner record, polling until ``deadline``
    (None: one try)."""
    delay = 0.0005
    while not _lock(fd, fcntl.LOCK_EX):
        if deadline is None:
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out waiting for another process to reclaim {path}")
        _sleep(min(delay, remaining))
        delay = min(delay * 2, _POLL_MAX_S)
    return True


def _sized(fd: int, path: Path, expected: int) -> bool:
    """Whether the creator has sized the file to ``expected`` bytes (False: not yet)."""
    st = os.fstat(fd)
    if st.st_nlink == 0:
        raise RegionError(f"{path} was removed before it was ready (its creator failed or closed)")
    if st.st_size not in (0, expected):
        raise RegionLayoutError(
            f"{path} is {st.st_size} bytes, this worker expects {expected} bytes "
            "(num_slots * num_workers * row_bytes): another configuration created it"
        )
    return st.st_size == expected


def _check_free_space(directory: Path, size: int) -> None:
    vfs = os.statvfs(directory)
    available = vfs.f_bavail * vfs.f_frsize
    if size > available:
        raise OSError(
            errno.ENOSPC,
            f"shared region needs {size} bytes but {directory} has {available} available",
        )


def _prefault(mm: mmap.mmap, first: int, stride: int, count: int, length: int) -> None:
    """Fault in ``count`` ranges of ``length`` bytes, ``stride`` apart, for writing."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE, first, PAGE_SIZE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise _prefault_error(exc) from exc
        log.warning("MADV_POPULATE_WRITE unsupported; prefaulting page by page")
        _touch_pages(mm, first, stride, count, length)
        return
    try:
        for i in range(count):
            mm.madvise(_MADV_POPULATE_WRITE, first + i * stride, length)
    except OSError as exc:
        raise _prefault_error(exc) from exc


def _touch_pages(mm: mmap.mmap, first: int, stride: int, count: int, length: int) -> None:
    """Read-modify-write one byte per page, keeping whatever is there."""
    pages: npt.NDArray[np.uint8] = np.ndarray(
        (count, length // PAGE_SIZE),
        dtype=np.uint8,
        buffer=mm,
        offset=first,
        strides=(stride, PAGE_SIZE),
    )
    try:
        pages |= 0
    finally:
        del pages


def _prefault_error(exc: OSError) -> RegionError:
    return RegionError(f"could not prefault the shared region (is the filesystem full?): {exc}")


def _buffer_address(mm: mmap.mmap) -> int:
    """Address of the mapping; the temporary buffer export is released at once."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _check_zero_copy(what: str, actual: int, expected: int) -> None:
    if actual != expected:
        raise RegionError(
            f"{what} made a copy (data at {actual:#x}, mapping at {expected:#x}); "
            "tiers require zero-copy access to the shared region"
        )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_int(name: str, value: int, *, low: int, high: int | None = None) -> int:
    bound = f">= {low}" if high is None else f"with {low} <= {name} < {high}"
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < low or (high is not None and number >= high):
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return number


def _check_instance_id(instance_id: str) -> str:
    if not isinstance(instance_id, str) or not _ID_RE.fullmatch(instance_id):
        raise ValueError(
            f"instance_id must be 1-200 characters from [A-Za-z0-9_.-], got {instance_id!r}"
        )
    return instance_id


def _check_directory(directory: str | os.PathLike[str]) -> Path:
    try:
        path = Path(directory)
    except TypeError:
        path = None
    if path is None or not path.is_dir():
        raise ValueError(f"directory must be an existing directory, got {directory!r}")
    return path


def _check_timeout(timeout_s: float) -> float:
    number = timeout_s if isinstance(timeout_s, int | float) else math.nan
    if isinstance(timeout_s, bool) or not math.isfinite(number) or number < 0:
        raise ValueError(f"wait_timeout_s must be a finite number >= 0, got {timeout_s!r}")
    return float(number)
