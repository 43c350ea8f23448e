"""Stale regions: the region files of creators that are no longer running.

A creator unlinks its file on close, and its reaper (`kvtier_async.memory._reaper`) removes it
once no live process maps it if the creator is killed. If the reaper could not run, the file
outlives its creator until it is reclaimed, or: `find_stale_regions` reports such files and
`remove_stale_regions` deletes those that no live process maps. A region whose creator is
alive is never reported. A creator sweeps its directory once (`sweep`), so the regions of dead
processes with other ids (a fresh id each start) do not pile up.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

from kvtier_async import defaults
from kvtier_async._log import get_logger
from kvtier_async.memory._files import FILE_RE, lock, unlink_region
from kvtier_async.memory._reclaim import reclaim
from kvtier_async.memory.errors import StaleRegionError
from kvtier_async.memory.owner import is_alive, owner_path, read_owner

__all__ = ["find_stale_regions", "remove_stale_regions", "sweep"]

log = get_logger(__name__)


def find_stale_regions(
    directory: str | os.PathLike[str] = defaults.REGION_DIR, *, missing_owner_grace_s: float = 60.0
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
        if FILE_RE.fullmatch(path.name) and _stale_inode(path, now, missing_owner_grace_s)
    ]


def remove_stale_regions(
    directory: str | os.PathLike[str] = defaults.REGION_DIR, *, missing_owner_grace_s: float = 60.0
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


def sweep(directory: Path) -> None:
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
        owner = read_owner(owner_path(path))
        if owner is None or owner.inode != inode:  # no record: nobody reclaims it
            if not lock(fd, fcntl.LOCK_EX):
                log.info("stale shared region is still mapped; left alone", path=str(path))
                return False
            return unlink_region(path, inode)
        try:
            return reclaim(path, fd, inode, owner, None)
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
    owner = read_owner(owner_path(path))
    if owner is None or owner.inode != st.st_ino:
        return st.st_ino if now - st.st_mtime >= grace_s else None
    return None if is_alive(owner) else st.st_ino
