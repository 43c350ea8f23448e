"""SharedRegion: layout, zero-copy views, the creation race and stale files, on real /dev/shm.

Multiprocess tests use the spawn context and coordinate with barriers, events and queues; their
timeouts only keep a broken test from hanging, they never order anything.
"""

from __future__ import annotations

import json
import logging
import mmap
import multiprocessing
import os
import shutil
import signal
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier_async.memory import (
    PAGE_SIZE,
    RegionClaimedError,
    RegionError,
    RegionInUseError,
    RegionLayoutError,
    SharedRegion,
    StaleRegionError,
    find_stale_regions,
    region_path,
    remove_stale_regions,
)
from kvtier_async.memory import _create as create_module
from kvtier_async.memory import region as region_module

SHM = Path("/dev/shm")
CTX = multiprocessing.get_context("spawn")
WAIT_S = 60.0  # fail-safe only

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory in /dev/shm, so stale scans see only this test's files."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def no_reaper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regions without their reaper (here and in the processes a test starts): a killed
    creator's file stays, the case that reclaim and the sweep handle."""
    monkeypatch.setenv("KVTIER_REGION_REAPER", "0")


@pytest.fixture
def iid() -> str:
    return f"t{uuid.uuid4().hex}"


def owner_path(path: Path) -> Path:
    return path.with_name(path.name + ".owner")


