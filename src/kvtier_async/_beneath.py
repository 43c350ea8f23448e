"""Walking and deleting below a root without following a link at any component.

A tier root is the user's choice, so the path to it is taken as given (links in it
followed). Below it, anything may have been swapped for a symbolic link between two calls: a
rank directory pointing at ``/``, a fan-out directory replaced while a GC runs. A path string
resolved again by ``unlink`` would follow such a link and delete outside the root. So here every
component below the root is opened relative to its parent's descriptor with ``O_NOFOLLOW |
O_DIRECTORY``, and the last one is removed with ``unlinkat`` on its parent's descriptor: a
link below the root is never entered, only listed (by `walk`) or left alone (by `unlink`).
``O_NONBLOCK`` keeps a FIFO planted at a directory's name from blocking the open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from typing import Final

__all__ = [
    "DIR_FLAGS",
    "LinkBelowRootError",
    "discard",
    "entries",
    "opened_dir",
    "unlink",
    "unlink_all",
    "unlink_under",
    "walk",
]

DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LinkBelowRootError(OSError):
    """A component below the root is a symbolic link or not a directory."""


def _parts(relative: str) -> list[str]:
    parts = [part for part in relative.split("/") if part and part != "."]
    if ".." in parts:
        raise ValueError(f"{relative!r}: '..' is not allowed below a root")
    return parts


@contextlib.contextmanager
def opened_dir(root: str, relative: str = "") -> Iterator[int]:
    """A descriptor of the directory ``root/relative``, closed on exit: ``root`` opened as
    given, each component of ``relative`` relative to its parent, never through a link.

    Raises:
        FileNotFoundError: A component is missing.
        LinkBelowRootError: A component below ``root`` is a link or not a directory.
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walked = root
        for part in _parts(relative):
            walked = os.path.join(walked, part)
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkBelowRootError(
                        exc.errno, f"{walked}: a symbolic link or not a directory (not followed)"
                    ) from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def entries(root: str, relative: str = "") -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of each entry of the directory ``root/relative`` (see `opened_dir`
    for what it raises); entries that vanish while listed are left out."""
    with opened_dir(root, relative) as fd:
        return _list(fd)


def _list(fd: int) -> list[tuple[str, os.stat_result]]:
    found = []
    with os.scandir(fd) as it:
        for entry in it:
            with contextlib.suppress(FileNotFoundError):
                found.append((entry.name, entry.stat(follow_symlinks=False)))
    return sorted(found, key=lambda item: item[0])


def walk(root: str, relative: str = "") -> Iterator[tuple[str, os.stat_result]]:
    """``(path relative to root, lstat)`` of every entry below ``root/relative`` that is not
    a directory, depth first, by name. Links are listed as links, never entered; a directory
    that vanishes, or is swapped for a link or a file while the walk runs, is skipped. Nothing
    (no error) when ``root/relative`` is missing or is itself a link."""
    try:
        with opened_dir(root, relative) as fd:
            yield from _walk(fd, "/".join(_parts(relative)))
    except (FileNotFoundError, LinkBelowRootError):
        return


def _walk(fd: int, relative: str) -> Iterator[tuple[str, os.stat_result]]:
    for name, st in _list(fd):
        path = f"{relative}/{name}" if relative else name
        if not stat.S_ISDIR(st.st_mode):
            yield path, st
            continue
        try:
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
        except OSError:  # vanished, or swapped for a link or a file since the listing
            continue
        try:
            yield from _walk(child, path)
        finally:
            os.close(child)


def unlink(root: str, relpath: str, identity: tuple[int, int] | None = None) -> bool:
    """Remove ``root/relpath`` (a link itself, never its target; an empty directory with
    ``rmdir``), reaching it through its parents' descriptors (see `opened_dir`); with
    ``identity`` ``(st_dev, st_ino)``, only if it still is that file. True if removed; False
    if it is gone, changed, or a component below ``root`` is a link. Other errors (``EACCES``,
    ``EROFS``...) are raised."""
    parent, _, name = relpath.rstrip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise ValueError(f"{relpath!r}: not a file below the root")
    try:
        with opened_dir(root, parent) as fd:
            current = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if identity is not None and identity != (current.st_dev, current.st_ino):
                return False
            if stat.S_ISDIR(current.st_mode):
                os.rmdir(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    except (FileNotFoundError, LinkBelowRootError):
        return False
    return True


def unlink_under(root: str, path: str, identity: tuple[int, int] | None = None) -> bool:
    """`unlink` of ``path``, a path below ``root`` that starts with it (as the tiers build
    their paths: ``f"{root}/{relpath}"``)."""
    prefix = root.rstrip("/") + "/"
    if not path.startswith(prefix):
        raise ValueError(f"{path!r} is not below {root!r}")
    return unlink(root, path[len(prefix) :], identity)


def unlink_all(root: str, paths: Sequence[str]) -> list[str]:
    """`unlink_under` each of ``paths``; the ones it removed."""
    return [path for path in paths if unlink_under(root, path)]


def discard(root: str, path: str, identity: tuple[int, int] | None = None) -> bool:
    """`unlink_under`, any error a False: for removing a damaged block, which must never
    fail the call that found it."""
    try:
        return unlink_under(root, path, identity)
    except OSError:
        return False
