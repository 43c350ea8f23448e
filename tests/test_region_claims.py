"""One live holder per role of a region (`kvtier_async.memory._claim`): two caches or engines
with one ``instance_id`` never share a region by accident; a restart after ``kill -9``
claims again; vLLM's tensor-parallel workers and the scheduler role share one."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier_async.api import TieredKVCache
from kvtier_async.ledger import make_offload_key
from kvtier_async.memory import RegionClaimedError, SharedRegion
from kvtier_async.memory._claim import claim_path

CTX = multiprocessing.get_context("spawn")
WAIT_S = 60.0  # fail-safe only
BLOCK = 4096


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvtier-claim-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def iid() -> str:
    return f"t{uuid.uuid4().hex}"


def cache_config(iid: str, directory: Path) -> dict[str, Any]:
    return {
        "block_bytes": BLOCK,
        "num_slots": 4,
        "instance_id": iid,
        "region_dir": str(directory),
    }


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.mark.anyio
async def test_a_second_cache_with_the_same_instance_id_is_refused(shm_dir: Path, iid: str) -> None:
    async with TieredKVCache(cache_config(iid, shm_dir)) as first:
        await first.store([k(1)], [np.full(BLOCK, 7, np.uint8)])
        with pytest.raises(RegionClaimedError, match=rf"{iid}.*r0 is held by pid {os.getpid()}"):
            async with TieredKVCache(cache_config(iid, shm_dir)):
                pass
        out = np.zeros(BLOCK, np.uint8)
        assert await first.load([k(1)], [out]) == 1 and (out == 7).all()  # untouched
    # released at close: the id is free again
    async with TieredKVCache(cache_config(iid, shm_dir)) as again:
        assert await again.lookup([k(1)]) == 0  # a new region, nobody else's bytes
    assert not claim_path(shm_dir / f"kvtier_{iid}.mmap", "r0").exists()


@pytest.mark.anyio
async def test_entering_an_open_cache_again_is_a_clear_error(shm_dir: Path, iid: str) -> None:
    cache = TieredKVCache(cache_config(iid, shm_dir))
    async with cache:
        with pytest.raises(RuntimeError, match="open already"):
            await cache.__aenter__()
        assert await cache.lookup([k(1)]) == 0  # still open, still working
    async with cache:  # once closed, it may be entered again
        pass


def test_tensor_parallel_workers_and_the_scheduler_share_a_region(shm_dir: Path, iid: str) -> None:
    def region(rank: int, role: str) -> SharedRegion:
        return SharedRegion(
            iid, 2, 64, num_workers=2, worker_rank=rank, directory=shm_dir, role=role
        )

    with region(0, "worker"), region(1, "worker"), region(0, "scheduler"):
        with pytest.raises(RegionClaimedError, match="r1 is held"):
            region(1, "worker")
        with pytest.raises(RegionClaimedError, match="scheduler is held"):
            region(0, "scheduler")
        # an unclaimed handle (a tool, a test) still maps it beside them
        with SharedRegion(iid, 2, 64, num_workers=2, worker_rank=1, directory=shm_dir):
            pass
    assert sorted(p.name for p in shm_dir.iterdir()) == []


def _hold(iid: str, directory: str, ready: Event, never: Event) -> None:
    region = SharedRegion(iid, 2, 64, directory=directory, role="worker")
    ready.set()
    never.wait(WAIT_S)  # killed here
    region.close()


def test_another_process_holding_the_id_is_named_and_a_kill_frees_it(
    shm_dir: Path, iid: str
) -> None:
    ready, never = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_hold, args=(iid, str(shm_dir), ready, never))
    proc.start()
    try:
        assert ready.wait(WAIT_S)
        with pytest.raises(RegionClaimedError, match=f"held by pid {proc.pid}"):
            SharedRegion(iid, 2, 64, directory=shm_dir, role="worker")
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(WAIT_S)
        # the kernel dropped the lock with the process: a restart claims again (the dead
        # creator's region is reclaimed or reaped)
        with SharedRegion(iid, 2, 64, directory=shm_dir, role="worker", wait_timeout_s=30):
            pass
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


@pytest.mark.parametrize("planted", ["symlink", "wide-mode"])
def test_a_claim_file_we_did_not_make_is_refused(shm_dir: Path, iid: str, planted: str) -> None:
    path = claim_path(shm_dir / f"kvtier_{iid}.mmap", "r0")
    if planted == "symlink":
        target = shm_dir / "elsewhere"
        target.write_text("x")
        path.symlink_to(target)
    else:
        path.write_text("")
        path.chmod(0o666)
    with pytest.raises(RegionClaimedError, match=r"link|private"):
        SharedRegion(iid, 2, 64, directory=shm_dir, role="worker")
    assert not (shm_dir / f"kvtier_{iid}.mmap").exists()  # nothing mapped, nothing made


def test_the_reaper_removes_the_claims_killed_holders_left(shm_dir: Path, iid: str) -> None:
    """A killed engine (vllm serve's SIGTERM kills its processes at once) leaves no claim
    file once the reaper removed its region."""
    ready, never = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_hold, args=(iid, str(shm_dir), ready, never))
    proc.start()
    try:
        assert ready.wait(WAIT_S)
        assert claim_path(shm_dir / f"kvtier_{iid}.mmap", "r0").exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(WAIT_S)
        left = list(shm_dir.iterdir())
        deadline = time.monotonic() + 120  # the reaper runs in a process of its own
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = list(shm_dir.iterdir())
        assert left == [], f"left after the reaper: {sorted(p.name for p in left)}"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
