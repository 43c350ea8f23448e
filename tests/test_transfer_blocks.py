"""The plan copiers and `BlockCopier` (the async API's data path) on host memory.

`chunked` splits a plan into pieces that cover it exactly; a chunked host copy stops at the
first piece boundary after its job was cancelled and raises only once the copy stopped;
`BlockCopier` copies whole blocks of every host kind into a real shared region's slots and
back, inline when small and in a worker thread otherwise.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from kvtier_async.memory import SharedRegion
from kvtier_async.transfer import CopyPlan, HostSlots
from kvtier_async.transfer.blocks import BlockCopier
from kvtier_async.transfer.copier import HostPlanCopier, chunked
from kvtier_async.transfer.hostcopy import batch_copier

BLOCK = 8192


def plan_of(src: np.ndarray, dst: np.ndarray, sizes: list[int]) -> CopyPlan:
    """Runs of ``sizes`` bytes, back to back in ``src`` and in ``dst`` (with a gap of one
    byte after each run, so runs do not join)."""
    offsets = np.cumsum([0, *[size + 1 for size in sizes[:-1]]])
    size = np.asarray(sizes, dtype=np.int64)
    return CopyPlan(src.ctypes.data + offsets, dst.ctypes.data + offsets, size)


@pytest.mark.parametrize(
    ("sizes", "chunk"),
    [([100], 1000), ([5000], 1000), ([300, 300, 300, 300], 500), ([10, 4096, 7, 999], 256)],
)
def test_chunks_cover_the_plan_exactly(sizes: list[int], chunk: int) -> None:
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, sum(sizes) + len(sizes), dtype=np.uint8)
    dst = np.zeros_like(src)
    plan = plan_of(src, dst, sizes)
    pieces = list(chunked(plan, chunk))
    assert sum(piece.total_bytes for piece in pieces) == plan.total_bytes
    assert all(piece.total_bytes <= 2 * chunk for piece in pieces)
    if plan.total_bytes > chunk:
        assert len(pieces) >= plan.total_bytes // chunk
    for piece in pieces:
        batch_copier()(piece)
    mask = np.zeros_like(src, dtype=bool)
    for offset, size in zip(plan.src - src.ctypes.data, plan.size):
        mask[offset : offset + size] = True
    assert np.array_equal(dst[mask], src[mask]) and not dst[~mask].any()


@pytest.mark.anyio
async def test_a_cancelled_chunked_copy_stops_at_the_next_boundary() -> None:
    chunk, pieces = 64 << 10, 8
    src = np.full(chunk * pieces, 7, np.uint8)
    dst = np.zeros_like(src)
    plan = CopyPlan(
        np.asarray([src.ctypes.data]), np.asarray([dst.ctypes.data]), np.asarray([src.nbytes])
    )
    copied: list[int] = []
    first, go = threading.Event(), threading.Event()

    def copy(piece: CopyPlan) -> None:
        copied.append(piece.total_bytes)
        first.set()
        go.wait()
        batch_copier()(piece)

    copier = HostPlanCopier(copy)
    returned = []
    with anyio.fail_after(10), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def job() -> None:
                await copier.transfer(plan, chunk_bytes=chunk)
                returned.append(True)

            tg.start_soon(job)
            await anyio.to_thread.run_sync(first.wait)
            scope.cancel()
            go.set()  # the piece under way finishes; the next boundary sees the cancellation
    assert scope.cancelled_caught and not returned
    assert copied == [chunk]
    assert np.count_nonzero(dst) == chunk  # exactly the first piece, nothing after return


@pytest.mark.anyio
async def test_an_uncancelled_chunked_copy_is_whole() -> None:
    src = np.random.default_rng(2).integers(0, 256, 5 * BLOCK + 3, dtype=np.uint8)
    dst = np.zeros_like(src)
    plan = CopyPlan(
        np.asarray([src.ctypes.data]), np.asarray([dst.ctypes.data]), np.asarray([src.nbytes])
    )
    result = await HostPlanCopier().transfer(plan, chunk_bytes=BLOCK)
    assert result.bytes == src.nbytes and np.array_equal(src, dst)


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SharedRegion]:
    with SharedRegion(f"t{uuid.uuid4().hex}", 8, BLOCK, directory=tmp_path) as r:
        yield r


@pytest.mark.anyio
@pytest.mark.parametrize("inline_bytes", [1 << 30, 0], ids=["inline", "thread"])
async def test_block_copies_round_trip(region: SharedRegion, inline_bytes: int) -> None:
    """Blocks to slots 5, 1, 6 and back into fresh blocks; other slots stay untouched; the
    copy runs in the calling thread when small enough, else in a worker thread."""
    copier = BlockCopier(HostSlots.from_region(region), BLOCK, inline_bytes=inline_bytes)
    threads: list[threading.Thread] = []
    batch = batch_copier()

    def copy(plan: CopyPlan) -> None:
        threads.append(threading.current_thread())
        batch(plan)

    copier.host = HostPlanCopier(copy)
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(3)]
    slots = [5, 1, 6]
    assert await copier.copy(slots, blocks, to_host=True) == 3 * BLOCK
    rows = region.numpy()
    for slot, block in zip(slots, blocks):
        assert np.array_equal(rows[slot, :BLOCK], block)
    assert not rows[[0, 2, 3, 4, 7]].any()
    back = [np.zeros(BLOCK, np.uint8) for _ in slots]
    assert await copier.copy(slots, back, to_host=False) == 3 * BLOCK
    assert all(np.array_equal(a, b) for a, b in zip(back, blocks))
    in_caller = [thread is threading.current_thread() for thread in threads]
    assert in_caller == [inline_bytes > 0] * 2
    del rows
    copier.close()


@pytest.mark.anyio
async def test_bad_slots_are_refused_before_any_copy(region: SharedRegion) -> None:
    copier = BlockCopier(HostSlots.from_region(region), BLOCK)
    block = np.ones(BLOCK, np.uint8)
    with pytest.raises(ValueError, match=r"slot ids must be in \[0, 8\)"):
        await copier.copy([8], [block], to_host=True)
    with pytest.raises(ValueError, match="1 slots for 2 blocks"):
        await copier.copy([0], [block, block], to_host=True)
    assert not region.numpy().any()
    copier.close()
    with pytest.raises(RuntimeError, match="closed"):
        await copier.copy([0], [block], to_host=True)


def test_blocks_larger_than_slots_are_refused(region: SharedRegion) -> None:
    with pytest.raises(ValueError, match="blocks of 8193 bytes do not fit 8192-byte slots"):
        BlockCopier(HostSlots.from_region(region), BLOCK + 1)
