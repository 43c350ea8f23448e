"""How the fs tier creates files and directories, publishes a new file, and probes its root.

*Modes* (`Perms`). Prompt-derived data is private by default: every file the tier creates is
mode 0600 and every directory 0700, whatever the umask (which can only narrow them). A wider
``mode`` (for a root shared on purpose) gives directories an x bit for each class that may
read or write, and both are set with ``fchmod``/``chmod`` after creation, since the umask may
have narrowed them. `narrow_dir` takes from an existing directory of this user what its mode
does not allow.

*Publishing.* A new block file is written in full, then published atomically, so its name
appears only with the whole content behind it: by default a named temporary (`tempfiles`)
moved into place with ``os.replace`` (another writer's copy of the same key holds the same
bytes); or, per `PUBLISH_ORDER`, an anonymous ``O_TMPFILE`` linked in with ``linkat``
(``AT_EMPTY_PATH``, or ``/proc/self/fd``), which never replaces a file.

*Probe.* `probe` picks, in a directory, the first way to publish in `PUBLISH_ORDER` that works
there and whether an aligned O_DIRECT write and read work (older tmpfs, overlayfs and some NFS
refuse it with ``EINVAL``): the `IoMode` the tier runs with. On a file system whose files live
in memory (tmpfs, ramfs: `memory_fs`, by ``statfs``) there is no device for O_DIRECT to bypass:
tmpfs accepts the flag since Linux 6.6 and serves it from the page cache all the same, so the
probe takes the buffered path there without trying, and says why (``io=buffered(tmpfs)``).

*config.json* (`write_config`) records a namespace's fields next to its blocks, created once,
atomically; an existing one that differs is warned about, never replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import mmap
import os
import stat
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from kvtier_async._beneath import LinkBelowRootError, opened_dir
from kvtier_async._log import get_logger
from kvtier_async._safefile import read_json
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.fs.blockio import (
    ALIGN,
    O_DIRECT,
    open_file,
    read_all,
    unlink_all,
    write_all,
)
from kvtier_async.tiers.fs.tempfiles import temp_name

__all__ = [
    "PRIVATE_MODE",
    "PUBLISHERS",
    "PUBLISH_ORDER",
    "Directories",
    "IoMode",
    "Perms",
    "UntrustedRootError",
    "check_own_dirs",
    "create_file",
    "make_dirs",
    "memory_fs",
    "narrow_dir",
    "probe",
    "write_config",
]

log = get_logger(__name__)

PRIVATE_MODE: Final = 0o600
# How to publish a new file, in order of preference; the first that works in the rank
# directory wins. O_TMPFILE + linkat never shows a temporary name and leaves nothing behind
# a crash, but measured 5-15% slower than a named temporary + rename with 16 writers on ext4
# (virtio disk, 256 KiB and 2 MiB blocks; likely ext4's journaled orphan list, which every
# O_TMPFILE inode joins and leaves), for the same four system calls per block. So rename
# goes first.
PUBLISH_ORDER: tuple[str, ...] = ("rename", "linkat", "proc-linkat")
_O_TMPFILE: Final = getattr(os, "O_TMPFILE", 0)
_AT_FDCWD: Final = -100
_AT_EMPTY_PATH: Final = 0x1000
_AT_SYMLINK_FOLLOW: Final = 0x400


@dataclass(frozen=True)
class Perms:
    """Modes of what the tier creates: ``file`` for files, ``dir`` for directories (x for
    each class that may read or write); ``fix``: set them explicitly after creation, as the
    umask may have narrowed them (any mode but the private default)."""

    file: int
    dir: int
    fix: bool

    @classmethod
    def of(cls, mode: int) -> Perms:
        search = ((mode >> 1) | (mode >> 2)) & 0o111
        return cls(file=mode, dir=mode | search, fix=mode != PRIVATE_MODE)


_PRIVATE: Final = Perms.of(PRIVATE_MODE)

MakeMany = Callable[[list[str], int, bool], list[int]]
"""``(directories, mode, fix) -> codes``: 1 made, 0 there already, negative failed."""


@dataclass(frozen=True)
class IoMode:
    """How a root is driven, decided by the probe at open."""

    direct: bool
    publish: str  # "linkat" (AT_EMPTY_PATH), "proc-linkat" (/proc/self/fd) or "rename"
    memory: str = ""  # "tmpfs" or "ramfs" when the root's files live in memory

    def describe(self) -> str:
        """``O_DIRECT``, ``buffered`` or ``buffered(tmpfs)`` (why there is no O_DIRECT)."""
        if self.direct:
            return "O_DIRECT"
        return f"buffered({self.memory})" if self.memory else "buffered"


# -- directories -----------------------------------------------------------------------------


def make_dirs(directory: str, perms: Perms, made: Callable[[str], None] | None = None) -> bool:
    """``mkdir`` ``directory`` with ``perms.dir``, and its missing parents first if it says
    ``ENOENT``; True if this call made ``directory``. ``made`` hears of each one made,
    parents first."""
    try:
        os.mkdir(directory, perms.dir)
    except FileExistsError:
        return False
    except FileNotFoundError:
        parent = os.path.dirname(directory)
        if parent == directory:
            raise
        make_dirs(parent, perms, made)
        try:
            os.mkdir(directory, perms.dir)
        except FileExistsError:
            return False
    if perms.fix:
        os.chmod(directory, perms.dir)
    if made is not None:
        made(directory)
    return True


def narrow_dir(directory: str, perms: Perms) -> None:
    """Take from ``directory``, if it is this user's, what ``perms.dir`` does not allow."""
    st = os.lstat(directory)
    extra = stat.S_IMODE(st.st_mode) & 0o777 & ~perms.dir
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and extra:
        os.chmod(directory, stat.S_IMODE(st.st_mode) & ~extra)
        log.info("fs tier narrowed the mode of its namespace directory", path=directory,
                 mode=f"{stat.S_IMODE(st.st_mode) & ~extra:04o}")  # fmt: skip


