"""The C helpers, built with the package, and the opt-out switches.

A helper is a real C file under ``src/`` built when the package is built (setuptools
``ext-modules`` in ``pyproject.toml``, optional: where no compiler was present at install,
the package installs and runs on its Python paths). Nothing is compiled at run time. The
built file is a plain shared library beside the package's modules, named like an extension
module (``_fsio.cpython-311-x86_64-linux-gnu.so``); `load_library` finds it with the import
system (so an editable install finds the in-place build) and loads it with `ctypes.CDLL`,
whose calls release the GIL. `disabled` reads the opt-out switches (``KVTIER_NATIVE_COPY=0``
and the like); `report` says what was found and why not, for ``kvtier doctor``.

*Trust.* Loading a library runs its code, so a library is loaded only from a directory and as
a file that nobody but its owner may write, owned by this user or by root (as the package's
own Python files are), and never through a path resolved twice: the directory is opened once
and judged on its descriptor, the library opened relative to it with ``O_NOFOLLOW`` and
judged on its own descriptor, and ``dlopen`` loads that descriptor (``/proc/self/fd/N``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import os
import stat
from collections.abc import Iterator
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Final

from kvtier_async._log import get_logger

__all__ = ["BUILD_ERRORS", "NativeUnavailableError", "disabled", "library_path", "load_library"]

log = get_logger(__name__)

_NOT_BUILT: Final = (
    "{} was not built with the package (no C compiler at install?); reinstall with one to use it"
)
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NativeUnavailableError(OSError):
    """A helper was not built with the package, or may not be loaded (the message says)."""


# What a failed load raises; callers catch these and fall back to their Python paths.
BUILD_ERRORS: Final = (OSError, RuntimeError)


def disabled(variable: str) -> bool:
    """Whether environment ``variable`` switches a native helper off (0, false, no, off)."""
    return os.environ.get(variable, "1").strip().lower() in {"0", "false", "no", "off"}


def library_path(module: str) -> Path:
    """Where the helper ``module`` (``kvtier_async.tiers.fs._fsio``) was built;
    `NativeUnavailableError` if it was not (no compiler when the package was built).

    ``KVTIER_NATIVE_DIR`` names a directory to take the helpers from instead (the sanitizer
    session's builds: ``nox -s sanitize``); they are judged like any other (see *Trust*)."""
    override = os.environ.get("KVTIER_NATIVE_DIR")
    if override:
        return Path(override) / (module.rpartition(".")[2] + EXTENSION_SUFFIXES[0])
    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        raise NativeUnavailableError(_NOT_BUILT.format(module))
    return Path(spec.origin)


def load_library(module: str) -> ctypes.CDLL:
    """The helper ``module``, loaded from an open descriptor of the checked file (see
    *Trust*). The descriptor stays open for the life of the process: ``dlopen`` knows a
    library by the name it was given, so a later library loaded through a reused descriptor
    number would be handed the first one."""
    path = library_path(module)
    with _opened(path) as fd:
        kept = os.dup(fd)
    try:
        return ctypes.CDLL(f"/proc/self/fd/{kept}")
    except BaseException:
        os.close(kept)
        raise


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[int]:
    """A descriptor of the library at ``path``, its directory and itself judged on their
    descriptors; `NativeUnavailableError` saying why it may not be loaded."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        problem = _untrusted(os.fstat(dir_fd), directory=True)
        if problem is not None:
            raise NativeUnavailableError(f"{path.parent}: {problem}; not loaded")
        try:
            fd = os.open(path.name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            raise NativeUnavailableError(_NOT_BUILT.format(path)) from None
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise NativeUnavailableError(f"{path}: {why}; not loaded") from None
        try:
            problem = _untrusted(os.fstat(fd), directory=False)
            if problem is not None:
                raise NativeUnavailableError(f"{path}: {problem}; not loaded")
            yield fd
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def _untrusted(st: os.stat_result, *, directory: bool) -> str | None:
    """Why a file of this ``fstat`` may not hold or be a library to load; None if it may."""
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return f"not a {'directory' if directory else 'regular file'}"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, neither this user (uid {os.geteuid()}) nor root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets others write"
    return None
