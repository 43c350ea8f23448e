"""Creating or joining a region file, and claiming a handle's place in it.

*Creation race.* Each worker tries ``open(O_CREAT | O_EXCL | O_NOFOLLOW)``, mode 0600. The one
that wins is the creator: it checks free space, writes an owner record beside the file
(``.owner``, see `kvtier_async.memory.owner`), then ``ftruncate``\\ s the file to its final
size, which is what the others wait for. The others open the existing file (``O_NOFOLLOW``: a
symbolic link there is refused) and refuse it unless it is a regular file owned by this user
that nobody else may read or write (mode 0600 or narrower), then poll ``fstat`` until the size
is right (a constructor at process start-up, not the event loop, so a short poll is fine).
They fail fast when the size or layout differs from theirs (another configuration). If the
creator fails after winning, it removes the file; a waiter that finds the file it opened
unlinked (``st_nlink == 0``: its creator failed or closed, or another joiner reclaimed it
from a dead creator) races again, and the winner creates it anew or meets the creator's
error itself (no space, say). A joiner that finds a dead creator's region reclaims it
(`kvtier_async.memory._reclaim`: the owner record first, then the file) and races again; it
takes its shared lock only after judging the owner alive and then checks that the file is
still linked at its path, so it never maps a file that was reclaimed under it. A file sized
for another layout with no owner record is one being reclaimed: the joiner waits for it to
go (until its deadline, then refuses it as another configuration's).

*One owner.* A handle made with a ``role`` (every product face makes one: the cache of
:class:`~kvtier_async.TieredKVCache` as worker 0, a vLLM worker as its rank, vLLM's scheduler
as ``"scheduler"``) claims its place in the region with an open-file-description write lock
(``F_OFD_SETLK``) on one byte of the region file: byte 0 for the scheduler, ``1 + rank`` for a
worker. The lock lives on the descriptor the mapping keeps, so it is held exactly as long as
the mapping and dropped by the kernel when the process dies (``kill -9`` and ``SIGTERM``
included): nothing is left on disk. A second handle for a place already held, in this process
or another, is refused with `RegionClaimedError` naming the ``instance_id`` and the creator's
pid. A handle with a ``token`` (the engine's: vLLM's ``engine_id``; a random one per cache)
also refuses a region whose creator recorded another token: another engine that picked the
same ``instance_id``. Without a role (benchmarks, tests of the mapping itself) nothing is
claimed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from kvtier_async._log import get_logger
from kvtier_async.memory._files import NOFOLLOW, lock, still_linked, unlink_region
from kvtier_async.memory._reclaim import POLL_MAX_S, reclaim
from kvtier_async.memory.errors import RegionClaimedError, RegionError, RegionLayoutError
from kvtier_async.memory.owner import (
    OwnerRecord,
    is_alive,
    owner_path,
    read_owner,
    write_owner,
)

__all__ = ["Layout", "Role", "claim", "open_region"]

log = get_logger(__name__)

Role = Literal["worker", "scheduler"]
_sleep: Callable[[float], None] = time.sleep  # the size poll's wait; tests replace it
# ``F_OFD_SETLK`` is 37 on Linux; Python exports it from 3.9 (on Linux only).
_OFD_SETLK: Final[int] = getattr(fcntl, "F_OFD_SETLK", 37)


@dataclass(frozen=True)
class Layout:
    """What every handle of a region must agree on, and the size it gives the file."""

    num_slots: int
    num_workers: int
    row_bytes: int

    @property
    def size(self) -> int:
        return self.num_slots * self.num_workers * self.row_bytes


@dataclass(frozen=True)
class _Wanted:
    """The region file a handle asks for."""

    path: Path
    instance_id: str
    layout: Layout
    token: str | None


def open_region(
    path: Path, instance_id: str, layout: Layout, token: str | None, deadline: float
) -> tuple[int, int, bool]:
    """The region file at ``path`` open read-write, locked shared, sized to ``layout`` and
    checked: ``(descriptor, inode, True if this call created it)``. A dead creator's region is
    reclaimed and raced for again until ``deadline`` (`time.monotonic`).

    Raises:
        TimeoutError: The creator did not size the file by ``deadline``, or it kept changing.
        RegionLayoutError: The file was sized or laid out for another configuration.
        StaleRegionError: The file's creator is dead but a live process still maps it.
        RegionClaimedError: The creator recorded another ``token``.
        RegionError: The file is not this user's private regular file.
        OSError: The directory lacks space or permissions.
    """
    wanted = _Wanted(path, instance_id, layout, token)
    while True:
        fd, created = _open_or_create(path, deadline)
        inode = 0
        try:
            inode = os.fstat(fd).st_ino
            if created:
                _init_as_creator(fd, inode, wanted)
                return fd, inode, True
            if _join(fd, inode, wanted, deadline):
                return fd, inode, False
        except BaseException:
            if created:
                unlink_region(path, inode)
            os.close(fd)
            raise
        os.close(fd)  # reclaimed, or gone under us: race again
        _retry_pause(path, deadline)


def claim(fd: int, path: Path, inode: int, instance_id: str, role: Role | None, rank: int) -> None:
    """Take the place ``role`` (at ``rank`` for a worker) names in the region open at ``fd``
    (see *One owner*), or raise `RegionClaimedError`; None claims nothing."""
    if role is None:
        return
    offset = 0 if role == "scheduler" else 1 + rank
    if _claim_byte(fd, offset):
        return
    owner = _owner(path, inode)
    place = "the scheduler's place" if role == "scheduler" else f"worker rank {rank}"
    created = f"process {owner.pid}" if owner is not None else "a process with no owner record"
    raise RegionClaimedError(
        f"instance_id {instance_id!r} is in use: {place} in {path} is held by "
        f"another live cache or engine ({created} created the region); close it, or pick "
        "another instance_id (each cache or engine needs its own)"
    )


def _init_as_creator(fd: int, inode: int, wanted: _Wanted) -> None:
    layout = wanted.layout
    _check_free_space(wanted.path.parent, layout.size)
    os.fchmod(fd, 0o600)  # whatever the umask
    record = OwnerRecord.for_current_process(
        inode=inode,
        num_slots=layout.num_slots,
        num_workers=layout.num_workers,
        row_bytes=layout.row_bytes,
        token=wanted.token,
    )
    write_owner(owner_path(wanted.path), record)  # before sizing: joiners see it
    os.ftruncate(fd, layout.size)


def _join(fd: int, inode: int, wanted: _Wanted, deadline: float) -> bool:
    """Join the region open at ``fd``: wait until it is sized, check its creator and
    layout, take the shared lock. False when the caller must race again: the region
    was a dead creator's and is removed now, or it went away under us."""
    path, size = wanted.path, wanted.layout.size
    delay = 0.001
    while True:
        owner = _owner(path, inode)
        if owner is not None and not is_alive(owner):
            reclaim(path, fd, inode, owner, deadline)
            return False
        st = os.fstat(fd)
        if st.st_nlink == 0:
            # removed under us: its creator failed or closed, or it was a dead creator's
            # region that another process reclaimed between our open and our reading of the
            # owner record. Race again: the winner creates it anew (and meets the creator's
            # error itself, if it had one)
            return False
        if st.st_size == size:
            break
        remaining = deadline - time.monotonic()
        if st.st_size != 0 and (owner is not None or remaining <= 0):
            raise RegionLayoutError(
                f"{path} is {st.st_size} bytes, this worker expects {size} bytes "
                "(num_slots * num_workers * row_bytes): another configuration created it"
            )
        # (sized otherwise with no owner record: a reclaimer removes the record first, then
        # the file; wait for the file to go, up to the deadline)
        if remaining <= 0:
            raise TimeoutError(
                f"timed out waiting for the creator to size {path} to {size} bytes (it is 0 bytes)"
            )
        _sleep(min(delay, remaining))
        delay = min(delay * 2, POLL_MAX_S)
    owner = owner or _owner(path, inode)  # written before the file is sized
    if owner is None:
        log.warning("shared region has no owner record", path=str(path))
    else:
        _check_owner(owner, wanted)
    return lock(fd, fcntl.LOCK_SH) and still_linked(fd, path)


