"""The C helpers compile cleanly wherever a C compiler exists.

Their callers fall back to Python when a build fails, and their tests skip then, so a helper
that stopped compiling (a missing ``#include``: an error on GCC 14 and later, a warning
before) would pass unnoticed everywhere else. Here every helper is built from scratch with the
strict flags `build_library` always adds, and must build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvtier_async import _native
from kvtier_async.tiers import _fsio
from kvtier_async.transfer import hostcopy

HELPERS = {"fsio": (_fsio._SOURCE, _fsio._FLAGS), "batch_copy": (hostcopy._SOURCE, ())}


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
