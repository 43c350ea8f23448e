"""Named temporaries of the fs tier: who wrote each one, and whether that writer is dead.

A block is written to ``.<stem>.<host>-<pid>-<start>-<seq>.tmp`` in its target directory
(created ``O_CREAT | O_EXCL``) before it is published under its final name. The name carries
its writer's host token (host name and pid namespace), pid and process start time (clock ticks
since boot, field 22 of ``/proc/<pid>/stat``), so `remove_dead_temps` deletes only files of
writers that are provably gone: a live peer's file in progress is left alone, pid reuse is
recognised (another start time), and files of other hosts or pid namespaces are never judged.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kvtier_async._beneath import unlink_under
from kvtier_async._log import get_logger

__all__ = ["TEMP_RE", "identity", "process_start", "remove_dead_temps", "temp_name"]

log = get_logger(__name__)

TEMP_RE: Final = re.compile(r"\..+\.([0-9a-f]{8})-(\d+)-(\d+)-(\d+)\.tmp")


@dataclass(frozen=True)
class Identity:
    token: str  # host + pid namespace
    pid: int
    start: int  # start time in clock ticks since boot


_sequence = itertools.count()
_me: list[Identity] = []  # this process's identity, computed once; a forked child resets it
os.register_at_fork(after_in_child=_me.clear)


def identity() -> Identity:
    """This process's identity (blocking the first time: it reads /proc)."""
    if not _me:
        pid = os.getpid()
        try:
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = ""
        token = hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]
        _me[:] = [Identity(token, pid, process_start(pid) or 0)]
    return _me[0]


def temp_name(stem: str) -> str:
    """A new temporary's name (no directory), unique in this process."""
    me = identity()
    return f".{stem}.{me.token}-{me.pid}-{me.start}-{next(_sequence)}.tmp"


def process_start(pid: int) -> int | None:
    """Start time of live process ``pid`` (field 22 of /proc/<pid>/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _writer_is_dead(token: str, pid: int, start: int) -> bool:
    """Provably dead only: same host and pid namespace, and no such pid with that start."""
    if token != identity().token:
        return False
    return process_start(pid) != start


def remove_dead_temps(root: str, temps: Sequence[str]) -> None:
    """Delete those of ``temps`` (paths of named temporaries below ``root``) whose writers
    are dead, never through a link below ``root`` (`kvtier_async._beneath`)."""
    removed = 0
    for path in temps:
        match = TEMP_RE.fullmatch(os.path.basename(path))
        if match is None or not _writer_is_dead(match[1], int(match[2]), int(match[3])):
            continue
        removed += unlink_under(root, path)
    if removed:
        log.info("fs tier removed leftover temporary files", count=removed)