class Directories:
    """The directories of one root known to exist (``set.add`` is atomic: any thread may
    call), made on demand; forgotten all at once when a create finds one gone, since an
    operator may remove the root, the namespace or a rank directory while the tier runs."""

    def __init__(
        self,
        ns_dir: str,
        known: set[str],
        ctx: TierContext,
        perms: Perms,
        warn: Callable[..., object],
        make_many: MakeMany | None = None,
    ) -> None:
        self._ns_dir = ns_dir
        self._known = known
        self._ctx = ctx
        self._perms = perms
        self._warn = warn  # the tier's rate-limited warnings
        self._make_many = make_many  # the C helper's batch mkdir (`FsIo.make_dirs`)

    def ensure(self, directory: str) -> bool:
        """Make ``directory`` unless known; True if made by this call.

        One ``mkdir`` (``os.makedirs`` stats every level first): a new leaf costs one system
        call, a known one none; missing parents are made when it says ``ENOENT``. A new
        namespace directory gets its ``config.json``."""
        if directory in self._known:
            return False
        made = make_dirs(directory, self._perms, self._made)
        self._known.add(directory)
        return made

    def ensure_many(self, directories: Iterable[str]) -> tuple[set[str], dict[str, OSError]]:
        """`ensure` each directory: which this call made, and the error of each it could
        not make. With the C helper the unknown ones are one call (each ``mkdir`` made from
        Python gives the GIL up and waits to take it back); one it could not make (a
        grandparent missing, an error) goes through `ensure`, which makes what is missing
        or raises the error with its path."""
        unknown = [d for d in dict.fromkeys(directories) if d not in self._known]
        made: set[str] = set()
        failed: dict[str, OSError] = {}
        if not unknown:
            return made, failed
        codes: Sequence[int | None] = [None] * len(unknown)
        if self._make_many is not None:
            codes = self._make_many(unknown, self._perms.dir, self._perms.fix)
        for directory, code in zip(unknown, codes, strict=True):
            if code is not None and code >= 0:
                self._known.add(directory)
                if code:
                    made.add(directory)
                continue
            try:
                if self.ensure(directory):
                    made.add(directory)
            except OSError as exc:
                failed[directory] = exc
        return made, failed

    def forget(self) -> None:
        """Forget every directory known to exist (one was removed under us)."""
        self._known.clear()

    def _made(self, directory: str) -> None:
        if directory == self._ns_dir:
            self._warn("fs tier made its namespace directory again", path=directory)
            write_config(directory, self._ctx, self._perms)