def join_all(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(WAIT_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert [p.exitcode for p in procs] == [0] * len(procs)


# -- single process ------------------------------------------------------------------------


def test_layout_sizes_and_alignment(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 3, 5000, num_workers=2, worker_rank=1, directory=shm_dir) as r:
        row = -(-5000 // PAGE_SIZE) * PAGE_SIZE
        assert (r.row_bytes, r.size_bytes) == (row, 3 * 2 * row)
        assert r.path == shm_dir / f"kvtier_{iid}.mmap" == region_path(shm_dir, iid)
        assert r.is_creator
        st = os.stat(r.path)
        assert st.st_size == r.size_bytes
        assert st.st_mode & 0o777 == 0o600
        assert owner_path(r.path).stat().st_mode & 0o777 == 0o600

        rows = r.rows
        assert (rows.format, rows.shape, rows.strides) == ("B", (6, row), (row, 1))
        base = np.asarray(rows).ctypes.data
        for b in range(3):
            assert r.slot_address(b) == base + (b * 2 + 1) * row
            assert r.slot_address(b) % PAGE_SIZE == 0
            assert len(r.slot_view(b)) == 5000
            assert len(r.slot_view(b, padded=True)) == row
        arr = r.numpy()
        assert (arr.shape, arr.strides, arr.dtype) == ((3, 5000), (2 * row, 1), np.uint8)
        assert arr.ctypes.data == r.slot_address(0)
        tensor = r.torch()
        assert (tuple(tensor.shape), tensor.stride()) == ((3, 5000), (2 * row, 1))
        assert tensor.data_ptr() == r.slot_address(0)
        del rows, arr, tensor


def test_views_alias_the_same_memory(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 4, 100, num_workers=2, worker_rank=1, directory=shm_dir) as r:
        arr, tensor, rows = r.numpy(), r.torch(), np.asarray(r.rows)
        # slot_view -> numpy, torch, rows
        r.slot_view(2)[:3] = b"abc"
        assert bytes(arr[2, :3]) == b"abc"
        assert tensor[2, :3].tolist() == list(b"abc")
        assert bytes(rows[2 * 2 + 1, :3]) == b"abc"
        # numpy -> slot_view
        arr[3, -1] = 99
        assert r.slot_view(3)[-1] == 99
        # torch -> numpy and slot_view
        tensor[0].fill_(7)
        assert (arr[0] == 7).all()
        assert bytes(r.slot_view(0)) == bytes([7]) * 100
        # the other worker's rows are untouched
        assert not rows[0::2].any()
        del arr, tensor, rows


def test_second_handle_in_same_process_joins(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 2, 10, num_workers=2, directory=shm_dir) as w0:
        with SharedRegion(iid, 2, 10, num_workers=2, worker_rank=1, directory=shm_dir) as w1:
            assert w0.is_creator and not w1.is_creator
            w1.slot_view(1)[:] = b"0123456789"
            assert bytes(np.asarray(w0.rows)[3, :10]) == b"0123456789"
        assert w0.path.exists()  # a peer's close does not unlink


def test_close_unlinks_and_is_idempotent(shm_dir: Path, iid: str) -> None:
    r = SharedRegion(iid, 1, 1, directory=shm_dir)
    assert r.path.exists() and owner_path(r.path).exists()
    r.close()
    assert r.closed
    assert list(shm_dir.iterdir()) == []
    r.close()
    with pytest.raises(ValueError, match="closed"):
        r.slot_view(0)
    with pytest.raises(ValueError, match="closed"):
        r.numpy()


def test_close_with_live_views_raises_then_succeeds(shm_dir: Path, iid: str) -> None:
    r = SharedRegion(iid, 2, 10, directory=shm_dir)
    arr = r.numpy()
    view = r.slot_view(1)[2:4]  # a slice of a view pins the mapping too
    with pytest.raises(RegionInUseError, match="still alive"):
        r.close()
    assert not r.path.exists()  # unlinked anyway
    assert isinstance(RegionInUseError("x"), BufferError)
    del arr
    with pytest.raises(RegionInUseError):
        r.close()
    del view
    r.close()
    r.close()


def test_default_directory_is_dev_shm(iid: str) -> None:
    with SharedRegion(iid, 1, 1) as r:
        assert r.path == SHM / f"kvtier_{iid}.mmap"
        assert r.path.exists()
    assert not r.path.exists()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"instance_id": "a/b"}, "instance_id"),
        ({"instance_id": ""}, "instance_id"),
        ({"instance_id": "x" * 201}, "instance_id"),
        ({"num_slots": 0}, "num_slots"),
        ({"num_slots": 1.5}, "num_slots"),
        ({"num_slots": True}, "num_slots"),
        ({"slot_bytes": 0}, "slot_bytes"),
        ({"num_workers": 0}, "num_workers"),
        ({"worker_rank": -1}, "worker_rank"),
        ({"worker_rank": 2, "num_workers": 2}, "worker_rank"),
        ({"directory": "/nonexistent/kvtier"}, "directory"),
        ({"wait_timeout_s": -1.0}, "wait_timeout_s"),
        ({"wait_timeout_s": float("nan")}, "wait_timeout_s"),
    ],
)
def test_bad_arguments_name_the_field(
    shm_dir: Path, iid: str, kwargs: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {
        "instance_id": iid,
        "num_slots": 2,
        "slot_bytes": 8,
        "directory": shm_dir,
        **kwargs,
    }
    with pytest.raises(ValueError, match=field):
        SharedRegion(**args)
    assert list(shm_dir.iterdir()) == []


def test_slot_index_out_of_range(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 2, 8, directory=shm_dir) as r:
        for bad in (-1, 2):
            with pytest.raises(IndexError, match="out of range"):
                r.slot_view(bad)
            with pytest.raises(IndexError):
                r.slot_address(bad)


def test_waiter_times_out_when_creator_never_sizes(shm_dir: Path, iid: str) -> None:
    path = region_path(shm_dir, iid)
    path.touch(mode=0o600)  # a "creator" that won the race and never sized the file
    expected = 4 * PAGE_SIZE
    with pytest.raises(TimeoutError) as info:
        SharedRegion(iid, 4, PAGE_SIZE, directory=shm_dir, wait_timeout_s=0.05)
    message = str(info.value)
    assert str(path) in message
    assert f"{expected} bytes" in message and "(it is 0 bytes)" in message
    assert path.exists()  # not ours to remove


def test_waiter_races_again_when_creator_unlinks(
    shm_dir: Path, iid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = region_path(shm_dir, iid)
    path.touch(mode=0o600)
    # the creator fails (and unlinks the file) while we poll: we create it ourselves
    monkeypatch.setattr(create_module, "_sleep", lambda _s: path.unlink(missing_ok=True))
    with SharedRegion(iid, 4, 8, directory=shm_dir, wait_timeout_s=WAIT_S) as region:
        assert region.is_creator and region.size_bytes == 4 * PAGE_SIZE
        assert path.stat().st_size == 4 * PAGE_SIZE


def test_a_file_of_another_size_with_no_owner_record_is_refused_at_the_deadline(
    shm_dir: Path, iid: str
) -> None:
    path = region_path(shm_dir, iid)
    path.write_bytes(bytes(3 * PAGE_SIZE))
    path.chmod(0o600)
    with pytest.raises(RegionLayoutError, match=f"is {3 * PAGE_SIZE} bytes"):
        SharedRegion(iid, 4, 8, directory=shm_dir, wait_timeout_s=0.05)
    assert path.exists()  # not ours to remove


def test_size_mismatch_names_both_sizes(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 4, 8, directory=shm_dir) as first:
        with pytest.raises(RegionLayoutError) as info:
            SharedRegion(iid, 8, 8, directory=shm_dir, wait_timeout_s=1.0)
        message = str(info.value)
        assert f"{first.size_bytes} bytes" in message and f"{8 * PAGE_SIZE} bytes" in message
        assert first.path.exists()


def test_same_size_other_layout_is_refused(shm_dir: Path, iid: str) -> None:
    with (
        SharedRegion(iid, 4, 8, num_workers=2, directory=shm_dir),
        pytest.raises(RegionLayoutError, match=r"\(4, 2, .*\(8, 1, "),
    ):
        SharedRegion(iid, 8, 8, directory=shm_dir)


def test_creator_failure_leaves_nothing_behind(shm_dir: Path, iid: str) -> None:
    with pytest.raises(OSError, match="available"):
        SharedRegion(iid, 1 << 20, 1 << 30, directory=shm_dir)  # 1 PiB
    assert list(shm_dir.iterdir()) == []


def test_prefault_fallback_keeps_existing_data(
    shm_dir: Path, iid: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with SharedRegion(iid, 3, 2 * PAGE_SIZE, num_workers=2, directory=shm_dir) as w0:
        w0.numpy()[:] = 0xAB
        # a kernel without MADV_POPULATE_WRITE answers EINVAL to an unknown advice
        monkeypatch.setattr(region_module, "_MADV_POPULATE_WRITE", 0x7FFF)
        with caplog.at_level(logging.WARNING, logger="kvtier_async.memory.region"):
            again = SharedRegion(iid, 3, 2 * PAGE_SIZE, num_workers=2, directory=shm_dir)
        with again:
            assert "MADV_POPULATE_WRITE unsupported" in caplog.text
            assert (again.numpy() == 0xAB).all()


def test_register_cuda_without_cuda_is_a_no_op(shm_dir: Path, iid: str) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with SharedRegion(iid, 1, 8, directory=shm_dir) as r:
        assert r.register_cuda() is False
        assert not r.is_cuda_registered


# -- stale detection, single process ------------------------------------------------------


def test_live_region_is_not_stale_but_reused_pid_is(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 1, 8, directory=shm_dir) as r:
        assert find_stale_regions(shm_dir) == []
        # same pid, different start time: the pid was reused by another process
        record = json.loads(owner_path(r.path).read_text())
        record["start_ticks"] += 1
        owner_path(r.path).write_text(json.dumps(record))
        assert find_stale_regions(shm_dir) == [r.path]
    assert list(shm_dir.iterdir()) == []


def test_region_without_owner_record_is_stale_after_grace(shm_dir: Path, iid: str) -> None:
    path = region_path(shm_dir, iid)
    path.touch(mode=0o600)  # its creator died before writing the record
    (shm_dir / "kvtier_not an id.mmap").touch()  # not a region name: ignored
    assert find_stale_regions(shm_dir) == []
    assert find_stale_regions(shm_dir, missing_owner_grace_s=0) == [path]
    assert remove_stale_regions(shm_dir, missing_owner_grace_s=0) == [path]
    assert not path.exists()


# -- multiprocess ---------------------------------------------------------------------------


def _race_worker(
    iid: str, directory: str, rank: int, start: Barrier, opened: Barrier, out: Any
) -> None:
    start.wait(WAIT_S)
    region = SharedRegion(iid, 8, 3000, num_workers=4, worker_rank=rank, directory=directory)
    out.put((rank, region.is_creator, os.stat(region.path).st_size, region.size_bytes))
    opened.wait(WAIT_S)  # nobody unlinks before everyone has mapped
    region.close()


def test_creation_race_has_exactly_one_creator(shm_dir: Path, iid: str) -> None:
    start, opened, out = CTX.Barrier(4), CTX.Barrier(4), CTX.Queue()
    procs = [
        CTX.Process(target=_race_worker, args=(iid, str(shm_dir), rank, start, opened, out))
        for rank in range(4)
    ]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=WAIT_S) for _ in procs)
    join_all(procs)
    assert [rank for rank, *_ in results] == [0, 1, 2, 3]
    assert sum(creator for _, creator, *_ in results) == 1
    assert {(seen, size) for *_, seen, size in results} == {(8 * 4 * PAGE_SIZE,) * 2}
    assert list(shm_dir.iterdir()) == []


def _layout_worker(iid: str, directory: str, rank: int, written: Barrier, checked: Barrier) -> None:
    with SharedRegion(iid, 5, 100, num_workers=4, worker_rank=rank, directory=directory) as r:
        arr = r.numpy()
        for b in range(5):
            arr[b] = rank * 16 + b
        del arr
        written.wait(WAIT_S)
        checked.wait(WAIT_S)


def test_rows_are_interleaved_by_worker(shm_dir: Path, iid: str) -> None:
    written, checked = CTX.Barrier(4), CTX.Barrier(4)
    procs = [
        CTX.Process(target=_layout_worker, args=(iid, str(shm_dir), rank, written, checked))
        for rank in (1, 2, 3)
    ]
    for proc in procs:
        proc.start()
    try:
        with SharedRegion(iid, 5, 100, num_workers=4, directory=shm_dir) as r:
            arr = r.numpy()
            for b in range(5):
                arr[b] = b
            del arr
            written.wait(WAIT_S)
            rows = np.asarray(r.rows)
            for b in range(5):
                for w in range(4):
                    row = rows[b * 4 + w]
                    assert (row[:100] == w * 16 + b).all(), (b, w)
                    assert not row[100:].any()  # padding untouched
            del rows, row  # every view must be gone before close
            checked.wait(WAIT_S)
    finally:
        join_all(procs)


def _peer_worker(iid: str, directory: str, wrote: Event, parent_wrote: Event, out: Any) -> None:
    with SharedRegion(iid, 2, 64, num_workers=2, worker_rank=1, directory=directory) as r:
        r.slot_view(1)[:5] = b"child"
        wrote.set()
        parent_wrote.wait(WAIT_S)
        out.put(bytes(np.asarray(r.rows)[2, :6]))  # parent's (worker 0) slot 1


def test_data_crosses_processes(shm_dir: Path, iid: str) -> None:
    wrote, parent_wrote, out = CTX.Event(), CTX.Event(), CTX.Queue()
    with SharedRegion(iid, 2, 64, num_workers=2, directory=shm_dir) as r:
        proc = CTX.Process(target=_peer_worker, args=(iid, str(shm_dir), wrote, parent_wrote, out))
        proc.start()
        try:
            assert wrote.wait(WAIT_S)
            assert bytes(np.asarray(r.rows)[3, :5]) == b"child"
            r.slot_view(1)[:6] = b"parent"
            parent_wrote.set()
            assert out.get(timeout=WAIT_S) == b"parent"
        finally:
            join_all([proc])


def _doomed_creator(iid: str, directory: str, ready: Event, never: Event) -> None:
    region = SharedRegion(iid, 2, 8, directory=directory)
    assert region.is_creator
    ready.set()
    never.wait()  # killed here, so it never closes


@pytest.mark.usefixtures("no_reaper")
def test_killed_creator_leaves_a_stale_region(shm_dir: Path, iid: str) -> None:
    ready, never = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_doomed_creator, args=(f"{iid}-dead", str(shm_dir), ready, never))
    proc.start()
    try:
        with SharedRegion(f"{iid}-live", 2, 8, directory=shm_dir) as live:
            assert ready.wait(WAIT_S)
            dead = region_path(shm_dir, f"{iid}-dead")
            assert find_stale_regions(shm_dir) == []  # both creators alive

            os.kill(proc.pid, signal.SIGKILL)
            # wait for the exit but leave a zombie: dead all the same
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            assert find_stale_regions(shm_dir) == [dead]
            proc.join()
            assert find_stale_regions(shm_dir) == [dead]

            assert remove_stale_regions(shm_dir) == [dead]
            assert not dead.exists() and not owner_path(dead).exists()
            assert live.path.exists() and owner_path(live.path).exists()
            assert find_stale_regions(shm_dir) == []
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    assert list(shm_dir.iterdir()) == []


