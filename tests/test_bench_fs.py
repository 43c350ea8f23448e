"""``kvtier bench fs`` in its quick form, on the real disk, and its space handling."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier_async.bench import fs as bench_fs
from kvtier_async.bench import fs_kit
from kvtier_async.bench import fs_tmpfs as bench_fs_tmpfs


@pytest.fixture
def bench_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvtier-bench-test-", dir="/var/tmp"))
    monkeypatch.setenv("KVTIER_BENCH_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_quick_run_reports_every_case_and_leaves_nothing(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_fs, "BLOCK_SIZES", (256 << 10,))
    monkeypatch.setattr(bench_fs, "PLACES", ("disk",))
    monkeypatch.setattr(bench_fs, "QUICK_TOTAL_BYTES", 32 << 20)
    notes: list[str] = []
    records = bench_fs.run(quick=True, progress=notes.append)
    cases = [record.case for record in records]
    mode = cases[0].split()[-1]
    assert mode in ("O_DIRECT", "buffered")
    assert [case for case in cases if not case.endswith("vs vllm")] == [
        f"store 256KiB {mode}",
        f"load 256KiB {mode}",
    ]
    assert all(r.ours > 0 and r.reference is not None and r.reference > 0 for r in records)
    assert any("our files in the page cache" in note for note in notes)
    assert list(bench_dir.iterdir()) == []  # the work directory is gone


def test_truncate_all_frees_space_but_keeps_the_files(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    files = [tmp_path / "a" / "x.bin", tmp_path / "a" / "b" / "y.bin"]
    for path in files:
        path.write_bytes(os.urandom(8192))
    bench_fs._truncate_all(str(tmp_path))
    assert [path.stat().st_size for path in files] == [0, 0]


def test_journal_check_is_false_off_ext4() -> None:
    assert fs_kit.mount("/dev/shm")[1] == "tmpfs"
    assert not bench_fs._ext4_without_journal("/dev/shm")


def test_quick_tmpfs_cases_have_every_row_and_no_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_fs, "PLACES", ("tmpfs",))
    monkeypatch.setattr(bench_fs, "QUICK_TOTAL_BYTES", 16 << 20)
    before = set(os.listdir(bench_fs_tmpfs.TMPFS_BASE))
    notes: list[str] = []
    records = bench_fs.run(quick=True, progress=notes.append)
    vllm = fs_kit.VllmFs.load() is not None
    rows = (" vs vllm", " CPU vs vllm", " vs memcpy") if vllm else (" vs memcpy",)
    assert [r.case for r in records] == [
        f"{direction} {size} tmpfs{path}{row}"
        for size in ("256KiB", "2MiB")
        for direction in ("store", "load")
        for path in ("", " python path")
        for row in rows
    ]
    assert all(r.ours > 0 and r.reference and r.ratio and r.ratio > 0 for r in records)
    assert all(r.meets is None for r in records)  # a quick run judges nothing
    targets = {r.case: r.target for r in records if r.target is not None}
    assert set(targets) == ({f"{d} {s} tmpfs vs vllm" for d in ("store", "load")
                             for s in ("256KiB", "2MiB")} if vllm else set())  # fmt: skip
    assert all(t == bench_fs_tmpfs.TMPFS_TARGET for t in targets.values())
    assert {r.metric for r in records if "CPU" in r.case} <= {"core-s/GB"}
    assert sum("io=buffered(tmpfs)" in note for note in notes) == 4  # 2 sizes x 2 paths
    assert set(os.listdir(bench_fs_tmpfs.TMPFS_BASE)) <= before  # the tmpfs directory is gone