# -- creating and publishing -----------------------------------------------------------------


def create_file(
    directory: str,
    publish: str,
    direct: bool,
    perms: Perms = _PRIVATE,
    access: int = os.O_WRONLY,
) -> tuple[int, str | None]:
    """A new file in ``directory``, to be published with ``publish``: ``(fd, temporary's
    path, or None for an anonymous O_TMPFILE)``."""
    flags = access | (O_DIRECT if direct else 0)
    if publish != "rename":
        fd, temp = open_file(directory, flags | _O_TMPFILE, perms.file), None
    else:
        temp = os.path.join(directory, temp_name("blk"))
        fd = open_file(temp, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, perms.file)
    if perms.fix:
        try:
            os.fchmod(fd, perms.file)
        except BaseException:
            os.close(fd)
            if temp is not None:
                unlink_all([temp])
            raise
    return fd, temp


def _publish_linkat(fd: int, temp: str | None, path: str) -> bool:
    return _linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH)


def _publish_proc(fd: int, temp: str | None, path: str) -> bool:
    source = f"/proc/self/fd/{fd}".encode()
    return _linkat(_AT_FDCWD, source, _AT_FDCWD, os.fsencode(path), _AT_SYMLINK_FOLLOW)


def _publish_rename(fd: int, temp: str | None, path: str) -> bool:
    if temp is None:
        raise ValueError("rename publishing needs a named temporary file")
    os.replace(temp, path)
    return True


# publish(fd, temporary or None, final path): False if a file is there already (linkat only).
PUBLISHERS: Final[dict[str, Callable[[int, str | None, str], bool]]] = {
    "linkat": _publish_linkat,
    "proc-linkat": _publish_proc,
    "rename": _publish_rename,
}


@functools.cache
def _libc_linkat() -> Callable[..., int]:
    linkat = ctypes.CDLL(None, use_errno=True).linkat
    linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    linkat.restype = ctypes.c_int
    function: Callable[..., int] = linkat
    return function


def _linkat(old_dir: int, old: bytes, new_dir: int, new: bytes, flags: int) -> bool:
    """``linkat(2)``; False if ``new`` exists already, OSError on other failures."""
    if _libc_linkat()(old_dir, old, new_dir, new, flags) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    raise OSError(code, os.strerror(code), os.fsdecode(new))


# -- probing ---------------------------------------------------------------------------------


def probe(directory: str, perms: Perms) -> IoMode:
    """How to publish and whether O_DIRECT works, in ``directory``."""
    publish = _probe_publish(directory, perms)
    memory = memory_fs(directory)
    if memory:
        return IoMode(direct=False, publish=publish, memory=memory)
    return IoMode(direct=_probe_direct(directory, publish, perms), publish=publish)


# ``statfs`` ``f_type`` of the file systems whose files live in memory (linux/magic.h).
_MEMORY_FS: Final = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def memory_fs(directory: str) -> str:
    """``"tmpfs"`` or ``"ramfs"`` when ``directory`` is on one (``statfs``), else ``""``
    (also when ``statfs`` cannot tell: then the O_DIRECT probe decides)."""
    if not sys.platform.startswith("linux"):
        return ""
    buffer = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux)
    if _libc().statfs(os.fsencode(directory), buffer) != 0:
        return ""
    f_type = ctypes.c_long.from_buffer(buffer).value  # the first field, __fsword_t f_type
    return _MEMORY_FS.get(f_type & 0xFFFFFFFF, "")