def _check_owner(owner: OwnerRecord, wanted: _Wanted) -> None:
    """Refuse a region laid out for another configuration, or made for another token."""
    layout = wanted.layout
    theirs = (owner.num_slots, owner.num_workers, owner.row_bytes)
    ours = (layout.num_slots, layout.num_workers, layout.row_bytes)
    if theirs != ours:
        raise RegionLayoutError(
            f"{wanted.path} has layout (num_slots, num_workers, row_bytes)={theirs}, "
            f"this worker expects {ours}"
        )
    if None not in (owner.token, wanted.token) and owner.token != wanted.token:
        raise RegionClaimedError(
            f"instance_id {wanted.instance_id!r} is in use by another cache or engine: "
            f"process {owner.pid} created {wanted.path} for it; pick another "
            "instance_id (each cache or engine needs its own)"
        )


def _owner(path: Path, inode: int) -> OwnerRecord | None:
    """The owner record of the region file ``inode`` at ``path``, None if there is none (or
    another's)."""
    owner = read_owner(owner_path(path))
    return owner if owner is not None and owner.inode == inode else None


def _open_or_create(path: Path, deadline: float) -> tuple[int, bool]:
    """Open ``path`` read-write; True if this call created it (won the race), and then
    holds its shared lock. An existing file must be this user's private regular file."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            lock(fd, fcntl.LOCK_SH)  # a new inode: nobody else has a lock on it
            return fd, True
        try:
            fd = os.open(path, os.O_RDWR | NOFOLLOW)
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


def _retry_pause(path: Path, deadline: float) -> None:
    """A short pause before racing for ``path`` again; TimeoutError past ``deadline``."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"could not open or create {path}: it kept changing under us")
    _sleep(min(0.001, remaining))


def _check_free_space(directory: Path, size: int) -> None:
    vfs = os.statvfs(directory)
    available = vfs.f_bavail * vfs.f_frsize
    if size > available:
        raise OSError(
            errno.ENOSPC,
            f"shared region needs {size} bytes but {directory} has {available} available",
        )