def _kill_a_creator(iid: str, directory: Path) -> int:
    """Start a process that creates region ``iid`` (2 slots of 8 bytes), SIGKILL it, reap
    it; return the inode of the region file it leaves behind."""
    ready, never = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_doomed_creator, args=(iid, str(directory), ready, never))
    proc.start()
    try:
        assert ready.wait(WAIT_S)
    finally:
        proc.kill()
        proc.join(WAIT_S)
    path = region_path(directory, iid)
    assert json.loads(owner_path(path).read_text())["pid"] == proc.pid
    return path.stat().st_ino


@pytest.mark.usefixtures("no_reaper")
def test_restart_after_sigkill_reclaims_the_region(
    shm_dir: Path, iid: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead_inode = _kill_a_creator(iid, shm_dir)
    # same instance_id, another layout: the dead region is removed, a new one created
    with caplog.at_level(logging.WARNING, logger="kvtier_async.memory._reclaim"):
        region = SharedRegion(iid, 4, 8, directory=shm_dir, wait_timeout_s=WAIT_S)
    with region:
        assert region.is_creator and region.num_slots == 4
        assert region.path.stat().st_ino != dead_inode
        assert json.loads(owner_path(region.path).read_text())["pid"] == os.getpid()
        assert "reclaimed the shared region of a dead process" in caplog.text
    assert list(shm_dir.iterdir()) == []


@pytest.mark.usefixtures("no_reaper")
def test_every_worker_restarting_at_once_reclaims_once(shm_dir: Path, iid: str) -> None:
    _kill_a_creator(iid, shm_dir)
    start, opened, out = CTX.Barrier(4), CTX.Barrier(4), CTX.Queue()
    procs = [
        CTX.Process(target=_race_worker, args=(iid, str(shm_dir), rank, start, opened, out))
        for rank in range(4)
    ]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=WAIT_S) for _ in procs)
    join_all(procs)
    assert sum(creator for _, creator, *_ in results) == 1
    assert {(seen, size) for *_, seen, size in results} == {(8 * 4 * PAGE_SIZE,) * 2}
    assert list(shm_dir.iterdir()) == []


