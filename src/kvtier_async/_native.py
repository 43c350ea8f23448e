"""Small C helpers compiled at first use, as Triton builds its launchers.

A helper is one C source string; `build_library` compiles it with the system C compiler
(``$CC``, ``cc``, ``gcc`` or ``clang``) into a per-user cache (``$KVTIER_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvtier_async``), named by a digest of the source, flags and machine, and
returns the shared library's path. Callers load it with `ctypes.CDLL`, whose calls release
the GIL, and keep a pure-Python fallback for machines without a compiler. `disabled` reads
the opt-out switches (``KVTIER_NATIVE_COPY=0`` and the like).

*Trust.* Loading a library runs its code, so a library is loaded only from a directory that
is owned by this user and writable by nobody else, and only if the file itself is a regular
file (not a symbolic link) owned by this user and writable by nobody else. A cached library
that fails the check is rebuilt in place (the directory is ours); a cache directory that
fails it is not used: this process builds into a private temporary directory instead
(removed at exit) and says so in one warning. Libraries are written mode 0700.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from kvtier_async._log import get_logger

__all__ = ["BUILD_ERRORS", "build_library", "disabled"]

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


def disabled(variable: str) -> bool:
    """Whether environment ``variable`` switches a native helper off (0, false, no, off)."""
    return os.environ.get(variable, "1").strip().lower() in {"0", "false", "no", "off"}


def build_library(stem: str, source: str, flags: Sequence[str] = ()) -> Path:
    """Compile ``source`` once per source version, flags and machine; return the library."""
    key = f"{source}{' '.join((*_STRICT, *flags))}{platform.machine()}{sys.platform}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    directory = _trusted_cache_dir()
    target = directory / f"{stem}_{digest}.so"
    problem = _untrusted(target, directory=False)
    if problem is None:
        return target
    if problem != "missing":
        log.warning("native helper library is not private; rebuilding it", path=str(target),
                    problem=problem)  # fmt: skip
    compiler = _compiler()
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        source_path = Path(scratch) / f"{stem}.c"
        source_path.write_text(source)
        output = Path(scratch) / target.name
        command = [
            *compiler.split(), "-O2", *_STRICT, *flags, "-shared", "-fPIC", "-o", str(output),
            str(source_path),
        ]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[:500]}")
        os.chmod(output, 0o700)  # the compiler's mode follows the umask
        os.replace(output, target)  # atomic: concurrent builders race harmlessly
    log.debug("built native helper", path=str(target))
    return target


def _trusted_cache_dir() -> Path:
    """The cache directory if it is private (made if missing), else a private one."""
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        return _private_dir(str(directory), f"cannot create it: {exc}")
    problem = _untrusted(directory, directory=True)
    return directory if problem is None else _private_dir(str(directory), problem)


def _untrusted(path: Path, *, directory: bool) -> str | None:
    """Why ``path`` may not hold or be a library to load; None if it may ("missing" if it
    does not exist). A directory is followed through symbolic links; a library is not."""
    try:
        st = os.stat(path) if directory else os.lstat(path)
    except FileNotFoundError:
        return "missing"
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return f"not a {'directory' if directory else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets others write"
    return None


def _private_dir(refused: str, problem: str) -> Path:
    """A private temporary directory for this process's builds (removed at exit), made
    once per refused cache directory, which is named in one warning."""
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
    return private


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
