"""The fs tier's Python block I/O: whole-file writes and reads, a block file's read and check,
and the file primitives both I/O paths share (delete only the file that was read, unlink).

Every system call that a fault-injection test needs to fail goes through a seam of this module
(``_open``, ``_pwritev``, ``_preadv``; like `memory._create._sleep`): tests replace them, and
switch the C path off (`kvtier_async.tiers.fs.files.python_io`), which calls none of them.
Callers elsewhere in the package use `open_file`, `write_all` and `read_all`, which look the
seams up at each call.

A file is written and read in one ``pwritev``/``preadv`` of [header page, slot] where it can be,
resuming after short transfers; with O_DIRECT both buffers must be page-aligned (`aligned`),
which slots are, and so is this thread's header page (`header_page`, an anonymous mapping).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from kvtier_async.tiers.blockfile import (
    HEADER_BYTES,
    CorruptBlockError,
    short_file,
    verify_block,
    wrong_size,
)

__all__ = [
    "ALIGN",
    "O_DIRECT",
    "address",
    "aligned",
    "anchored_address",
    "header_page",
    "identity_of",
    "is_aligned",
    "open_file",
    "open_problem",
    "read_all",
    "read_block",
    "unlink_all",
    "write_all",
]

ALIGN: Final = 4096  # O_DIRECT: buffer address and length, and file offsets
O_DIRECT: Final = getattr(os, "O_DIRECT", 0)

# Seams for fault-injection tests: tests replace them.
_open: Callable[..., int] = os.open
_pwritev: Callable[[int, Sequence[memoryview], int], int] = os.pwritev
_preadv: Callable[[int, Sequence[memoryview], int], int] = os.preadv


def open_file(path: str, flags: int, *mode: int) -> int:
    """``os.open`` through the test seam."""
    return _open(path, flags, *mode)


def write_all(fd: int, views: Sequence[memoryview]) -> None:
    total, done = sum(view.nbytes for view in views), 0
    while done < total:
        written = _pwritev(fd, _rest(views, done), done)
        if written <= 0:
            raise OSError(errno.EIO, f"write stopped at {done} of {total} bytes")
        done += written


def read_all(fd: int, views: Sequence[memoryview]) -> int:
    total, done = sum(view.nbytes for view in views), 0
    while done < total:
        got = _preadv(fd, _rest(views, done), done)
        if got <= 0:
            break
        done += got
    return done


def _rest(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    rest = []
    for view in views:
        if skip >= view.nbytes:
            skip -= view.nbytes
            continue
        rest.append(view[skip:] if skip else view)
        skip = 0
    return rest


def read_block(fd: int, key: bytes, block: memoryview) -> None:
    """Read the block file open at ``fd`` into ``block`` and check it all; raise
    `CorruptBlockError` (or OSError) with the first problem found."""
    page = header_page()
    expected = HEADER_BYTES + block.nbytes
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before any read: a FIFO or device is never read
        raise CorruptBlockError(f"not a regular file (mode {st.st_mode:o})")
    got = read_all(fd, [page, block])
    if got != expected:
        raise short_file(got, expected)
    if st.st_size != expected:
        raise wrong_size(st.st_size, expected)
    verify_block(page, key, block)


def open_problem(exc: OSError) -> Exception:
    """What a failed open of a block file says (a link is refused, not followed)."""
    if exc.errno == errno.ELOOP:
        return CorruptBlockError("a symbolic link (not followed)")
    return exc


_scratch = threading.local()


def header_page() -> memoryview:
    """This thread's page-aligned header buffer (an anonymous mapping)."""
    page: memoryview | None = getattr(_scratch, "page", None)
    if page is None:
        page = _scratch.page = memoryview(mmap.mmap(-1, HEADER_BYTES))
    return page


# -- alignment -------------------------------------------------------------------------------


def is_aligned(block: memoryview) -> bool:
    return aligned(block.nbytes, address(block))


def aligned(nbytes: int, address: int) -> bool:
    """Whether a buffer of ``nbytes`` at ``address`` can take O_DIRECT I/O."""
    return nbytes % ALIGN == 0 and address % ALIGN == 0


def address(block: memoryview) -> int:
    """Address of ``block``'s first byte (the buffer export is dropped at once)."""
    return anchored_address(block)[0]


def anchored_address(block: memoryview) -> tuple[int, object]:
    """Address of ``block``'s first byte (ctypes: ~1.5 us; numpy for read-only buffers) and
    an object holding a buffer export of it."""
    if block.readonly:
        array = np.frombuffer(block, dtype=np.uint8)
        return int(array.ctypes.data), array
    anchor = ctypes.c_char.from_buffer(block)
    return ctypes.addressof(anchor), anchor


# -- deleting --------------------------------------------------------------------------------


def identity_of(fd: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the open file ``fd``."""
    try:
        opened = os.fstat(fd)
    except OSError:
        return None
    return opened.st_dev, opened.st_ino


def unlink_all(paths: Sequence[str]) -> list[str]:
    """Unlink each of ``paths``; the ones that were there."""
    gone = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone.append(path)
    return gone
