"""The region reaper: removes a region file once no live process maps it.

A region's creator unlinks its file on close, but a process that is killed (``kill -9``; a
``vllm serve`` stopped with SIGTERM kills its engine and workers at once, before any of
their clean-up runs) leaves the file behind in ``/dev/shm``, holding memory until a later
creator's sweep finds it. So each process that creates regions starts one small helper
process, as Python's ``multiprocessing`` resource tracker does for its shared memory: the
creator hands it ``inode path`` of each region it makes, over a pipe. For each, a thread
of the reaper opens the file and waits for ``flock(LOCK_EX)``, which the kernel grants only
once every mapper has released its shared lock, by closing or by dying. Then, if the path
is still that inode, the reaper removes the owner record and the file, as the creator's
close would have. It ends when the pipe closes (every process that could hand it a region
is gone) and its last region is removed.

The helper runs the standard library only (``python -I -S``: no site, no environment, no
import of this package), ignores SIGINT and SIGTERM (a Ctrl-C or a signal to the process
group would otherwise end it before the mappers it waits for), and never touches a file
that is not the inode it was given. It forks once at start (the process this one waits for
exits at once), so it is nobody's child: it outlives its creator, as it must. Without it
(it could not start, or ``KVTIER_REGION_REAPER=0``) regions still work; a killed creator's
file is then removed by the next creator's sweep, as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from kvtier_async._log import get_logger

__all__ = ["enabled", "watch"]

log = get_logger(__name__)

_SCRIPT = r"""
import fcntl, os, signal, sys, threading

if os.fork():  # the parent returns at once: the reaper is nobody's child to wait for
    os._exit(0)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)

def reap(inode, path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if os.fstat(fd).st_ino != inode:
            return
        fcntl.flock(fd, fcntl.LOCK_EX)  # granted once no process maps the file
        try:
            if os.lstat(path).st_ino != inode:
                return  # closed and replaced meanwhile: another region's file
        except FileNotFoundError:
            return  # its creator removed it
        for name in (path + ".owner", path):  # the record first, as the creator does
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)

threads = []
for line in sys.stdin:
    inode, _, path = line.rstrip("\n").partition(" ")
    thread = threading.Thread(target=reap, args=(int(inode), path))
    thread.start()
    threads.append(thread)
for thread in threads:
    thread.join()
"""

_lock = threading.Lock()
_pipe = -1  # the write end of the reaper's standard input
_owner_pid = 0  # the process that started it: a forked child starts its own


def enabled() -> bool:
    """Whether regions get a reaper: unless ``KVTIER_REGION_REAPER=0``."""
    return os.environ.get("KVTIER_REGION_REAPER", "1") != "0"


def watch(path: Path, inode: int) -> None:
    """Have this process's reaper remove ``path`` (while it is ``inode``) once no process
    maps it; starts the reaper at the first call. A failure is logged, never raised."""
    global _pipe, _owner_pid
    if not enabled():
        return
    line = f"{inode} {path}\n".encode()
    with _lock:
        try:
            if _owner_pid != os.getpid():
                _pipe, _owner_pid = _start(), os.getpid()
            try:
                os.write(_pipe, line)
            except BrokenPipeError:  # the reaper died (killed): a new one
                os.close(_pipe)
                _pipe = _start()
                os.write(_pipe, line)
        except (OSError, subprocess.SubprocessError) as exc:
            _owner_pid = 0
            log.warning("no region reaper: a killed process's region stays until the next "
                        "creator's sweep", path=str(path), error=str(exc))  # fmt: skip


def _start() -> int:
    """Start a reaper; returns the write end of its input (this process's, not inherited
    by the programs it runs)."""
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    assert process.stdin is not None
    try:
        pipe = os.dup(process.stdin.fileno())
    finally:
        process.stdin.close()
        process.wait(timeout=30)  # the first fork's parent, which exits at once
    return pipe
