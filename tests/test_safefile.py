"""Opening files another user may have planted (`kvtier_async._safefile`): a link is never
followed, a FIFO never waited on, a device or directory never read, a large or deeply
nested file never parsed."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from kvtier_async._safefile import NotRegularFileError, UnsafeContentError, read_json


def test_a_small_json_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"a": [1, {"b": "[[[[{"}]}))  # brackets in strings do not nest
    assert read_json(str(path), max_depth=3) == {"a": [1, {"b": "[[[[{"}]}


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    os.mkfifo(path, 0o600)  # no writer: a blocking open would never return
    with pytest.raises(NotRegularFileError, match="a FIFO"):
        read_json(str(path))


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
def test_a_link_is_not_followed(tmp_path: Path, target: str) -> None:
    path = tmp_path / "config.json"
    path.symlink_to(target)
    with pytest.raises(OSError) as info:
        read_json(str(path))
    assert info.value.errno == errno.ELOOP


def test_a_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.mkdir()
    with pytest.raises(NotRegularFileError, match="a directory"):
        read_json(str(path))


def test_a_large_sparse_file_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(8 << 30)
    with pytest.raises(UnsafeContentError, match="more than 65536"):
        read_json(str(path))


def test_deep_nesting_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # json.loads would raise RecursionError
    with pytest.raises(UnsafeContentError, match="nested 100000 deep"):
        read_json(str(path), max_bytes=1 << 20)
