"""Small C helpers compiled at first use, as Triton builds its launchers.

A helper is one C source string; `build_library` compiles it with the system C compiler
(``$CC``, ``cc``, ``gcc`` or ``clang``) into a per-user cache (``$KVTIER_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvtier_async``), named by a digest of the source, flags and machine, and
returns the shared library's path. Callers load it with `ctypes.CDLL`, whose calls release
the GIL, and keep a pure-Python fallback for machines without a compiler. `disabled` reads
the opt-out switches (``KVTIER_NATIVE_COPY=0`` and the like).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
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


def disabled(variable: str) -> bool:
    """Whether environment ``variable`` switches a native helper off (0, false, no, off)."""
    return os.environ.get(variable, "1").strip().lower() in {"0", "false", "no", "off"}


def build_library(stem: str, source: str, flags: Sequence[str] = ()) -> Path:
    """Compile ``source`` once per source version, flags and machine; return the library."""
    key = f"{source}{' '.join((*_STRICT, *flags))}{platform.machine()}{sys.platform}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    directory = _cache_dir()
    target = directory / f"{stem}_{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
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
        os.replace(output, target)  # atomic: concurrent builders race harmlessly
    log.debug("built native helper", path=str(target))
    return target


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
