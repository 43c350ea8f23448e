"""The C helpers compile cleanly wherever a C compiler exists.

Their callers fall back to Python when a build fails, and their tests skip then, so a helper
that stopped compiling (a missing ``#include``: an error on GCC 14 and later, a warning
before) would pass unnoticed everywhere else. Here every helper is built from scratch with the
strict flags `build_library` always adds, and must build.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from kvtier_async import _native
from kvtier_async.tiers.fs import native_source
from kvtier_async.transfer import hostcopy

HELPERS = {
    "fsio": (native_source.SOURCE, native_source.FLAGS),
    "batch_copy": (hostcopy._SOURCE, ()),
}


@pytest.fixture(autouse=True)
def compiler() -> None:
    if not any(shutil.which(name) for name in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler here")


@pytest.mark.parametrize("stem", sorted(HELPERS))
def test_each_helper_builds_with_the_strict_flags(
    stem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))  # nothing cached: a real build
    source, flags = HELPERS[stem]
    built = _native.build_library(stem, source, flags)
    assert built.exists() and built.parent == tmp_path


def test_a_call_to_an_undeclared_function_fails_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    source = 'int f(void) { return rename("a", "b"); }\n'  # no <stdio.h>
    with pytest.raises(RuntimeError, match="implicit declaration"):
        _native.build_library("undeclared", source)
    assert not list(tmp_path.glob("undeclared_*.so"))


# -- where a library may be loaded from ----------------------------------------------------

TINY = "int kvtier_tiny(void) { return 7; }\n"


@pytest.fixture(autouse=True)
def fresh_private_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own process-wide map of refused cache directories."""
    monkeypatch.setattr(_native, "_PRIVATE", {}, raising=False)


def _load(path: Path) -> int:
    return int(ctypes.CDLL(str(path)).kvtier_tiny())


def test_a_new_cache_and_its_libraries_are_private_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(cache))
    old = os.umask(0)
    try:
        built = _native.build_library("tiny", TINY)
    finally:
        os.umask(old)
    assert built.parent == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(built.stat().st_mode) == 0o700
    assert _load(built) == 7


def _plant(directory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file where `build_library("tiny", TINY)` looks for its library in ``directory``,
    holding something that is not that library."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "learn"))
    name = _native.build_library("tiny", TINY).name
    planted = directory / name
    planted.write_bytes(b"not the library")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(directory))
    return planted


@pytest.mark.parametrize("problem", ["others may write", "another owner"])
def test_a_cache_directory_that_is_not_private_is_not_used(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    problem: str,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = _plant(cache, tmp_path, monkeypatch)
    if problem == "others may write":
        cache.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory away")
        os.chown(cache, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="kvtier_async._native"):
        built = _native.build_library("tiny", TINY)
        again = _native.build_library("tiny", TINY)
    assert built.parent != cache and again == built
    assert _load(built) == 7
    assert planted.read_bytes() == b"not the library"
    assert stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    (record,) = [r for r in caplog.records if "not private" in r.getMessage()]  # once
    assert str(cache) in record.getMessage()


@pytest.mark.parametrize("problem", ["others may write", "another owner", "symlink"])
def test_a_cached_library_that_is_not_private_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = _plant(cache, tmp_path, monkeypatch)
    if problem == "others may write":
        planted.chmod(0o666)
    elif problem == "another owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a file away")
        os.chown(planted, 65534, 65534)
    else:
        target = tmp_path / "elsewhere.so"
        planted.rename(target)
        planted.symlink_to(target)
    built = _native.build_library("tiny", TINY)
    assert built == planted and not built.is_symlink()
    st = built.stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert _load(built) == 7


EVIL = """
#include <stdio.h>
__attribute__((constructor)) static void run_at_load(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int kvtier_tiny(void) { return 666; }
"""


def test_a_cache_link_flipped_after_the_check_loads_none_of_another_users_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack of issue 23 (item 1): ``KVTIER_CACHE_DIR`` is a link another user
    controls, pointing at a private directory of ours while it is checked and flipped to
    theirs (holding a library of the same name whose constructor runs code) before the
    load. The load goes through the descriptors opened at the check: their code never runs."""
    ours, theirs, link = tmp_path / "ours", tmp_path / "theirs", tmp_path / "cache"
    ours.mkdir(mode=0o700)
    theirs.mkdir()
    theirs.chmod(0o777)
    link.symlink_to(ours)
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(link))
    name = _native.build_library("tiny", TINY).name  # cached in ours
    marker = tmp_path / "marker"
    evil_c = theirs / "evil.c"
    evil_c.write_text(EVIL.replace("MARKER", f'"{marker}"'))
    compiler = next(c for c in ("cc", "gcc", "clang") if shutil.which(c))
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(theirs / name), str(evil_c)], check=True
    )
    (theirs / name).chmod(0o700)
    opened = _native._open_library

    def flip_then_open(dir_fd: int, library: str) -> tuple[int | None, str]:
        link.unlink()
        link.symlink_to(theirs)  # the attacker wins the race right here
        return opened(dir_fd, library)

    monkeypatch.setattr(_native, "_open_library", flip_then_open)
    library = _native.load_library("tiny", TINY)
    assert library.kvtier_tiny() == 7
    assert not marker.exists()
    assert os.path.realpath(link) == str(theirs)  # the flip did happen


@pytest.mark.parametrize(
    ("value", "off"),
    [("0", True), ("false", True), (" No ", True), ("OFF", True), ("1", False), ("", False)],
)
def test_the_opt_out_switches_have_one_parser(
    monkeypatch: pytest.MonkeyPatch, value: str, off: bool
) -> None:
    """Every KVTIER_* opt-out switch (native fs I/O, native copy, cudaMemcpyAsync) is read
    by `_native.disabled`, and an unset switch is on."""
    from kvtier_async import _cudart

    for variable in ("KVTIER_NATIVE_FS", "KVTIER_NATIVE_COPY", "KVTIER_CUDART_MEMCPY"):
        monkeypatch.setenv(variable, value)
        assert _native.disabled(variable) is off
        monkeypatch.delenv(variable)
        assert _native.disabled(variable) is False
    assert _cudart.disabled is _native.disabled
