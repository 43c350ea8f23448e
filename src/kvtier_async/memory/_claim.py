"""Claims: one live holder per role of a region, so two caches never share one by accident.

A region is named by its ``instance_id`` alone. Without claims, a second cache or engine
given the same id (a copied config, a reused id) joins the first one's region as "worker 0
of 1" and the two serve each other's bytes. So each handle of a product face claims its
role first: ``r<rank>`` for a worker (the async cache is worker 0 of 1; vLLM's
tensor-parallel workers claim their ranks) and ``scheduler`` for the connector's scheduler
role. A claim is ``flock(LOCK_EX | LOCK_NB)`` on ``kvtier_<id>.<role>.claim`` beside the
region, created ``O_NOFOLLOW`` mode 0600 and refused unless it is this user's private regular
file; it holds the holder's pid for the error message. The kernel drops the lock when the
holder dies (``kill -9`` included), so a restart just claims again; a role taken twice is
refused (`kvtier_async.memory.RegionClaimedError`), naming the id, the role and the holder's
pid. A forked child inherits the descriptor, not the claim's ownership: only the claiming
process removes the file. A killed holder leaves its file behind, unlocked (a few bytes):
the next claimer of that role takes it over.

*Removal race.* The holder unlinks the file while it still holds the lock, then closes it.
A process that opened the old file before the unlink may get its lock after the close; it
then finds that the path no longer names the file it locked, and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Final

__all__ = ["Claim", "ClaimRefused", "claim_path"]

_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TRIES: Final = 5


class ClaimRefused(Exception):
    """The role is held by another live handle, or its claim file is not ours (the region
    raises `kvtier_async.memory.RegionClaimedError` with this message)."""


def claim_path(region: Path, role: str) -> Path:
    return region.with_name(f"{region.stem}.{role}.claim")


class Claim:
    """This process's hold on ``role`` of the region at ``region`` (see the module
    docstring); `release` (idempotent) gives it up."""

    def __init__(self, region: Path, instance_id: str, role: str) -> None:
        self.path = claim_path(region, role)
        self.role = role
        self._pid = os.getpid()
        for _ in range(_TRIES):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise ClaimRefused(
                    f"instance_id {instance_id!r} is in use: its {role} is held by "
                    f"{holder} (another cache or engine with this instance_id); give each "
                    "cache or engine its own instance_id"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # removed by its last holder after we opened it: again
        else:
            raise ClaimRefused(f"{self.path}: replaced {_TRIES} times while claiming it")
        self._fd: int | None = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self._pid}\n".encode(), 0)

    def _open(self) -> int:
        try:
            fd = os.open(self.path, _FLAGS, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ClaimRefused(f"{self.path}: a symbolic link; refusing it") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ClaimRefused(
                    f"{self.path}: not this user's private regular file (mode "
                    f"{stat.filemode(st.st_mode)}, uid {st.st_uid}); refusing it"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if os.getpid() == self._pid and _same_file(fd, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # under the lock: nobody else holds it
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a live process"
