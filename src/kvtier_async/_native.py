"""Small C helpers compiled at first use, as Triton builds its launchers.

A helper is one C source string; `load_library` compiles it with the system C compiler
(``$CC``, ``cc``, ``gcc`` or ``clang``) into a per-user cache (``$KVTIER_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvtier_async``), named by a digest of the source, flags and machine, and
loads it with `ctypes.CDLL` (whose calls release the GIL). Callers keep a pure-Python
fallback for machines without a compiler. `disabled` reads the opt-out switches
(``KVTIER_NATIVE_COPY=0`` and the like).

*Trust.* Loading a library runs its code, so a library is loaded only from a directory that
is owned by this user and writable by nobody else, and only if the file itself is a regular
file (not a symbolic link) owned by this user and writable by nobody else. No path is
resolved twice: the cache directory is opened once and judged on its descriptor (``fstat``),
the library is opened relative to that descriptor with ``O_NOFOLLOW`` and judged on its own
descriptor, and ``dlopen`` loads that descriptor (``/proc/self/fd/N``), never the path. So a
symbolic link flipped between the check and the load (a ``KVTIER_CACHE_DIR`` in ``/tmp`` that
another user owns) cannot make this process load another user's code: the second resolution
it raced is gone. A cached library that fails the check is rebuilt in place (the directory is
ours; builds run in a private scratch directory and are written into the cache through its
descriptor, then renamed); a cache directory that fails it is not used: this process builds
into a private temporary directory instead (removed at exit) and says so in one warning.
Libraries are written mode 0700.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

from kvtier_async._log import get_logger

__all__ = ["BUILD_ERRORS", "build_library", "disabled", "load_library"]

log = get_logger(__name__)

_COMPILE_TIMEOUT_S: Final = 120.0
# A call to an undeclared function compiles with a warning on older compilers and fails on
# GCC 14 and later: make it fail everywhere, so a missing #include shows up here first.
_STRICT: Final = ("-Wall", "-Werror=implicit-function-declaration")
# What a failed build or load raises; callers catch these and fall back.
BUILD_ERRORS: Final = (OSError, subprocess.SubprocessError, RuntimeError)
# Refused cache directory -> this process's private replacement.
_PRIVATE: dict[str, Path] = {}
_PRIVATE_LOCK = threading.Lock()
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def disabled(variable: str) -> bool:
    """Whether environment ``variable`` switches a native helper off (0, false, no, off)."""
    return os.environ.get(variable, "1").strip().lower() in {"0", "false", "no", "off"}


def load_library(stem: str, source: str, flags: Sequence[str] = ()) -> ctypes.CDLL:
    """The helper compiled from ``source`` (built once per source version, flags and
    machine), loaded from an open descriptor of the checked file (see *Trust*).

    The descriptor stays open for the life of the process: ``dlopen`` knows a library by
    the name it was given, so a later library loaded through a reused descriptor number
    would be handed the first one."""
    with _library(stem, source, flags) as (fd, _path):
        kept = os.dup(fd)
        try:
            return ctypes.CDLL(f"/proc/self/fd/{kept}")
        except BaseException:
            os.close(kept)
            raise


def build_library(stem: str, source: str, flags: Sequence[str] = ()) -> Path:
    """Where the helper is cached, built if it was not. For tools and tests: never load
    this path (another process may change what it names); `load_library` loads."""
    with _library(stem, source, flags) as (_fd, path):
        return path


@contextlib.contextmanager
def _library(stem: str, source: str, flags: Sequence[str]) -> Iterator[tuple[int, Path]]:
    """An open descriptor of the checked library and its path, built if need be."""
    key = f"{source}{' '.join((*_STRICT, *flags))}{platform.machine()}{sys.platform}"
    name = f"{stem}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    dir_fd, directory = _trusted_cache_dir()
    try:
        fd, problem = _open_library(dir_fd, name)
        if fd is None:
            if problem != "missing":
                log.warning("native helper library is not private; rebuilding it",
                            path=str(directory / name), problem=problem)  # fmt: skip
            _build_into(dir_fd, name, stem, source, flags)
            fd, problem = _open_library(dir_fd, name)
            if fd is None:
                raise RuntimeError(f"{directory / name}: {problem} right after it was built")
        try:
            yield fd, directory / name
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def _open_library(dir_fd: int, name: str) -> tuple[int | None, str]:
    """The library ``name`` of the directory open at ``dir_fd``, opened without following
    a link and checked on its descriptor; ``(None, why not)`` if it may not be loaded."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, "a symbolic link" if exc.errno == errno.ELOOP else str(exc)
    problem = _untrusted(os.fstat(fd), directory=False)
    if problem is not None:
        os.close(fd)
        return None, problem
    return fd, ""


def _build_into(dir_fd: int, name: str, stem: str, source: str, flags: Sequence[str]) -> None:
    """Compile in a private scratch directory, then write the library into the directory
    open at ``dir_fd`` under a temporary name and rename it to ``name`` (atomic there:
    concurrent builders race harmlessly; a link or foreign file at ``name`` is replaced)."""
    compiler = _compiler()
    with tempfile.TemporaryDirectory(prefix="kvtier_async-build-") as scratch:
        source_path = Path(scratch) / f"{stem}.c"
        source_path.write_text(source)
        output = Path(scratch) / name
        command = [
            *compiler.split(), "-O2", *_STRICT, *flags, "-shared", "-fPIC", "-o", str(output),
            str(source_path),
        ]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[:500]}")
        data = output.read_bytes()
    temp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _READ_FLAGS, 0o700, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)
    log.debug("built native helper", name=name)


def _trusted_cache_dir() -> tuple[int, Path]:
    """A descriptor of the cache directory if it is private (made if missing), else of a
    private one, and its path. The directory is resolved once, into the descriptor, and
    judged on it: whatever its path names later, everything is read through this."""
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return _private_dir(str(directory), f"cannot create or open it: {exc}")
    problem = _untrusted(os.fstat(fd), directory=True)
    if problem is None:
        return fd, directory
    os.close(fd)
    return _private_dir(str(directory), problem)


def _untrusted(st: os.stat_result, *, directory: bool) -> str | None:
    """Why a file of this ``fstat`` may not hold or be a library to load; None if it may."""
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return f"not a {'directory' if directory else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets others write"
    return None


def _private_dir(refused: str, problem: str) -> tuple[int, Path]:
    """A private temporary directory for this process's builds (removed at exit), made
    once per refused cache directory, which is named in one warning; opened as above."""
    with _PRIVATE_LOCK:
        private = _PRIVATE.get(refused)
        if private is None:
            private = _PRIVATE[refused] = Path(tempfile.mkdtemp(prefix="kvtier_async-native-"))
            atexit.register(shutil.rmtree, private, ignore_errors=True)
            log.warning(
                "native helper cache directory is not private; building in a private "
                "temporary directory instead (set KVTIER_CACHE_DIR to a directory only you "
                "can write)",
                cache=refused,
                problem=problem,
                using=str(private),
            )
    fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    wrong = _untrusted(os.fstat(fd), directory=True)
    if wrong is not None:  # mkdtemp made it 0700 and ours: something replaced it
        os.close(fd)
        raise RuntimeError(f"private build directory {private}: {wrong}")
    return fd, private


def _cache_dir() -> Path:
    explicit = os.environ.get("KVTIER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier_async"


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate.split()[0]):
            return candidate
    raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