@pytest.mark.usefixtures("no_reaper")
def test_a_joiner_races_again_when_another_reclaims_the_dead_region_under_it(
    shm_dir: Path, iid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in CI (above, four workers at once): a joiner opened a dead creator's region
    and another joiner reclaimed it before the first read its owner record."""
    dead_inode = _kill_a_creator(iid, shm_dir)
    path, real_owner = region_path(shm_dir, iid), create_module._owner
    reclaimed: list[int] = []

    def owner_after_a_reclaim(region: Path, inode: int) -> Any:
        if inode == dead_inode and not reclaimed:  # the other joiner's reclaim, all of it
            reclaimed.append(inode)
            owner_path(path).unlink()
            path.unlink()
        return real_owner(region, inode)

    monkeypatch.setattr(create_module, "_owner", owner_after_a_reclaim)
    with SharedRegion(iid, 4, 8, directory=shm_dir, wait_timeout_s=WAIT_S) as region:
        assert region.is_creator and region.num_slots == 4
    assert reclaimed == [dead_inode]
    assert list(shm_dir.iterdir()) == []


@pytest.mark.usefixtures("no_reaper")
def test_a_joiner_waits_out_a_reclaim_between_its_two_unlinks(
    shm_dir: Path, iid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reclaimer removes the owner record, then the file: a joiner that looks in between
    sees a file of another size with no record, and waits for it to go, not refusing it as
    another configuration's."""
    dead_inode = _kill_a_creator(iid, shm_dir)
    path, real_owner = region_path(shm_dir, iid), create_module._owner
    steps: list[str] = []

    def owner_mid_reclaim(region: Path, inode: int) -> Any:
        if inode == dead_inode and not steps:
            steps.append("record")
            owner_path(path).unlink()
        return real_owner(region, inode)

    def sleep_while_the_file_goes(_seconds: float) -> None:
        if steps == ["record"]:
            steps.append("file")
            path.unlink()

    monkeypatch.setattr(create_module, "_owner", owner_mid_reclaim)
    monkeypatch.setattr(create_module, "_sleep", sleep_while_the_file_goes)
    with SharedRegion(iid, 4, 8, directory=shm_dir, wait_timeout_s=WAIT_S) as region:
        assert region.is_creator and region.num_slots == 4
    assert steps == ["record", "file"]
    assert list(shm_dir.iterdir()) == []


@pytest.mark.usefixtures("no_reaper")
def test_a_new_region_sweeps_dead_regions_of_other_ids(shm_dir: Path, iid: str) -> None:
    """A fresh id at each start: the dead regions of earlier starts do not pile up."""
    _kill_a_creator(f"{iid}-earlier", shm_dir)
    with SharedRegion(f"{iid}-next", 1, 8, directory=shm_dir) as region:
        assert sorted(shm_dir.iterdir()) == [region.path, owner_path(region.path)]
    assert list(shm_dir.iterdir()) == []


def _cache_owner(config: dict[str, Any], ready: Event, never: Event) -> None:
    """Open a TieredKVCache (the async face) and hold it until killed."""
    import anyio

    from kvtier_async.api import TieredKVCache

    async def main() -> None:
        async with TieredKVCache(config):
            ready.set()
            await anyio.to_thread.run_sync(never.wait)

    anyio.run(main)


@pytest.mark.usefixtures("no_reaper")
def test_the_async_face_restarts_after_sigkill(shm_dir: Path, iid: str) -> None:
    import anyio

    from kvtier_async.api import TieredKVCache

    config = {"block_bytes": 4096, "num_slots": 2, "instance_id": iid, "region_dir": str(shm_dir)}
    ready, never = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_cache_owner, args=(config, ready, never))
    proc.start()
    try:
        assert ready.wait(WAIT_S)
    finally:
        proc.kill()
        proc.join(WAIT_S)
    dead_inode = region_path(shm_dir, iid).stat().st_ino

    async def restart() -> int:
        async with TieredKVCache(config):
            return region_path(shm_dir, iid).stat().st_ino

    assert anyio.run(restart) != dead_inode
    assert list(shm_dir.iterdir()) == []


