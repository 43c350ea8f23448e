"""Owner records: who created a shared region, and whether that process still lives.

The creator of a region file writes a small JSON sidecar next to it
(``<region>.owner``) before it sizes the region, so any process that sees a
sized region also sees its owner. The record names the creator process in a way
that survives pid reuse: its pid, its start time in clock ticks since boot (field
22 of ``/proc/<pid>/stat``) and its pid namespace. It also stores the region
file's inode, so a record is never mistaken for the owner of a later region that
reuses the same name, and the region's layout, so that a worker started with a
different configuration is refused with a clear message. It may carry the creator's engine
token (what the workers of one engine share, see `SharedRegion`), so a process of another
engine that picked the same ``instance_id`` is refused instead of joining.

The record is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (a symbolic
link planted at its name is never followed), and read only if it is a regular file owned by
this user, opened with ``O_NOFOLLOW``: anything else is treated as no record.

Liveness is judged conservatively: a process is dead only when we can prove it
(no ``/proc`` entry, a zombie, or a different start time under the same pid). A
record written from another pid namespace is always considered alive, since its
pid means nothing here.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "OWNER_SUFFIX",
    "OwnerRecord",
    "is_alive",
    "owner_path",
    "read_owner",
    "read_owner_fd",
    "write_owner",
]

OWNER_SUFFIX = ".owner"
_VERSION = 1
_MAX_BYTES = 4096  # a record is about 200 bytes
_PROC = Path("/proc")


@dataclass(frozen=True)
class OwnerRecord:
    """What a region's creator writes beside the region file."""

    pid: int
    start_ticks: int | None
    pid_ns: str | None
    inode: int
    num_slots: int
    num_workers: int
    row_bytes: int
    token: str | None = None

    @classmethod
    def for_current_process(
        cls,
        *,
        inode: int,
        num_slots: int,
        num_workers: int,
        row_bytes: int,
        token: str | None = None,
    ) -> OwnerRecord:
        """Describe the calling process as the creator of a region."""
        pid = os.getpid()
        stat = _proc_stat(pid)
        return cls(
            pid=pid,
            start_ticks=None if stat is None else stat[1],
            pid_ns=_pid_namespace(),
            inode=inode,
            num_slots=num_slots,
            num_workers=num_workers,
            row_bytes=row_bytes,
            token=token,
        )


def owner_path(region: Path) -> Path:
    """Where the owner record of the region file ``region`` lives (beside it)."""
    return region.with_name(region.name + OWNER_SUFFIX)


def write_owner(path: Path, record: OwnerRecord) -> None:
    """Create ``path`` holding ``record``, exclusively, mode 0600.

    Only the creator of a region calls this, right after it created the region file, so a
    record already at ``path`` belongs to no live region (a left-over whose region file was
    removed without it): it is removed, never followed, and the record created again.
    """
    data = json.dumps({"version": _VERSION, **asdict(record)}).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def read_owner(path: Path) -> OwnerRecord | None:
    """Read an owner record; None if it is missing, unreadable, malformed, a symbolic link,
    not a regular file or not owned by this user."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # a FIFO opens at once (O_NONBLOCK) and is refused below
        return None
    try:
        return read_owner_fd(fd)
    finally:
        os.close(fd)


def read_owner_fd(fd: int) -> OwnerRecord | None:
    """`read_owner` of an open record file."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        raw: Any = json.loads(os.pread(fd, _MAX_BYTES, 0))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("version") != _VERSION:
        return None
    try:
        return OwnerRecord(
            pid=int(raw["pid"]),
            start_ticks=None if raw["start_ticks"] is None else int(raw["start_ticks"]),
            pid_ns=None if raw["pid_ns"] is None else str(raw["pid_ns"]),
            inode=int(raw["inode"]),
            num_slots=int(raw["num_slots"]),
            num_workers=int(raw["num_workers"]),
            row_bytes=int(raw["row_bytes"]),
            token=None if raw.get("token") is None else str(raw["token"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def is_alive(record: OwnerRecord) -> bool:
    """Whether the process that wrote ``record`` may still be running."""
    if record.pid_ns is not None and record.pid_ns != _pid_namespace():
        return True  # another pid namespace: its pids cannot be checked from here
    if not (_PROC / "self" / "stat").exists():
        return _kill_zero(record.pid)
    stat = _proc_stat(record.pid)
    if stat is None:
        return False
    state, start_ticks = stat
    if state in ("Z", "X"):
        return False  # exited, not yet reaped by its parent
    return record.start_ticks is None or record.start_ticks == start_ticks


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc, None if absent."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is parenthesised and may hold spaces or ')'.
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); field 22 (starttime) is fields[19].
    return fields[0], int(fields[19])


def _pid_namespace() -> str | None:
    try:
        return os.readlink(_PROC / "self" / "ns" / "pid")
    except OSError:
        return None


def _kill_zero(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
