"""Handlers with CPU tensors as the device cache and a real shared region as the CPU tier.

Round trips store GPU blocks into slots, check the slot bytes against the slot layout,
wipe the blocks, load them back into other blocks and compare byte for byte; bytes a
transfer must not touch (skipped pages of an unaligned first slot, other groups'
sections) keep a sentinel.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from kvtier_async.ledger import CPUSpec, GPUSpec, Medium
from kvtier_async.memory import SharedRegion
from kvtier_async.transfer import (
    CanonicalKV,
    CopyPlan,
    HostCopyHandler,
    HostSlots,
    TransferResult,
    TransferRouter,
    canonicalize,
)
from kvtier_async.transfer.hostcopy import batch_copier, memmove_copier, native_copier

NUM_BLOCKS = 24
NUM_SLOTS = 16
SENTINEL = 0xAB


def make_kv(rng: np.random.Generator) -> tuple[CanonicalKV, dict[str, torch.Tensor]]:
    """Two groups: FlashAttention-style layers (LBNHC) and an MLA layer, random bytes."""
    caches = {
        "attn.0": torch.zeros(NUM_BLOCKS, 16, 2, 32, dtype=torch.bfloat16),  # [B, N, H, C]
        "attn.1": torch.zeros(NUM_BLOCKS, 16, 2, 32, dtype=torch.bfloat16),
        "mla.0": torch.zeros(NUM_BLOCKS, 16, 72, dtype=torch.float16),  # [B, N, latent]
    }
    views = {
        # register_kv_caches gets [B, H, N, C] views; LBNHC keeps N outside H
        "attn.0": caches["attn.0"].permute(0, 2, 1, 3),
        "attn.1": caches["attn.1"].permute(0, 2, 1, 3),
        "mla.0": caches["mla.0"],
    }
    for tensor in caches.values():
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.shape, dtype=np.uint8)))
    kv = canonicalize(views, groups=[["attn.0", "attn.1"], ["mla.0"]], num_blocks=NUM_BLOCKS)
    return kv, caches


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SharedRegion]:
    # slot bytes for factor 3: 3 * (2 attention pages + 1 MLA page)
    slot_bytes = 3 * (2 * 16 * 2 * 32 * 2 + 16 * 72 * 2)
    with SharedRegion(f"t{uuid.uuid4().hex}", NUM_SLOTS, slot_bytes, directory=tmp_path) as shared:
        shared.numpy()[:] = SENTINEL
        yield shared


def page_bytes(kv: CanonicalKV, view: int, block: int) -> bytes:
    return kv.views[view].page(block).numpy().tobytes()


def expected_placements(
    kv: CanonicalKV, factor: int, gpu: GPUSpec, cpu: CPUSpec
) -> list[tuple[int, int, int, int]]:
    """(view, gpu block, slot, page position) for every page the transfer moves."""
    out = []
    block_pos = slot_pos = 0
    for group, (count, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
        skip = first % factor
        for i in range(count):
            block = int(gpu.block_ids[block_pos + i])
            slot = int(cpu.slot_ids[slot_pos + (skip + i) // factor])
            for view in kv.groups[group]:
                out.append((view, block, slot, (skip + i) % factor))
        block_pos += count
        slot_pos += -(-(skip + count) // factor) if count else 0
    return out


def check_slots(
    kv: CanonicalKV,
    region: SharedRegion,
    factor: int,
    gpu: GPUSpec,
    cpu: CPUSpec,
) -> None:
    """Moved pages hold the GPU pages; every other byte of the region is the sentinel."""
    layout = kv.slot_layout(factor)
    slots = region.numpy()
    touched = np.zeros(slots.shape, dtype=bool)
    for view, block, slot, position in expected_placements(kv, factor, gpu, cpu):
        start = layout.page_offset(view, position)
        end = start + kv.views[view].page_size
        assert slots[slot, start:end].tobytes() == page_bytes(kv, view, block), (view, block)
        touched[slot, start:end] = True
    assert bool((slots[~touched] == SENTINEL).all())


CASES = [
    # factor, group sizes, block indices
    pytest.param(1, (3, 2), (0, 0), id="factor1"),
    pytest.param(2, (4, 3), (0, 0), id="factor2"),
    pytest.param(3, (5, 4), (0, 0), id="factor3"),
    pytest.param(2, (3, 2), (1, 3), id="factor2-unaligned"),
    pytest.param(3, (4, 5), (2, 1), id="factor3-unaligned"),
    pytest.param(3, (0, 4), (0, 4), id="factor3-empty-group"),
]


def make_specs(
    rng: np.random.Generator, factor: int, sizes: tuple[int, ...], firsts: tuple[int, ...]
) -> tuple[GPUSpec, CPUSpec, GPUSpec]:
    """A store's GPU spec and CPU spec, and a load's GPU spec onto other blocks."""
    total = sum(sizes)
    blocks = rng.permutation(NUM_BLOCKS)
    gpu = GPUSpec.of(blocks[:total], sizes, firsts)
    other = GPUSpec.of(blocks[total : 2 * total], sizes, firsts)
    needed = sum(-(-(f % factor + n) // factor) for n, f in zip(sizes, firsts, strict=True) if n)
    cpu = CPUSpec.of(rng.permutation(NUM_SLOTS)[:needed])
    return gpu, cpu, other


def check_round_trip(kv: CanonicalKV, factor: int, gpu: GPUSpec, other: GPUSpec) -> None:
    for group, _ in enumerate(gpu.group_sizes):
        start = sum(gpu.group_sizes[:group])
        for i in range(gpu.group_sizes[group]):
            for view in kv.groups[group]:
                src = int(gpu.block_ids[start + i])
                dst = int(other.block_ids[start + i])
                assert page_bytes(kv, view, dst) == page_bytes(kv, view, src), (view, src, dst)


@pytest.mark.parametrize(("factor", "sizes", "firsts"), CASES)
def test_round_trip_sync(
    region: SharedRegion, factor: int, sizes: tuple[int, ...], firsts: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(factor * 100 + sum(sizes))
    kv, _ = make_kv(rng)
    gpu, cpu, other = make_specs(rng, factor, sizes, firsts)
    router = TransferRouter.create(kv, region, block_size_factor=factor)
    try:
        # store: GPU blocks -> slots
        stored = router.execute(gpu, cpu)
        check_slots(kv, region, factor, gpu, cpu)
        expected_bytes = sum(
            kv.views[v].page_size for v, *_ in expected_placements(kv, factor, gpu, cpu)
        )
        assert stored.bytes == expected_bytes
        # wipe the destination blocks, then load: slots -> other GPU blocks
        for view in kv.views:
            view.tensor[torch.from_numpy(other.block_ids)] = 0
        loaded = router.execute(cpu, other)
        assert loaded.bytes == expected_bytes
        check_round_trip(kv, factor, gpu, other)
    finally:
        router.close()


@pytest.mark.anyio
@pytest.mark.parametrize(("factor", "sizes", "firsts"), CASES[:5])
async def test_round_trip_async(
    region: SharedRegion, factor: int, sizes: tuple[int, ...], firsts: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(factor * 7 + sum(firsts))
    kv, _ = make_kv(rng)
    gpu, cpu, other = make_specs(rng, factor, sizes, firsts)
    router = TransferRouter.create(kv, region, block_size_factor=factor)
    try:
        result = await router.transfer(gpu, cpu)
        assert isinstance(result, TransferResult)
        assert result.seconds >= 0
        check_slots(kv, region, factor, gpu, cpu)
        await router.transfer(cpu, other)
        check_round_trip(kv, factor, gpu, other)
    finally:
        router.close()


def test_router_routes_by_medium(region: SharedRegion) -> None:
    kv, _ = make_kv(np.random.default_rng(0))
    router = TransferRouter.create(kv, region)
    try:
        handlers = router.handlers
        assert set(handlers) == {(Medium.GPU, Medium.CPU), (Medium.CPU, Medium.GPU)}
        assert all(isinstance(h, HostCopyHandler) for h in handlers.values())
        gpu, cpu = GPUSpec.of([1], [1, 0]), CPUSpec.of([0])
        assert router.handler_for(gpu, cpu) is handlers[(Medium.GPU, Medium.CPU)]
        assert router.handler_for(cpu, gpu) is handlers[(Medium.CPU, Medium.GPU)]
        with pytest.raises(ValueError, match="no handler for CPU -> CPU"):
            router.handler_for(cpu, cpu)
    finally:
        router.close()


def test_closing_the_router_lets_the_region_close(tmp_path: Path) -> None:
    kv, _ = make_kv(np.random.default_rng(0))
    shared = SharedRegion(
        f"t{uuid.uuid4().hex}", 4, kv.slot_layout(1).slot_bytes, directory=tmp_path
    )
    router = TransferRouter.create(kv, shared)
    router.close()
    shared.close()
    assert shared.closed


@pytest.mark.parametrize(
    ("gpu", "cpu", "message"),
    [
        (GPUSpec.of([NUM_BLOCKS], [1, 0]), CPUSpec.of([0]), "GPU block id .* out of range"),
        (GPUSpec.of([0], [1, 0]), CPUSpec.of([NUM_SLOTS]), "CPU slot id 16 out of range"),
        (GPUSpec.of([0, 1], [2, 0]), CPUSpec.of([0]), "specs do not match"),
        (GPUSpec.of([0]), CPUSpec.of([0]), "the GPU spec has 1 groups"),
    ],
)
def test_bad_specs_are_rejected_before_copying(
    region: SharedRegion, gpu: GPUSpec, cpu: CPUSpec, message: str
) -> None:
    kv, _ = make_kv(np.random.default_rng(0))
    router = TransferRouter.create(kv, region)
    try:
        with pytest.raises(ValueError, match=message):
            router.execute(gpu, cpu)
        assert bool((region.numpy() == SENTINEL).all())
    finally:
        router.close()


def test_wrong_spec_types(region: SharedRegion) -> None:
    kv, _ = make_kv(np.random.default_rng(0))
    handler = HostCopyHandler(kv, HostSlots.from_region(region), to_host=True)
    with pytest.raises(ValueError, match="moves GPU -> CPU, got CPUSpec -> GPUSpec"):
        handler.execute(CPUSpec.of([0]), GPUSpec.of([0], [1, 0]))
    handler.close()


def test_contiguous_blocks_merge_into_one_copy() -> None:
    """One view, pages back to back on both sides: a batch is one copy per slot run."""
    cache = torch.zeros(32, 4096, dtype=torch.uint8)
    kv = canonicalize({"x": cache})
    slots = torch.zeros(8, 2 * 4096, dtype=torch.uint8)
    handler = HostCopyHandler(kv, HostSlots.from_tensor(slots), block_size_factor=2, to_host=True)
    plan = handler.plan(GPUSpec.of(range(10, 18)), CPUSpec.of([2, 3, 4, 5]))
    assert len(plan) == 1
    assert plan.total_bytes == 8 * 4096
    scattered = handler.plan(GPUSpec.of([3, 4, 9, 10]), CPUSpec.of([5, 1]))
    assert len(scattered) == 2  # blocks 3,4 -> slot 5 and 9,10 -> slot 1


@pytest.mark.parametrize("copier", [memmove_copier, batch_copier()], ids=["memmove", "default"])
def test_copiers_are_byte_exact(copier: object) -> None:
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    sizes = np.array([1, 7, 8, 100, 4096, 3, 0, 999], dtype=np.int64)
    src_off = np.array([0, 10, 30, 50, 200, 5000, 6000, 7000], dtype=np.int64)
    dst_off = np.array([60000, 10, 40000, 90, 8000, 5001, 0, 20000], dtype=np.int64)
    plan = CopyPlan(src.ctypes.data + src_off, dst.ctypes.data + dst_off, sizes)
    copier(plan)  # type: ignore[operator]
    expected = np.zeros_like(src)
    for s, d, n in zip(src_off, dst_off, sizes, strict=True):
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("copier", [memmove_copier, batch_copier()], ids=["memmove", "default"])
def test_copiers_with_continuing_runs(copier: object) -> None:
    """Runs that continue each other (the native copy joins them) and one that does not."""
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    s0, d0 = src.ctypes.data, dst.ctypes.data
    plan = CopyPlan(
        np.array([s0, s0 + 100, s0 + 250, s0 + 1000], dtype=np.int64),
        np.array([d0 + 8, d0 + 108, d0 + 258, d0 + 2000], dtype=np.int64),
        np.array([100, 150, 50, 24], dtype=np.int64),
    )
    assert len(plan.merged()) == 2
    copier(plan)  # type: ignore[operator]
    expected = np.zeros_like(src)
    expected[8:308] = src[0:300]
    expected[2000:2024] = src[1000:1024]
    assert np.array_equal(dst, expected)


def test_native_copier_is_available_here() -> None:
    """This machine has a C compiler; the fast path must not silently fall back."""
    if native_copier() is None:
        pytest.skip("no C compiler / KVTIER_NATIVE_COPY=0: the memmove fallback is in use")
    assert batch_copier() is native_copier()


# -- cancellation ------------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelled_job_returns_only_after_the_copy_finished(region: SharedRegion) -> None:
    kv, _ = make_kv(np.random.default_rng(3))
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow_copy(plan: CopyPlan) -> None:
        started.set()
        release.wait()  # the test decides when the copy may proceed
        memmove_copier(plan)
        finished.set()

    handler = HostCopyHandler(
        kv, HostSlots.from_region(region), to_host=True, copier=slow_copy, inline_bytes=0
    )
    gpu, cpu = GPUSpec.of([5, 6], [2, 0]), CPUSpec.of([1, 2])
    returned_after_copy: list[bool] = []

    async def job(scope: anyio.CancelScope) -> None:
        with scope:
            await handler.transfer(gpu, cpu)
        returned_after_copy.append(finished.is_set())

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(job, scope)
        await anyio.to_thread.run_sync(started.wait)
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert returned_after_copy == []  # still waiting for the thread
        release.set()
    assert returned_after_copy == [True]
    assert scope.cancelled_caught
    check_slots(kv, region, 1, gpu, cpu)  # the copy completed, whole
    handler.close()


@pytest.mark.anyio
async def test_a_small_copy_runs_in_the_loop_a_large_one_in_a_worker_thread(
    region: SharedRegion,
) -> None:
    kv, _ = make_kv(np.random.default_rng(4))
    threads: list[int] = []

    def recording_copy(plan: CopyPlan) -> None:
        threads.append(threading.get_ident())
        memmove_copier(plan)

    gpu, cpu = GPUSpec.of([5, 6], [2, 0]), CPUSpec.of([1, 2])
    probe = HostCopyHandler(kv, HostSlots.from_region(region), to_host=True)
    nbytes = probe.plan(gpu, cpu).total_bytes
    probe.close()
    for inline_bytes, in_loop in ((nbytes, True), (nbytes - 1, False)):
        handler = HostCopyHandler(
            kv,
            HostSlots.from_region(region),
            to_host=True,
            copier=recording_copy,
            inline_bytes=inline_bytes,
        )
        result = await handler.transfer(gpu, cpu)
        assert result.bytes == nbytes
        assert (threads.pop() == threading.get_ident()) is in_loop
        check_slots(kv, region, 1, gpu, cpu)
        handler.close()
    with pytest.raises(ValueError, match="inline_bytes must be >= 0"):
        HostCopyHandler(kv, HostSlots.from_region(region), to_host=True, inline_bytes=-1)


def test_host_slots_of_an_interleaved_region(tmp_path: Path) -> None:
    """Worker 1 of 2: slot s is row 2s+1; the flat view starts at slot 0 and is zero-copy."""
    iid = f"t{uuid.uuid4().hex}"
    with (
        SharedRegion(iid, 3, 5000, num_workers=2, worker_rank=0, directory=tmp_path) as peer,
        SharedRegion(iid, 3, 5000, num_workers=2, worker_rank=1, directory=tmp_path) as mine,
    ):
        host = HostSlots.from_region(mine)
        assert (host.address, host.stride) == (mine.slot_address(0), 2 * mine.row_bytes)
        assert host.num_slots == 3
        assert host.slot_bytes == 5000
        flat = host.flat()
        assert flat.data_ptr() == mine.slot_address(0)
        flat[host.stride * 2 : host.stride * 2 + 5000] = 9
        assert bytes(mine.slot_view(2)) == b"\x09" * 5000
        assert bytes(peer.slot_view(2)) == b"\x00" * 5000
        del flat, host


def test_triton_runs_plans_of_many_short_runs() -> None:
    """The CUDA copier's per-plan choice: Triton for at least MIN_JOBS runs shorter than the
    threshold on average, the copy engine for fewer runs or longer ones."""
    from kvtier_async.kernels.swap_blocks import MIN_JOBS

    from kvtier_async.transfer.copier import DEFAULT_TRITON_THRESHOLD, triton_plan

    below = DEFAULT_TRITON_THRESHOLD
    assert triton_plan(MIN_JOBS, MIN_JOBS * (below - 1), below)  # scattered short runs
    assert not triton_plan(MIN_JOBS - 1, 8, below)  # too few to amortise a launch
    assert not triton_plan(MIN_JOBS, MIN_JOBS * below, below)  # a mean of the threshold
    assert not triton_plan(1, 64 << 20, below)  # contiguous ids: one merged run
    # scattered 512 KiB pages go to Triton, 2 MiB ones to the copy engine (H200 figures)
    assert triton_plan(128, 128 * (512 << 10), below)
    assert not triton_plan(32, 32 * (2 << 20), below)
    assert triton_plan(MIN_JOBS, MIN_JOBS * (64 << 20), None)  # forced: any length