def _gone_within(path: Path, timeout_s: float) -> bool:
    """Whether ``path`` disappears within ``timeout_s`` (the reaper works on its own)."""
    deadline = time.monotonic() + timeout_s
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # a poll of another process's work, not a timed race
    return True


def test_a_killed_creators_region_is_removed_by_its_reaper(shm_dir: Path, iid: str) -> None:
    ready, never = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_doomed_creator, args=(iid, str(shm_dir), ready, never))
    proc.start()
    try:
        assert ready.wait(WAIT_S)
        path = region_path(shm_dir, iid)
        assert path.exists() and owner_path(path).exists()
    finally:
        proc.kill()
        proc.join(WAIT_S)
    assert _gone_within(path, WAIT_S)
    assert list(shm_dir.iterdir()) == []  # the owner record went first


def test_the_reaper_waits_for_the_last_mapper(shm_dir: Path, iid: str) -> None:
    ready, never = CTX.Event(), CTX.Event()
    creator = CTX.Process(target=_doomed_creator, args=(iid, str(shm_dir), ready, never))
    creator.start()
    joined, release = CTX.Event(), CTX.Event()
    mapper = CTX.Process(target=_mapper, args=(iid, str(shm_dir), joined, release))
    path = region_path(shm_dir, iid)
    try:
        assert ready.wait(WAIT_S)
        mapper.start()
        assert joined.wait(WAIT_S)
        creator.kill()
        creator.join(WAIT_S)
        # The creator is dead, the mapper still uses the region: it stays. The reaper
        # blocks in flock until then, so a moment's wait would show a removal.
        assert not _gone_within(path, 0.5)
        release.set()
        mapper.join(WAIT_S)
        assert _gone_within(path, WAIT_S)
    finally:
        for proc in (creator, mapper):
            if proc.is_alive():
                proc.kill()
            proc.join(WAIT_S)
    assert list(shm_dir.iterdir()) == []


