"""Region files on disk: their names, the ``flock`` every mapper holds, and removing one.

A region is ``<directory>/kvtier_<instance_id>.mmap`` with its owner record beside it
(`kvtier_async.memory.owner.owner_path`). Every handle holds ``flock(LOCK_SH)`` on the region
file for as long as it maps it, so ``flock(LOCK_EX | LOCK_NB)`` succeeds only when no live
process maps the file (the kernel drops a process's locks when it dies, ``kill -9`` included).
A region file is removed record first, then file, and only while the path is still the inode
the caller means: a region re-created under the same name in between is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path
from typing import Final

from kvtier_async.memory.owner import owner_path, read_owner

__all__ = [
    "FILE_RE",
    "NOFOLLOW",
    "check_instance_id",
    "lock",
    "region_path",
    "still_linked",
    "unlink_region",
]

_ID_PATTERN: Final = r"[A-Za-z0-9_.-]{1,200}"
_ID_RE: Final = re.compile(_ID_PATTERN)
#: The name of a region file (what the stale-region scan looks at).
FILE_RE: Final = re.compile(rf"kvtier_{_ID_PATTERN}\.mmap")
NOFOLLOW: Final = os.O_NOFOLLOW | os.O_CLOEXEC


def region_path(directory: str | os.PathLike[str], instance_id: str) -> Path:
    """Path of the region file of ``instance_id`` in ``directory``."""
    return Path(directory) / f"kvtier_{check_instance_id(instance_id)}.mmap"


def check_instance_id(instance_id: str) -> str:
    """``instance_id``, if it may name a region; else `ValueError`."""
    if not isinstance(instance_id, str) or not _ID_RE.fullmatch(instance_id):
        raise ValueError(
            f"instance_id must be 1-200 characters from [A-Za-z0-9_.-], got {instance_id!r}"
        )
    return instance_id


def lock(fd: int, operation: int) -> bool:
    """``flock(fd, operation | LOCK_NB)``; False if another descriptor's lock conflicts."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def still_linked(fd: int, path: Path) -> bool:
    """Whether the file open at ``fd`` is still the one at ``path``."""
    st = os.fstat(fd)
    try:
        return st.st_nlink > 0 and path.lstat().st_ino == st.st_ino
    except FileNotFoundError:
        return False


def unlink_region(path: Path, inode: int) -> bool:
    """Unlink ``path`` and its owner record if they still belong to ``inode``."""
    record = owner_path(path)
    owner = read_owner(record)
    if owner is None or owner.inode == inode:
        with contextlib.suppress(FileNotFoundError):
            record.unlink()
    try:
        if path.lstat().st_ino != inode:
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True
