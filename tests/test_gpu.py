"""Handler round trips on a real GPU: CUDA KV caches <-> a pinned shared region.

Skipped without CUDA. Same checks as ``test_transfer.py``: store random GPU blocks
(factor 1 and 3, unaligned first blocks, two groups) into slots, compare the slot bytes
with the slot layout, load them into other blocks and compare byte for byte, through the
copy engine and through the Triton kernel, synchronously and through the event bridge.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from kvtier_async.ledger import CPUSpec, GPUSpec
from kvtier_async.memory import SharedRegion
from kvtier_async.transfer import (
    BridgeStrategy,
    CanonicalKV,
    CudaCopyHandler,
    EventBridge,
    HostSlots,
    TransferRouter,
    canonicalize,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_BLOCKS = 24
NUM_SLOTS = 16
SENTINEL = 0xAB


def make_kv(seed: int) -> CanonicalKV:
    """Two groups on the GPU: two LBNHC attention layers (16 KiB pages), one MLA layer."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    attn = [
        torch.randint(
            0, 256, (NUM_BLOCKS, 16, 8, 64), dtype=torch.uint8, device="cuda", generator=gen
        ).view(torch.bfloat16)
        for _ in range(2)
    ]
    mla = torch.randint(
        0, 256, (NUM_BLOCKS, 16, 1152), dtype=torch.uint8, device="cuda", generator=gen
    ).view(torch.float16)
    views = {
        "attn.0": attn[0].permute(0, 2, 1, 3),
        "attn.1": attn[1].permute(0, 2, 1, 3),
        "mla.0": mla,
    }
    return canonicalize(views, groups=[["attn.0", "attn.1"], ["mla.0"]], num_blocks=NUM_BLOCKS)


@pytest.fixture
def region(tmp_path: Path) -> Iterator[SharedRegion]:
    slot_bytes = make_kv(0).slot_layout(3).slot_bytes
    with SharedRegion(f"g{uuid.uuid4().hex}", NUM_SLOTS, slot_bytes, directory=tmp_path) as shared:
        shared.numpy()[:] = SENTINEL
        assert shared.register_cuda(), "cudaHostRegister failed"
        yield shared