def test_the_reaper_leaves_a_region_that_replaced_its_own(shm_dir: Path, iid: str) -> None:
    """Closed and created again at the same path: the first region's reaper does not
    touch the second file."""
    with SharedRegion(iid, 2, 8, directory=shm_dir) as first:
        first_inode = first.path.stat().st_ino
    with SharedRegion(iid, 2, 8, directory=shm_dir) as second:
        assert second.path.stat().st_ino != first_inode or second.is_creator
        assert not _gone_within(second.path, 0.5)


def _mapper(iid: str, directory: str, joined: Event, release: Event) -> None:
    with SharedRegion(iid, 2, 8, directory=directory) as region:
        assert not region.is_creator
        joined.set()
        release.wait(WAIT_S)


def test_a_live_mapper_blocks_the_reclaim(shm_dir: Path, iid: str) -> None:
    ready, never = CTX.Event(), CTX.Event()
    creator = CTX.Process(target=_doomed_creator, args=(iid, str(shm_dir), ready, never))
    creator.start()
    joined, release = CTX.Event(), CTX.Event()
    mapper = CTX.Process(target=_mapper, args=(iid, str(shm_dir), joined, release))
    try:
        assert ready.wait(WAIT_S)
        mapper.start()
        assert joined.wait(WAIT_S)
        creator.kill()
        creator.join(WAIT_S)
        path = region_path(shm_dir, iid)
        inode = path.stat().st_ino
        # the creator is dead, but the mapper still uses the region: hands off
        with pytest.raises(StaleRegionError, match="another live process still maps it"):
            SharedRegion(iid, 2, 8, directory=shm_dir, wait_timeout_s=WAIT_S)
        assert find_stale_regions(shm_dir) == [path]
        assert remove_stale_regions(shm_dir) == []
        assert path.stat().st_ino == inode and owner_path(path).exists()
        release.set()
        join_all([mapper])
        # the mapper is gone: now the region is reclaimed
        with SharedRegion(iid, 2, 8, directory=shm_dir, wait_timeout_s=WAIT_S) as region:
            assert region.is_creator and region.path.stat().st_ino != inode
    finally:
        release.set()
        for proc in (creator, mapper):
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join()
    assert list(shm_dir.iterdir()) == []