@functools.cache
def _libc() -> ctypes.CDLL:
    library = ctypes.CDLL(None, use_errno=True)
    library.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    library.statfs.restype = ctypes.c_int
    return library


def _probe_publish(directory: str, perms: Perms) -> str:
    """The first way in `PUBLISH_ORDER` to publish a file that works in ``directory``."""
    for publish in PUBLISH_ORDER:
        if publish == "rename" or _can_link_tmpfile(directory, publish, perms):
            return publish
    return "rename"


def _can_link_tmpfile(directory: str, publish: str, perms: Perms) -> bool:
    if not _O_TMPFILE:
        return False
    try:
        fd = open_file(directory, os.O_WRONLY | _O_TMPFILE, perms.file)
    except OSError:
        return False  # EOPNOTSUPP, EISDIR (old kernels), EINVAL
    target = os.path.join(directory, temp_name("probe"))
    try:
        return PUBLISHERS[publish](fd, None, target)
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)


def _probe_direct(directory: str, publish: str, perms: Perms) -> bool:
    """Whether an aligned O_DIRECT write and read work in ``directory``."""
    if not O_DIRECT:
        return False
    page = memoryview(mmap.mmap(-1, ALIGN))
    try:
        fd, temp = create_file(directory, publish, True, perms, access=os.O_RDWR)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    try:
        write_all(fd, [page])
        return read_all(fd, [page]) == ALIGN
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        os.close(fd)
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        page.release()


# -- config.json -----------------------------------------------------------------------------

CONFIG_MAX_BYTES: Final = 64 * 1024  # what we write is a few hundred bytes
CONFIG_MAX_DEPTH: Final = 8  # a flat object


class UntrustedRootError(ValueError):
    """A tier root holds metadata we did not write (see `_check_config`), or a link where
    its namespace or rank directory goes (see `check_own_dirs`)."""


def check_own_dirs(root: str, relative: str) -> None:
    """Refuse the root unless every component of ``relative`` (the namespace and rank
    directories) is a directory, not a link: a link there would send stores, loads and
    deletions outside the root."""
    try:
        with opened_dir(root, relative):
            pass
    except LinkBelowRootError as exc:
        raise UntrustedRootError(
            f"fs tier: {exc.strerror}: a link where the tier's own directory goes; remove it "
            "or use another root_dir"
        ) from None


def write_config(ns_dir: str, ctx: TierContext, perms: Perms) -> None:
    """Create ``config.json`` once (atomically); warn if an existing one differs."""
    path = os.path.join(ns_dir, "config.json")
    fields = ctx.namespace_fields()
    data = json.dumps(fields, indent=2, sort_keys=True).encode() + b"\n"
    temp = os.path.join(ns_dir, temp_name("config.json"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, perms.file)
    with open(fd, "wb") as f:
        if perms.fix:
            os.fchmod(fd, perms.file)
        f.write(data)
    try:
        os.link(temp, path)
    except FileExistsError:
        _check_config(path, fields)
    except OSError:  # no hard links here: a rename is atomic too
        if not os.path.exists(path):
            os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _check_config(path: str, fields: dict[str, object]) -> None:
    """An existing ``config.json``: one that is not a small JSON file (a link, a FIFO, a
    device, a directory, too large or too deep: nothing we wrote) refuses the root."""
    try:
        existing = read_json(path, max_bytes=CONFIG_MAX_BYTES, max_depth=CONFIG_MAX_DEPTH)
    except (OSError, ValueError) as exc:
        raise UntrustedRootError(
            f"fs tier: {path} is not a config.json this tier wrote ({exc}); move it away "
            "or use another root_dir"
        ) from exc
    if existing != json.loads(json.dumps(fields)):
        log.warning("fs tier config.json differs from this configuration", path=path)
