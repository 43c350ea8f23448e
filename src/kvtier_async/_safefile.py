"""Opening files another user may have planted: never follow a link, never block, read a
bounded amount.

A path in a tier root or a metadata file may be anything by the time we open it: a symbolic
link (to ``/dev/zero``, to another user's file), a FIFO (``open`` for reading blocks until a
writer comes, forever if none does), a device, a directory, an 8 GiB sparse file. Every
such file is opened ``O_NOFOLLOW | O_NONBLOCK`` (a link fails with ``ELOOP``; a FIFO opens at
once), checked with ``fstat`` to be a regular file before anything is read, and read up to
a bound. ``O_NONBLOCK`` changes nothing for a regular file's reads.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any, Final

__all__ = [
    "SAFE_READ_FLAGS",
    "NotRegularFileError",
    "UnsafeContentError",
    "check_regular",
    "open_regular",
    "read_json",
]

SAFE_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_STRINGS = re.compile(rb'"(?:\\.|[^"\\])*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


class NotRegularFileError(OSError):
    """The path is a FIFO, a device, a socket or a directory, not a regular file."""


class UnsafeContentError(ValueError):
    """A metadata file is too large or nested too deeply to be read."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return f"not a regular file (mode {mode:o})"


def check_regular(fd: int, path: str) -> os.stat_result:
    """``fstat`` of ``fd``; `NotRegularFileError` unless it is a regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(f"{path}: {_kind(st.st_mode)}, not a regular file")
    return st


def open_regular(
    path: str, flags: int = 0, *, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
    """Open ``path`` (``SAFE_READ_FLAGS | flags``) and check it is a regular file; the
    descriptor and its stat. Raises OSError (``ELOOP`` for a link, `NotRegularFileError`)."""
    fd = os.open(path, SAFE_READ_FLAGS | flags, dir_fd=dir_fd)
    try:
        return fd, check_regular(fd, path)
    except BaseException:
        os.close(fd)
        raise


def read_json(
    path: str, *, max_bytes: int = 64 * 1024, max_depth: int = 32, dir_fd: int | None = None
) -> Any:
    """The JSON document in the regular file ``path``, read with the bounds above.

    Raises OSError (missing, a link, not a regular file), `UnsafeContentError` (larger than
    ``max_bytes``, nested deeper than ``max_depth``) or ValueError (not JSON)."""
    fd, st = open_regular(path, dir_fd=dir_fd)
    try:
        if st.st_size > max_bytes:
            raise UnsafeContentError(f"{path}: {st.st_size} bytes, more than {max_bytes}")
        chunks, size = [], 0
        while size <= max_bytes:  # it may grow while we read: bounded all the same
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafeContentError(f"{path}: more than {max_bytes} bytes")
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRINGS.sub(b'""', data)):
        depth += 1 if match.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    if deepest > max_depth:
        raise UnsafeContentError(f"{path}: nested {deepest} deep, more than {max_depth}")
    return json.loads(data)