# -- one owner per place (issue 23, item 2) ---------------------------------------------------


def test_a_place_is_claimed_once_in_a_process(shm_dir: Path, iid: str) -> None:
    first = SharedRegion(iid, 2, 8, directory=shm_dir, role="worker")
    try:
        with pytest.raises(RegionClaimedError) as caught:
            SharedRegion(iid, 2, 8, directory=shm_dir, role="worker")
        message = str(caught.value)
        assert iid in message and f"process {os.getpid()}" in message
        assert "worker rank 0" in message
        first.slot_view(1)[:4] = b"mine"  # the refused handle touched nothing
        assert bytes(first.slot_view(1)[:4]) == b"mine"
    finally:
        first.close()
    with SharedRegion(iid, 2, 8, directory=shm_dir, role="worker") as again:
        assert again.is_creator  # the place is free once its holder closed
    assert list(shm_dir.iterdir()) == []


def test_the_places_of_one_engine_coexist(shm_dir: Path, iid: str) -> None:
    kwargs: dict[str, Any] = {"num_workers": 2, "directory": shm_dir, "token": "engine-a"}
    scheduler = SharedRegion(iid, 2, 8, role="scheduler", **kwargs)
    workers = [SharedRegion(iid, 2, 8, worker_rank=r, role="worker", **kwargs) for r in (0, 1)]
    try:
        with pytest.raises(RegionClaimedError, match="the scheduler's place"):
            SharedRegion(iid, 2, 8, role="scheduler", **kwargs)
        with pytest.raises(RegionClaimedError, match="worker rank 1"):
            SharedRegion(iid, 2, 8, worker_rank=1, role="worker", **kwargs)
        unclaimed = SharedRegion(iid, 2, 8, worker_rank=1, **kwargs)  # no role: no claim
        unclaimed.close()
    finally:
        for region in (*workers, scheduler):
            region.close()
    assert list(shm_dir.iterdir()) == []


def test_another_engines_token_is_refused(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 2, 8, num_workers=2, directory=shm_dir, role="scheduler", token="a"):
        with pytest.raises(RegionClaimedError) as caught:
            SharedRegion(
                iid, 2, 8, num_workers=2, worker_rank=1, directory=shm_dir, role="worker", token="b"
            )
        message = str(caught.value)
        assert iid in message and f"process {os.getpid()}" in message
        assert "in use by another cache or engine" in message
        with SharedRegion(
            iid, 2, 8, num_workers=2, worker_rank=1, directory=shm_dir, role="worker", token="a"
        ) as joined:
            assert not joined.is_creator


@pytest.mark.parametrize("bad", [{"role": "owner"}, {"token": ""}, {"token": 7}])
def test_bad_role_or_token_is_named(shm_dir: Path, iid: str, bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SharedRegion(iid, 2, 8, directory=shm_dir, **bad)
    assert list(shm_dir.iterdir()) == []


def _claimer(iid: str, directory: str, joined: Event, never: Event) -> None:
    with SharedRegion(iid, 2, 8, directory=directory, role="worker") as region:
        assert not region.is_creator
        joined.set()
        never.wait(WAIT_S)  # until killed (a killed waiter would hang a later set())


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_a_dead_holders_place_is_free_and_leaves_no_file(shm_dir: Path, iid: str, how: str) -> None:
    """A claim is a lock, not a file: a holder killed by SIGKILL or SIGTERM leaves nothing
    behind, and its place can be taken again at once."""
    creator = SharedRegion(iid, 2, 8, directory=shm_dir, role="scheduler")
    joined, never = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_claimer, args=(iid, str(shm_dir), joined, never))
    proc.start()
    try:
        assert joined.wait(WAIT_S)
        with pytest.raises(RegionClaimedError, match=f"process {os.getpid()}"):
            SharedRegion(iid, 2, 8, directory=shm_dir, role="worker")  # the child holds it
        os.kill(proc.pid or 0, signal.SIGKILL if how == "sigkill" else signal.SIGTERM)
        proc.join(WAIT_S)
        assert proc.exitcode is not None and proc.exitcode < 0
        assert sorted(p.name for p in shm_dir.iterdir()) == sorted(
            [creator.path.name, owner_path(creator.path).name]
        )
        with SharedRegion(iid, 2, 8, directory=shm_dir, role="worker") as taken:
            assert not taken.is_creator
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        creator.close()
    assert list(shm_dir.iterdir()) == []


