"""The C helpers are built with the package, never at run time, and loaded only when nobody
else may have written them.

``pyproject.toml`` builds ``_fsio.c`` and ``_batch_copy.c`` as optional ext-modules (CI adds
``-Werror``); where a C compiler exists, a helper that was not built fails here, so a build
that stopped compiling cannot pass unnoticed behind the Python fallbacks. The loader's trust
checks run against copies of the built libraries in directories made for each case
(``KVTIER_NATIVE_DIR``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from kvtier_async import _native
from kvtier_async.tiers.fs import native as fs_native
from kvtier_async.tiers.fs import native_source
from kvtier_async.transfer import hostcopy

MODULES = {"fsio": fs_native.MODULE, "batch_copy": hostcopy.MODULE}
COMPILER = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
REQUIRED = COMPILER is not None or os.environ.get("KVTIER_REQUIRE_NATIVE") == "1"


def built(module: str) -> Path:
    if not REQUIRED:
        pytest.skip("no C compiler here: the package was installed without its helpers")
    return _native.library_path(module)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_helper_was_built_with_the_package_and_loads(name: str) -> None:
    path = built(MODULES[name])
    assert path.is_file(), f"{path}: not built (see pyproject.toml's ext-modules)"
    _native.load_library(MODULES[name])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_helper_was_built_optimized(name: str) -> None:
    """A build at -O0 (once: CI's CFLAGS=-Werror replaced Python's -O3) made the planner 2.5x
    slower and passed every other test."""
    built(MODULES[name])
    assert _native.load_library(MODULES[name]).kvtier_optimized() == 1


def test_the_helpers_are_in_use_where_they_were_built() -> None:
    built(fs_native.MODULE)
    assert fs_native.native_fsio.__wrapped__() is not None
    assert hostcopy.native_copier.__wrapped__() is not None


def test_nothing_is_compiled_at_run_time(monkeypatch: pytest.MonkeyPatch) -> None:
    built(fs_native.MODULE)

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started at run time: {args}")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    monkeypatch.setattr(subprocess, "Popen", no_compiler)
    assert fs_native.native_fsio.__wrapped__() is not None
    assert hostcopy.native_copier.__wrapped__() is not None


def test_the_generated_header_is_current() -> None:
    assert native_source.HEADER.read_text() == native_source.generated_header(), (
        "src/kvtier_async/tiers/fs/_fsio_defs.h is stale: "
        "run python -m kvtier_async.tiers.fs.native_source"
    )


def test_a_helper_not_built_falls_back_to_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVTIER_NATIVE_DIR", str(tmp_path))  # holds no helper
    with caplog.at_level(logging.INFO, logger="kvtier_async"):
        assert fs_native.native_fsio.__wrapped__() is None
        assert hostcopy.native_copier.__wrapped__() is None
    assert "native fs I/O unavailable" in caplog.text
    assert "native batch copy unavailable" in caplog.text


# -- where a library may be loaded from ----------------------------------------------------


def _copy_into(directory: Path, module: str) -> Path:
    """A copy of the built helper ``module`` in ``directory``, where the loader looks when
    ``KVTIER_NATIVE_DIR`` names it."""
    source = built(module)
    target = directory / (module.rpartition(".")[2] + EXTENSION_SUFFIXES[0])
    shutil.copyfile(source, target)
    target.chmod(0o700)
    return target


@pytest.mark.parametrize(
    "problem", ["fine", "others may write the directory", "others may write it", "a link",
                "another owner"],
)  # fmt: skip
def test_a_library_others_may_have_written_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    where = tmp_path / "lib"
    where.mkdir(mode=0o700)
    library = _copy_into(where, hostcopy.MODULE)
    monkeypatch.setenv("KVTIER_NATIVE_DIR", str(where))
    if problem == "others may write the directory":
        where.chmod(0o777)
    elif problem == "others may write it":
        library.chmod(0o666)
    elif problem == "a link":
        elsewhere = tmp_path / "elsewhere.so"
        library.rename(elsewhere)
        library.symlink_to(elsewhere)
    elif problem == "another owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a file away")
        os.chown(library, 65534, 65534)
    if problem == "fine":
        _native.load_library(hostcopy.MODULE)
        return
    with pytest.raises(_native.NativeUnavailableError, match="not loaded"):
        _native.load_library(hostcopy.MODULE)


EVIL = """
#include <stdio.h>
__attribute__((constructor)) static void run_at_load(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
void kvtier_batch_copy(void) {}
"""


def test_a_link_flipped_after_the_check_loads_none_of_another_users_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack of issue 23 (item 1), against the one directory still named at run time:
    ``KVTIER_NATIVE_DIR`` is a link another user controls, pointing at a private directory
    of ours while it is checked and flipped to theirs (a library of the same name whose
    constructor runs code) before the library is opened. The load goes through the
    directory's descriptor opened for the check: their code never runs."""
    if COMPILER is None:
        pytest.skip("no C compiler here to build the planted library")
    ours, theirs, link = tmp_path / "ours", tmp_path / "theirs", tmp_path / "lib"
    ours.mkdir(mode=0o700)
    theirs.mkdir()
    theirs.chmod(0o777)
    name = _copy_into(ours, hostcopy.MODULE).name
    link.symlink_to(ours)
    monkeypatch.setenv("KVTIER_NATIVE_DIR", str(link))
    marker = tmp_path / "marker"
    evil_c = theirs / "evil.c"
    evil_c.write_text(EVIL.replace("MARKER", f'"{marker}"'))
    subprocess.run(
        [COMPILER, "-shared", "-fPIC", "-o", str(theirs / name), str(evil_c)], check=True
    )
    (theirs / name).chmod(0o700)
    judged = _native._untrusted

    def flip_after_the_directory(st: os.stat_result, *, directory: bool) -> str | None:
        verdict = judged(st, directory=directory)
        if directory:
            link.unlink()
            link.symlink_to(theirs)  # the attacker wins the race right here
        return verdict

    monkeypatch.setattr(_native, "_untrusted", flip_after_the_directory)
    _native.load_library(hostcopy.MODULE)
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


def test_doctor_says_which_paths_are_native_and_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kvtier_async.cli import main

    assert main(["doctor", "--json"]) == 0
    checks = {c["part"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert set(checks) == {"fs tier batch I/O", "host block copies", "CUDA runtime",
                           "Triton swap kernel", "obj tier (S3)", "vLLM connector"}  # fmt: skip
    if REQUIRED:
        assert checks["fs tier batch I/O"]["path"].startswith("native(")
        assert checks["host block copies"]["path"] == "native"
    monkeypatch.setenv("KVTIER_NATIVE_DIR", str(tmp_path))  # as if built without a compiler
    monkeypatch.setenv("KVTIER_NATIVE_COPY", "0")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    fs_line = next(line for line in lines if line.startswith("fs tier batch I/O"))
    assert " python " in fs_line and "was not built with the package" in fs_line
    copy_line = next(line for line in lines if line.startswith("host block copies"))
    assert " memmove " in copy_line and "KVTIER_NATIVE_COPY=0" in copy_line
