"""The CPU tier's shared regions in a directory (``/dev/shm``): who made each, whether that
process lives, whether anyone maps it, and removing those of dead processes.

A region is ``kvtier_<instance_id>.mmap`` with an owner record beside it (``.owner``: the
creator's pid, start time and pid namespace, the file's inode and the layout; see
`kvtier_async.memory.region`). `list_regions` reads both for each file:

- *owner*: ``alive``, ``dead`` (provably: no such process, a zombie, or another process
  under the same pid), ``foreign`` (another pid namespace: its pids mean nothing here),
  ``none`` (no record, or one of an earlier file of that name), judged by the region
  module's own check (`kvtier_async.memory.owner.is_alive`);
- *mapped*: every process that maps a region holds a shared ``flock`` on it, so an exclusive
  non-blocking ``flock`` that succeeds (released at once) proves nobody does. A file of size
  0 is being created (its creator sizes it last) and is not tested; a joiner that meets the
  test's lock retries, as it does after any lost race;
- *stale*: what `kvtier_async.memory.find_stale_regions` reports (dead owner, or no record
  past its grace period).

`remove_stale` is `kvtier_async.memory.remove_stale_regions`: it deletes only stale regions
that nobody maps, each re-checked under the same locks as a reclaim.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvtier_async import defaults
from kvtier_async._safefile import SAFE_READ_FLAGS
from kvtier_async.memory import find_stale_regions, region_path, remove_stale_regions
from kvtier_async.memory.owner import OwnerRecord, is_alive, read_owner
from kvtier_async.ops.layout import OpsError

__all__ = ["RegionInfo", "check_directory", "list_regions", "remove_stale"]

_PREFIX, _SUFFIX, _OWNER = "kvtier_", ".mmap", ".owner"
_PROC: Final = Path("/proc")


@dataclass(frozen=True)
class RegionInfo:
    """One region file: see the module docstring for ``owner``, ``mapped`` (None: not
    tested) and ``stale``."""

    path: str
    instance_id: str
    size: int
    mode: int
    uid: int
    owner: str
    stale: bool
    mapped: bool | None
    record: OwnerRecord | None
    started: datetime.datetime | None  # the owner's start time, when this host can tell

    @property
    def slots(self) -> int | None:
        """Slots of each worker, from the owner record."""
        return None if self.record is None else self.record.num_slots


def check_directory(directory: str) -> Path:
    """``directory`` as a Path; `OpsError` if it is no directory."""
    path = Path(directory)
    if not path.exists():
        raise OpsError(f"{directory}: no such directory")
    if not path.is_dir():
        raise OpsError(f"{directory}: not a directory")
    return path


def list_regions(directory: str = defaults.REGION_DIR) -> list[RegionInfo]:
    """Every kvtier region file in ``directory``, by name."""
    where = check_directory(directory)
    stale = {str(p) for p in find_stale_regions(where)}
    regions = []
    for path in sorted(where.glob(f"{_PREFIX}*{_SUFFIX}")):
        instance_id = path.name[len(_PREFIX) : -len(_SUFFIX)]
        with contextlib.suppress(ValueError, FileNotFoundError):
            region_path(where, instance_id)  # a valid instance id, or not ours
            regions.append(_describe(path, instance_id, str(path) in stale))
    return regions


def _describe(path: Path, instance_id: str, stale: bool) -> RegionInfo:
    st = path.lstat()
    record = read_owner(path.with_name(path.name + _OWNER))
    if record is not None and record.inode != st.st_ino:
        record = None  # the record of an earlier file of this name
    return RegionInfo(
        path=str(path),
        instance_id=instance_id,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        owner=_owner_state(record),
        stale=stale,
        mapped=_mapped(path, st) if stat.S_ISREG(st.st_mode) else None,
        record=record,
        started=None if record is None else _start_time(record),
    )


def _owner_state(record: OwnerRecord | None) -> str:
    if record is None:
        return "none"
    if record.pid_ns is not None and record.pid_ns != _pid_namespace():
        return "foreign"
    return "alive" if is_alive(record) else "dead"


def _mapped(path: Path, st: os.stat_result) -> bool | None:
    """Whether some process maps the region (holds its shared flock); None: not tested (a
    region being created, or one this user cannot open)."""
    if st.st_size == 0:
        return None
    try:
        fd = os.open(path, SAFE_READ_FLAGS)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if now.st_ino != st.st_ino or not stat.S_ISREG(now.st_mode):
            return None  # replaced under us, or not a region file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _start_time(record: OwnerRecord) -> datetime.datetime | None:
    """When the owner process started (boot time + its start ticks); None where this host
    cannot tell (another pid namespace, no /proc)."""
    if record.start_ticks is None or _owner_state(record) == "foreign":
        return None
    try:
        with open(_PROC / "stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    seconds = boot + record.start_ticks / os.sysconf("SC_CLK_TCK")
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC)


def _pid_namespace() -> str | None:
    try:
        return os.readlink(_PROC / "self" / "ns" / "pid")
    except OSError:
        return None


def remove_stale(directory: str = defaults.REGION_DIR) -> tuple[list[str], list[str]]:
    """Remove the stale regions nobody maps: ``(removed, kept)`` (kept: stale, but still
    mapped by a live process, or changed under us)."""
    where = check_directory(directory)
    stale = [str(p) for p in find_stale_regions(where)]
    removed = [str(p) for p in remove_stale_regions(where)]
    return removed, [p for p in stale if p not in removed and os.path.lexists(p)]