def test_remove_stale_regions_leaves_a_mapped_region(shm_dir: Path, iid: str) -> None:
    with SharedRegion(iid, 1, 8, directory=shm_dir) as r:
        # the creator record names a process that is gone (same pid, other start time)
        record = json.loads(owner_path(r.path).read_text())
        record["start_ticks"] += 1
        owner_path(r.path).write_text(json.dumps(record))
        assert find_stale_regions(shm_dir) == [r.path]
        assert remove_stale_regions(shm_dir) == []  # but this handle maps it
        assert r.path.exists()


# -- privacy -----------------------------------------------------------------------------


def test_files_are_private_whatever_the_umask(shm_dir: Path, iid: str) -> None:
    old = os.umask(0)
    try:
        with SharedRegion(iid, 1, 8, directory=shm_dir) as r:
            for path in (r.path, owner_path(r.path)):
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        os.umask(old)


def test_a_symlink_at_the_region_path_is_refused(shm_dir: Path, iid: str) -> None:
    victim = shm_dir / "victim"
    victim.write_bytes(b"precious")
    path = region_path(shm_dir, iid)
    path.symlink_to(victim)
    with pytest.raises(RegionError, match="symbolic link"):
        SharedRegion(iid, 1, 8, directory=shm_dir, wait_timeout_s=1.0)
    assert victim.read_bytes() == b"precious" and path.is_symlink()


@pytest.mark.parametrize("problem", ["mode", "owner", "directory"])
def test_joining_refuses_a_file_that_is_not_private(shm_dir: Path, iid: str, problem: str) -> None:
    path = region_path(shm_dir, iid)
    if problem == "directory":
        path.mkdir()
        expected = "not a regular file"
    else:
        path.write_bytes(bytes(PAGE_SIZE))
        path.chmod(0o600)
        if problem == "mode":
            path.chmod(0o644)
            expected = "mode is 0644"
        else:
            if os.geteuid() != 0:
                pytest.skip("needs root to give a file away")
            os.chown(path, 65534, 65534)
            expected = "owned by uid 65534"
    with pytest.raises(RegionError, match=expected):
        SharedRegion(iid, 1, 8, directory=shm_dir, wait_timeout_s=1.0)
    assert path.exists()  # not ours to remove


def test_a_left_over_owner_record_symlink_is_replaced_not_followed(shm_dir: Path, iid: str) -> None:
    victim = shm_dir / "victim"
    victim.write_bytes(b"precious")
    record = owner_path(region_path(shm_dir, iid))
    record.symlink_to(victim)
    with SharedRegion(iid, 1, 8, directory=shm_dir) as r:
        assert not record.is_symlink()
        assert json.loads(record.read_text())["inode"] == r.path.stat().st_ino
        assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert victim.read_bytes() == b"precious"


def test_an_owner_record_of_another_user_is_ignored(shm_dir: Path, iid: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    with SharedRegion(iid, 1, 8, directory=shm_dir) as r:
        record = json.loads(owner_path(r.path).read_text())
        record["start_ticks"] += 1  # "dead": stale if it were believed
        owner_path(r.path).write_text(json.dumps(record))
        assert find_stale_regions(shm_dir) == [r.path]
        os.chown(owner_path(r.path), 65534, 65534)
        assert find_stale_regions(shm_dir) == []  # no record of ours: not judged dead


def test_page_size_matches_mmap() -> None:
    assert PAGE_SIZE == mmap.PAGESIZE


def test_the_file_system_of_a_path_is_named_for_the_pin_warning(tmp_path: Path) -> None:
    """A refused pin's warning names the file system (tmpfs pins; disk file systems may not)."""
    from kvtier_async._mounts import mount

    mounts = Path("/proc/self/mounts").read_text().split("\n")
    shm = [line.split()[2] for line in mounts if line.split()[1:2] == ["/dev/shm"]]
    if shm:
        assert mount(Path("/dev/shm/kvtier-x"))[1] == shm[-1]
    root = [line.split()[2] for line in mounts if line.split()[1:2] == ["/"]]
    assert mount(Path("/"))[1] == root[-1]
    assert mount(tmp_path)[1] != "unknown"
