"""Reclaim: removing the region file of a creator that is provably dead, unless a live process
still maps it.

A handle that finds the region of a dead creator (its owner record names this file, and its
process is gone: see `kvtier_async.memory.owner.is_alive`) removes it and races to create it
anew, but only when no live process maps it: reclaimers serialise on ``flock(LOCK_EX)`` of the
owner record, re-check everything under it, then take ``LOCK_EX | LOCK_NB`` on the region. If
that fails, a live process still maps the region and the handle raises `StaleRegionError`
instead. So a restart after a crash (``kill -9``) with the same ``instance_id`` just works, in
every face that builds a `SharedRegion`. The stale-region sweep (`kvtier_async.memory.stale`)
removes a dead creator's region the same way.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from kvtier_async._log import get_logger
from kvtier_async.memory._files import NOFOLLOW, lock, still_linked
from kvtier_async.memory.errors import StaleRegionError
from kvtier_async.memory.owner import OwnerRecord, is_alive, owner_path, read_owner_fd

__all__ = ["POLL_MAX_S", "reclaim"]

log = get_logger(__name__)

#: The longest wait between two polls of a lock (here) or of a region's size (a joiner's).
POLL_MAX_S: Final = 0.05
_sleep: Callable[[float], None] = time.sleep  # the lock polls' wait; tests may replace it


def reclaim(path: Path, fd: int, inode: int, owner: OwnerRecord, deadline: float | None) -> bool:
    """Remove the region file open at ``fd`` (``inode``), whose creator ``owner`` is dead,
    unless a live process maps it (then raise StaleRegionError); True if removed. False
    when something changed meanwhile (another reclaimer won): the caller looks again.
    Without ``deadline``, False at once if another reclaim holds the record."""
    record_path = owner_path(path)
    try:
        owner_fd = os.open(record_path, os.O_RDONLY | NOFOLLOW)
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
            or not still_linked(owner_fd, record_path)
            or not still_linked(fd, path)
        ):
            return False
        if not _lock_briefly(fd, fcntl.LOCK_EX):
            if not still_linked(fd, path):
                return False  # the reaper removed it meanwhile (see `._reaper`)
            raise StaleRegionError(
                f"{path} was created by process {owner.pid}, which is no longer running, but "
                "another live process still maps it; stop that process or use another "
                "instance_id"
            )
        record_path.unlink()
        path.unlink()
    finally:
        os.close(owner_fd)
    log.warning("reclaimed the shared region of a dead process", path=str(path), pid=owner.pid)
    return True


def _lock_briefly(fd: int, operation: int, within_s: float = 0.1) -> bool:
    """`lock`, tried for ``within_s``: the region reaper holds a dead region's lock for
    the moment it takes to remove it (see `._reaper`)."""
    deadline = time.monotonic() + within_s
    while not lock(fd, operation):
        if time.monotonic() >= deadline:
            return False
        _sleep(0.001)
    return True


def _lock_until(fd: int, path: Path, deadline: float | None) -> bool:
    """``flock(fd, LOCK_EX)`` on ``path``'s owner record, polling until ``deadline``
    (None: one try)."""
    delay = 0.0005
    while not lock(fd, fcntl.LOCK_EX):
        if deadline is None:
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out waiting for another process to reclaim {path}")
        _sleep(min(delay, remaining))
        delay = min(delay * 2, POLL_MAX_S)
    return True