def specs(
    seed: int, factor: int, sizes: tuple[int, int], firsts: tuple[int, int]
) -> tuple[GPUSpec, CPUSpec, GPUSpec]:
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    blocks = rng.permutation(NUM_BLOCKS)
    needed = sum(-(-(f % factor + n) // factor) for n, f in zip(sizes, firsts, strict=True) if n)
    return (
        GPUSpec.of(blocks[:total], sizes, firsts),
        CPUSpec.of(rng.permutation(NUM_SLOTS)[:needed]),
        GPUSpec.of(blocks[total : 2 * total], sizes, firsts),
    )


def page(kv: CanonicalKV, view: int, block: int) -> bytes:
    return kv.views[view].page(block).cpu().numpy().tobytes()


def check_slots(
    kv: CanonicalKV, region: SharedRegion, factor: int, gpu: GPUSpec, cpu: CPUSpec
) -> None:
    layout = kv.slot_layout(factor)
    slots = region.numpy().copy()  # the bytes as they are now, before any device sync
    touched = np.zeros(slots.shape, dtype=bool)
    block_pos = slot_pos = 0
    for group, (count, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
        skip = first % factor
        for i in range(count):
            block = int(gpu.block_ids[block_pos + i])
            slot = int(cpu.slot_ids[slot_pos + (skip + i) // factor])
            for view in kv.groups[group]:
                start = layout.page_offset(view, (skip + i) % factor)
                end = start + kv.views[view].page_size
                assert slots[slot, start:end].tobytes() == page(kv, view, block)
                touched[slot, start:end] = True
        block_pos += count
        slot_pos += -(-(skip + count) // factor) if count else 0
    assert bool((slots[~touched] == SENTINEL).all())


def check_loaded(kv: CanonicalKV, gpu: GPUSpec, other: GPUSpec) -> None:
    start = 0
    for group, count in enumerate(gpu.group_sizes):
        for i in range(start, start + count):
            for view in kv.groups[group]:
                assert page(kv, view, int(other.block_ids[i])) == page(
                    kv, view, int(gpu.block_ids[i])
                )
        start += count


CASES = [
    pytest.param(1, (3, 2), (0, 0), id="factor1"),
    pytest.param(3, (5, 4), (0, 0), id="factor3"),
    pytest.param(3, (4, 5), (2, 1), id="factor3-unaligned"),
]


@pytest.mark.parametrize("use_triton", [False, True], ids=["copy-engine", "triton"])
@pytest.mark.parametrize(("factor", "sizes", "firsts"), CASES)
def test_round_trip_sync(
    region: SharedRegion,
    use_triton: bool,
    factor: int,
    sizes: tuple[int, int],
    firsts: tuple[int, int],
) -> None:
    kv = make_kv(factor)
    gpu, cpu, other = specs(factor, factor, sizes, firsts)
    router = TransferRouter.create(kv, region, block_size_factor=factor, use_triton=use_triton)
    try:
        assert all(
            isinstance(h, CudaCopyHandler) and h.uses_triton == use_triton
            for h in router.handlers.values()
        )
        router.execute(gpu, cpu)
        check_slots(kv, region, factor, gpu, cpu)
        for view in kv.views:
            view.tensor[torch.from_numpy(other.block_ids).cuda()] = 0
        router.execute(cpu, other)
        torch.cuda.synchronize()
        check_loaded(kv, gpu, other)
    finally:
        router.close()


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", [BridgeStrategy.THREAD, BridgeStrategy.POLL])
@pytest.mark.parametrize(("factor", "sizes", "firsts"), CASES)
async def test_round_trip_async(
    region: SharedRegion,
    strategy: BridgeStrategy,
    factor: int,
    sizes: tuple[int, int],
    firsts: tuple[int, int],
) -> None:
    kv = make_kv(10 + factor)
    gpu, cpu, other = specs(10 + factor, factor, sizes, firsts)
    router = TransferRouter.create(kv, region, block_size_factor=factor, bridge_strategy=strategy)
    try:
        stored = await router.transfer(gpu, cpu)
        assert stored.bytes > 0 and stored.seconds > 0
        check_slots(kv, region, factor, gpu, cpu)
        await router.transfer(cpu, other)
        check_loaded(kv, gpu, other)
    finally:
        router.close()


@pytest.mark.anyio
async def test_cancelled_store_returns_after_the_copy(region: SharedRegion) -> None:
    """The compute stream is busy, so the store is still queued when it is cancelled; the
    job must not return before its end event, i.e. before the bytes are in the slots."""
    kv = make_kv(99)
    gpu, cpu, _ = specs(99, 1, (3, 2), (0, 0))
    bridge = EventBridge(name="test")
    handler = CudaCopyHandler(kv, HostSlots.from_region(region), to_host=True, bridge=bridge)
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # ~tens of ms of work
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(handler.transfer, gpu, cpu)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    check_slots(kv, region, 1, gpu, cpu)  # complete, without any further synchronisation
    handler.close()
    bridge.close()


@pytest.mark.parametrize("use_cudart", [True, False], ids=["cudaMemcpyAsync", "torch-copy"])
def test_copy_engine_issue_paths(region: SharedRegion, use_cudart: bool) -> None:
    kv = make_kv(7)
    gpu, cpu, other = specs(7, 3, (4, 5), (2, 1))
    bridge = EventBridge(name="test")
    host = HostSlots.from_region(region)
    store, load = (
        CudaCopyHandler(
            kv,
            host,
            block_size_factor=3,
            to_host=flag,
            bridge=bridge,
            use_triton=False,
            use_cudart=use_cudart,
        )
        for flag in (True, False)
    )
    if use_cudart:
        assert store.copy_engine_path == "cudaMemcpyAsync", "the cudart self-test failed"
    else:
        assert store.copy_engine_path == "torch copy_"
    store.execute(gpu, cpu)
    check_slots(kv, region, 3, gpu, cpu)
    load.execute(cpu, other)
    torch.cuda.synchronize()
    check_loaded(kv, gpu, other)
    store.close()
    load.close()
    bridge.close()
