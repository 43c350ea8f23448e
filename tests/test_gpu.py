"""The device side on a real GPU: handlers, the Triton kernel, the event bridge, the pinned
region, `TieredKVCache` and the vLLM worker role with CUDA KV caches. Bytes are compared.

Every CUDA test is marked ``gpu`` and skipped, with the reason, where torch sees no CUDA
device; ``ci/gpu-check`` runs them (``pytest -m gpu tests/test_gpu.py``) and fails if any
was skipped. A few tests also run on CPU tensors in the ordinary suite (the ``cpu`` ids):
the same scenario through the host handlers, so the helpers that build the caches and
check the bytes are themselves tested on every machine.

What runs on the GPU:

* Round trips GPU -> CPU slots -> other GPU blocks for vLLM's six KV-cache layouts, MLA,
  and attention plus MLA as two groups of different page sizes; every layout with two
  KV-cache groups, ``block_size_factor`` 1 and 3 and unaligned first blocks; through every
  issue path (``cudaMemcpyAsync``, ``Tensor.copy_``, the Triton kernel) synchronously, and
  through the router and the event bridge (both strategies) asynchronously. The slot bytes
  follow the slot layout, untouched slot bytes keep a sentinel, untouched blocks keep their
  bytes.
* The Triton kernel and the copy engine on the same blocks give the same bytes.
* The event bridge wakes the loop on real CUDA events (asyncio and trio), and a cancelled
  copy returns only after its last write: what the destination holds when the awaiting call
  returns is what it holds after a device-wide synchronize.
* The pinned region is registered (the driver sees host-registered memory) and unregistered
  on close.
* `TieredKVCache` with CUDA tensors as device blocks: store, evict to the fs tier, promote,
  load back, byte for byte.
* The vLLM connector's worker role (`ConnectorWorker`) on CUDA KV caches, its hooks driven
  in the V2 model runner's order with `KVTierMetadata` as the scheduler role would send it.
  vLLM itself is not on the GPU machines and is not carried there (vLLM 0.33 pins
  torch 2.14 where that machine has 2.11, and its import chain needs some 70 MiB of
  packages that machine lacks, compiled ones among them), so where vLLM is not importable
  the two base classes and the spec class our modules import from it are stand-ins
  (`_vllm_stand_ins`); where it is, vLLM's own are used.

The module imports without torch (``ci/gpu-check --collect-only`` collects it on machines
without one); every test then skips.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import sys
import time
import types
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from kvtier_async.ledger import CPUSpec, GPUSpec, make_offload_key
from kvtier_async.memory import SharedRegion
from kvtier_async.transfer import (
    BridgeStrategy,
    CanonicalKV,
    CudaCopyHandler,
    EventBridge,
    HostCopyHandler,
    HostSlots,
    TransferRouter,
    canonicalize,
)

try:
    import torch
except ImportError:  # pragma: no cover - collected without torch by ci/gpu-check
    torch = None

if torch is None:
    NO_CUDA = "torch is not importable"
elif not torch.cuda.is_available():
    NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"
else:
    NO_CUDA = ""
GPU = [pytest.mark.gpu, pytest.mark.skipif(bool(NO_CUDA), reason=NO_CUDA or "-")]
CPU = [pytest.mark.skipif(torch is None, reason="torch is not importable")]
DEVICES = [pytest.param("cpu", marks=CPU, id="cpu"), pytest.param("cuda", marks=GPU, id="cuda")]

NUM_BLOCKS = 64
NUM_SLOTS = 24
SENTINEL = 0xAB
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of ms of GPU time on an H200 (~2 GHz)
DEADLINE_S = 30.0


def gpu_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    for mark in reversed(GPU):
        fn = mark(fn)
    return fn


# -- KV caches as vLLM allocates them ------------------------------------------------

# vllm/v1/kv_cache_layout.py: the stride permutation of the logical [L, B, H, N, C] axes.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
KINDS = [*LAYOUTS, "MLA", "LBNHC+MLA"]
LAYERS, HEADS, TOKENS, KV_BYTES = 4, 2, 16, 256  # KV_BYTES: K|V of one head, one token
LATENT_BYTES = 1152  # an MLA latent vector (576 fp16 values)


def random_bytes(n: int, seed: int, device: str) -> torch.Tensor:
    """``n`` random bytes (int8), the same for a seed on every device."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n,), dtype=torch.int8, generator=gen).to(device)


def strided(order: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    strides, current = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim] = current
        current *= shape[dim]
    return strides


def attention_layers(layout: str, device: str, seed: int) -> dict[str, torch.Tensor]:
    """One flat int8 allocation, a 5-D [L, B, H, N, C] view in ``layout``'s physical
    order, one [B, H, N, C] bf16 view per layer (vLLM's ``create_kv_cache_views``)."""
    shape = (LAYERS, NUM_BLOCKS, HEADS, TOKENS, KV_BYTES)
    raw = random_bytes(int(np.prod(shape)), seed, device)
    view = torch.as_strided(raw, shape, strided(LAYOUTS[layout], shape))
    return {f"attn.{i}": view[i].view(torch.bfloat16) for i in range(LAYERS)}


def mla_layers(count: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """MLA: one latent vector per token, [B, N, latent] fp16 views of one allocation."""
    raw = random_bytes(count * NUM_BLOCKS * TOKENS * LATENT_BYTES, seed, device)
    view = raw.view(count, NUM_BLOCKS, TOKENS, LATENT_BYTES)
    return {f"mla.{i}": view[i].view(torch.float16) for i in range(count)}


def make_kv(kind: str, device: str, seed: int) -> CanonicalKV:
    """Two KV-cache groups of ``kind``'s caches."""
    if kind in LAYOUTS:
        views = attention_layers(kind, device, seed)
        groups = [["attn.0", "attn.1"], ["attn.2", "attn.3"]]
    elif kind == "MLA":
        views = mla_layers(2, device, seed)
        groups = [["mla.0"], ["mla.1"]]
    else:  # FlashAttention's layout and an MLA layer: two groups of different page sizes
        views = {**attention_layers("LBNHC", device, seed), **mla_layers(1, device, seed + 1)}
        groups = [["attn.0", "attn.1", "attn.2", "attn.3"], ["mla.0"]]
    return canonicalize(views, groups=groups, num_blocks=NUM_BLOCKS)


@contextlib.contextmanager
def open_region(
    directory: Path, slot_bytes: int, *, pin: bool, num_slots: int = NUM_SLOTS
) -> Iterator[SharedRegion]:
    with SharedRegion(f"g{uuid.uuid4().hex}", num_slots, slot_bytes, directory=directory) as r:
        r.numpy()[:] = SENTINEL
        if pin:
            assert r.register_cuda(), "cudaHostRegister failed"
        yield r


def specs(
    seed: int, factor: int, sizes: tuple[int, int], firsts: tuple[int, int]
) -> tuple[GPUSpec, CPUSpec, GPUSpec]:
    """Random source blocks, slots, and disjoint destination blocks for a round trip."""
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    blocks = rng.permutation(NUM_BLOCKS)
    needed = sum(-(-(f % factor + n) // factor) for n, f in zip(sizes, firsts, strict=True) if n)
    return (
        GPUSpec.of(blocks[:total], sizes, firsts),
        CPUSpec.of(rng.permutation(NUM_SLOTS)[:needed]),
        GPUSpec.of(blocks[total : 2 * total], sizes, firsts),
    )


# -- byte checks ---------------------------------------------------------------------


def snapshot(kv: CanonicalKV) -> list[np.ndarray]:
    """Every canonical view's pages as host bytes, ``[view][block] -> page``."""
    return [view.tensor.reshape(view.num_blocks, -1).cpu().numpy().copy() for view in kv.views]


def placements(
    kv: CanonicalKV, factor: int, gpu: GPUSpec, cpu: CPUSpec
) -> Iterator[tuple[int, int, int, int]]:
    """(view, GPU block, slot, page position in the slot) of every page a transfer moves."""
    block_pos = slot_pos = 0
    for group, (count, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
        skip = first % factor
        for i in range(count):
            block = int(gpu.block_ids[block_pos + i])
            slot = int(cpu.slot_ids[slot_pos + (skip + i) // factor])
            for view in kv.groups[group]:
                yield view, block, slot, (skip + i) % factor
        block_pos += count
        slot_pos += -(-(skip + count) // factor) if count else 0


def check_slots(
    kv: CanonicalKV, slots: np.ndarray, factor: int, gpu: GPUSpec, cpu: CPUSpec
) -> None:
    """Stored pages sit where the slot layout says; every other byte is the sentinel."""
    layout, pages = kv.slot_layout(factor), snapshot(kv)
    touched = np.zeros(slots.shape, dtype=bool)
    for view, block, slot, position in placements(kv, factor, gpu, cpu):
        start = layout.page_offset(view, position)
        end = start + kv.views[view].page_size
        assert slots[slot, start:end].tobytes() == pages[view][block].tobytes(), (view, block)
        touched[slot, start:end] = True
    assert bool((slots[~touched] == SENTINEL).all()), "a byte outside the stored pages changed"


def check_loaded(
    kv: CanonicalKV, before: list[np.ndarray], source: GPUSpec, loaded: GPUSpec
) -> None:
    """Loaded blocks hold their source blocks' pages; every other block is unchanged."""
    after = snapshot(kv)
    expected = [pages.copy() for pages in before]
    start = 0
    for group, count in enumerate(source.group_sizes):
        src = source.block_ids[start : start + count]
        dst = loaded.block_ids[start : start + count]
        for view in kv.groups[group]:
            expected[view][dst] = before[view][src]
        start += count
    for view, (got, want) in enumerate(zip(after, expected, strict=True)):
        bad = np.flatnonzero((got != want).any(axis=1))
        assert not len(bad), f"{kv.views[view].name}: blocks {bad.tolist()} hold wrong bytes"


def wipe(kv: CanonicalKV, blocks: GPUSpec) -> None:
    ids = torch.from_numpy(np.asarray(blocks.block_ids, dtype=np.int64)).to(kv.device)
    for view in kv.views:
        view.tensor[ids] = 0


def round_trip(
    kv: CanonicalKV,
    region: SharedRegion,
    factor: int,
    store: Callable[[GPUSpec, CPUSpec], object],
    load: Callable[[CPUSpec, GPUSpec], object],
    spec: tuple[GPUSpec, CPUSpec, GPUSpec],
) -> None:
    gpu, cpu, other = spec
    store(gpu, cpu)
    check_slots(kv, region.numpy().copy(), factor, gpu, cpu)  # no device sync in between
    wipe(kv, other)
    before = snapshot(kv)
    load(cpu, other)
    if kv.device.type == "cuda":
        torch.cuda.synchronize()  # execute() waits for its own stream; compare afterwards
    check_loaded(kv, before, gpu, other)


CASES = [
    pytest.param(1, (9, 8), (0, 0), id="factor1"),
    pytest.param(3, (10, 9), (0, 0), id="factor3"),
    pytest.param(3, (11, 10), (2, 1), id="factor3-unaligned"),
]
PATHS = ["cudaMemcpyAsync", "torch-copy", "triton"]


@dataclass
class LaunchCounter:
    launches: int = 0


@pytest.fixture
def kernel_launches(monkeypatch: pytest.MonkeyPatch) -> LaunchCounter:
    """Counts launches of the Triton swap-blocks kernel (the copiers import
    ``launch_device_table`` per batch; ``launch_swap_blocks`` goes through it too)."""
    swap_blocks = importlib.import_module("kvtier_async.kernels.swap_blocks")
    counter, launch = LaunchCounter(), swap_blocks.launch_device_table

    def counted(*args: Any, **kwargs: Any) -> None:
        counter.launches += 1
        launch(*args, **kwargs)

    monkeypatch.setattr(swap_blocks, "launch_device_table", counted)
    return counter


def cuda_handlers(
    kv: CanonicalKV, region: SharedRegion, factor: int, path: str, bridge: EventBridge
) -> tuple[CudaCopyHandler, CudaCopyHandler]:
    host = HostSlots.from_region(region)
    store, load = (
        CudaCopyHandler(
            kv,
            host,
            block_size_factor=factor,
            to_host=to_host,
            bridge=bridge,
            use_triton=path == "triton",
            use_cudart=path == "cudaMemcpyAsync",
        )
        for to_host in (True, False)
    )
    if path == "cudaMemcpyAsync":
        assert store.copy_engine_path == "cudaMemcpyAsync", "the cudaMemcpyAsync self-test failed"
    elif path == "torch-copy":
        assert store.copy_engine_path == "torch copy_"
    assert store.uses_triton == load.uses_triton == (path == "triton")
    return store, load


# -- round trips through every handler ----------------------------------------------


@pytest.mark.parametrize(("factor", "sizes", "firsts"), CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_on_the_host_handlers(
    shm_dir: Path, kind: str, factor: int, sizes: tuple[int, int], firsts: tuple[int, int]
) -> None:
    """The CPU self-check of the round-trip scenario (and its checks) the GPU tests use."""
    if torch is None:
        pytest.skip("torch is not importable")
    kv = make_kv(kind, "cpu", seed=factor)
    with open_region(shm_dir, kv.slot_layout(3).slot_bytes, pin=False) as region:
        host = HostSlots.from_region(region)
        store, load = (
            HostCopyHandler(kv, host, block_size_factor=factor, to_host=flag)
            for flag in (True, False)
        )
        round_trip(kv, region, factor, store.execute, load.execute, specs(1, factor, sizes, firsts))
        store.close()
        load.close()


@gpu_test
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("factor", "sizes", "firsts"), CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_sync(
    shm_dir: Path,
    kernel_launches: LaunchCounter,
    kind: str,
    factor: int,
    sizes: tuple[int, int],
    firsts: tuple[int, int],
    path: str,
) -> None:
    kv = make_kv(kind, "cuda", seed=factor)
    bridge = EventBridge(name="test")
    with open_region(shm_dir, kv.slot_layout(3).slot_bytes, pin=True) as region:
        store, load = cuda_handlers(kv, region, factor, path, bridge)
        try:
            spec = specs(2, factor, sizes, firsts)
            round_trip(kv, region, factor, store.execute, load.execute, spec)
        finally:
            store.close()
            load.close()
            bridge.close()
    assert (kernel_launches.launches == 2) == (path == "triton"), kernel_launches.launches


@gpu_test
@pytest.mark.anyio
@pytest.mark.parametrize("strategy", [BridgeStrategy.THREAD, BridgeStrategy.POLL])
@pytest.mark.parametrize(("factor", "sizes", "firsts"), CASES)
@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_async(
    shm_dir: Path,
    kind: str,
    factor: int,
    sizes: tuple[int, int],
    firsts: tuple[int, int],
    strategy: BridgeStrategy,
) -> None:
    """Through the router and the event bridge; the default copy path for the page size."""
    kv = make_kv(kind, "cuda", seed=10 + factor)
    gpu, cpu, other = specs(3, factor, sizes, firsts)
    with open_region(shm_dir, kv.slot_layout(3).slot_bytes, pin=True) as region:
        router = TransferRouter.create(
            kv, region, block_size_factor=factor, bridge_strategy=strategy
        )
        try:
            with anyio.fail_after(DEADLINE_S):
                stored = await router.transfer(gpu, cpu)
                assert stored.bytes > 0 and stored.seconds > 0
                check_slots(kv, region.numpy().copy(), factor, gpu, cpu)
                wipe(kv, other)
                before = snapshot(kv)
                torch.cuda.synchronize()
                await router.transfer(cpu, other)
            check_loaded(kv, before, gpu, other)  # no synchronisation after the await
        finally:
            router.close()


# -- the Triton kernel against the copy engine ---------------------------------------


def single_view_kv(page: int, seed: int) -> CanonicalKV:
    cache = random_bytes(NUM_BLOCKS * page, seed, "cuda").view(NUM_BLOCKS, page)
    return canonicalize({"cache": cache})


TRITON_CASES = [  # (caches, block_size_factor, group sizes, first block indices)
    pytest.param(lambda: make_kv("LHBNC", "cuda", 5), 3, (11, 10), (2, 1), id="LHBNC-runs"),
    pytest.param(lambda: make_kv("BLNHC", "cuda", 5), 3, (11, 10), (2, 1), id="BLNHC-cross-layer"),
    pytest.param(lambda: make_kv("LBNHC+MLA", "cuda", 5), 3, (11, 10), (2, 1), id="2-page-sizes"),
    *(
        pytest.param(
            lambda page=page: single_view_kv(page, page), 1, (20,), (0,), id=f"{page >> 10}KiB"
        )
        for page in (8 << 10, 24 << 10, 64 << 10, 256 << 10)
    ),
]


@gpu_test
@pytest.mark.parametrize(("make", "factor", "sizes", "firsts"), TRITON_CASES)
def test_triton_and_copy_engine_give_the_same_bytes(
    shm_dir: Path,
    kernel_launches: LaunchCounter,
    make: Callable[[], CanonicalKV],
    factor: int,
    sizes: tuple[int, ...],
    firsts: tuple[int, ...],
) -> None:
    """The same blocks stored through each path into slots of its own, then loaded from
    each path's slots into blocks of its own: slots and blocks agree, byte for byte."""
    kv, total = make(), sum(sizes)
    rng = np.random.default_rng(4)
    blocks = rng.permutation(NUM_BLOCKS)
    gpu, engine_dst, triton_dst = (
        GPUSpec.of(blocks[i * total : (i + 1) * total], sizes, firsts) for i in range(3)
    )
    n = sum(-(-(f % factor + c) // factor) for c, f in zip(sizes, firsts, strict=True))
    order = rng.permutation(2 * n)
    engine_slots, triton_slots = CPUSpec.of(order[:n]), CPUSpec.of(order[n:])
    bridge = EventBridge(name="test")
    slot_bytes = kv.slot_layout(factor).slot_bytes
    with open_region(shm_dir, slot_bytes, pin=True, num_slots=2 * n) as region:
        engine = cuda_handlers(kv, region, factor, "cudaMemcpyAsync", bridge)
        triton = cuda_handlers(kv, region, factor, "triton", bridge)
        try:
            engine[0].execute(gpu, engine_slots)
            triton[0].execute(gpu, triton_slots)
            stored = region.numpy().copy()
            assert (
                stored[triton_slots.slot_ids].tobytes() == stored[engine_slots.slot_ids].tobytes()
            )
            stored[triton_slots.slot_ids] = SENTINEL
            check_slots(kv, stored, factor, gpu, engine_slots)
            for load, src, dst in (
                (engine[1], engine_slots, engine_dst),
                (triton[1], triton_slots, triton_dst),
            ):
                wipe(kv, dst)
                before = snapshot(kv)
                load.execute(src, dst)
                torch.cuda.synchronize()
                check_loaded(kv, before, gpu, dst)
        finally:
            for handler in (*engine, *triton):
                handler.close()
            bridge.close()
    assert kernel_launches.launches == 2


@gpu_test
@pytest.mark.anyio
async def test_triton_transfers_in_flight_at_once_keep_their_own_tables(
    shm_dir: Path, kernel_launches: LaunchCounter
) -> None:
    """Triton transfers of different sizes enqueued before any has ended (each one's
    descriptor table staged in pinned rows of its own, the device table reused and grown
    under them), then awaited: every slot holds its own block's bytes, and the staging rows
    come back to the pool. A first round fills the pool (a pinned allocation may wait for
    the device); the second runs behind GPU work, so every upload happens after the CPU
    wrote every table."""
    page = 64 << 10
    kv = single_view_kv(page, 21)
    rng = np.random.default_rng(21)
    sizes = [20, 40, 24, 300, 28, 20, 700, 32]  # 700 jobs: the device table grows mid-way
    blocks = rng.integers(0, NUM_BLOCKS, sum(sizes))  # (a block may go to several slots)
    slots = rng.permutation(sum(sizes))
    jobs, at = [], 0
    for size in sizes:
        jobs.append((GPUSpec.of(blocks[at : at + size]), CPUSpec.of(slots[at : at + size])))
        at += size
    bridge = EventBridge(name="test")
    with open_region(shm_dir, page, pin=True, num_slots=sum(sizes)) as region:
        store = CudaCopyHandler(kv, HostSlots.from_region(region), to_host=True, bridge=bridge)
        try:
            assert all(store.path_for(gpu, cpu) == "triton" for gpu, cpu in jobs)
            copier = store.copier
            plans = [store.plan(gpu, cpu) for gpu, cpu in jobs]
            for behind in (False, True):
                region.numpy()[:] = SENTINEL
                if behind:
                    torch.cuda._sleep(4 * SLEEP_CYCLES)  # type: ignore[no-untyped-call]
                flights = [copier._submit(p, (), None, True, p.total_bytes) for p in plans]
                for flight in flights:
                    await bridge.wait(flight.end)
                    copier._finish(flight)
                stored = region.numpy().copy()
                check_slots(kv, stored, 1, GPUSpec.of(blocks), CPUSpec.of(slots))
                assert len(copier._staging) == len(sizes)  # every table's rows are back
        finally:
            store.close()
            bridge.close()
    assert kernel_launches.launches == 2 * len(sizes)


# -- the event bridge on real CUDA events --------------------------------------------


def busy_event() -> torch.cuda.Event:
    """An event recorded behind tens of milliseconds of GPU work."""
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


@gpu_test
@pytest.mark.anyio
@pytest.mark.parametrize("strategy", [BridgeStrategy.THREAD, BridgeStrategy.POLL])
async def test_the_bridge_wakes_the_loop_on_a_cuda_event(strategy: BridgeStrategy) -> None:
    """The awaiting task wakes once the event completed, and the loop ran other tasks
    meanwhile (a wait that blocked the loop would leave the ticker at zero)."""
    bridge = EventBridge(strategy, name="test")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.lowlevel.checkpoint()
            ticks += 1

    try:
        torch.cuda.synchronize()
        event = busy_event()
        assert not event.query(), "the GPU work ended before the wait began"
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            with anyio.fail_after(DEADLINE_S):
                await bridge.wait(event)
            completed = event.query()
            tg.cancel_scope.cancel()
        assert completed
        assert ticks > 0
        assert bridge.statistics().waits_completed == 1
    finally:
        bridge.close()
    assert bridge.join(DEADLINE_S)


@contextlib.contextmanager
def big_transfer(
    directory: Path, to_host: bool, strategy: BridgeStrategy
) -> Iterator[tuple[CudaCopyHandler, GPUSpec | CPUSpec, GPUSpec | CPUSpec, Callable[[], bytes]]]:
    """A 64 MiB copy of 2 MiB pages (the region pinned, the copy engine), and a function
    that reads the destination without waiting for the copy's stream."""
    page, count = 2 << 20, 32
    kv = single_view_kv(page, 7)
    with open_region(directory, page, pin=True, num_slots=count) as region:
        rng = np.random.default_rng(8)
        gpu, cpu = GPUSpec.of(rng.permutation(NUM_BLOCKS)[:count]), CPUSpec.of(range(count))
        if not to_host:
            region.numpy()[:] = np.random.default_rng(9).integers(0, 256, (count, page), np.uint8)
            wipe(kv, gpu)
        bridge = EventBridge(strategy, name="test")
        handler = CudaCopyHandler(
            kv, HostSlots.from_region(region), to_host=to_host, bridge=bridge, use_triton=False
        )
        ids = torch.from_numpy(gpu.block_ids.astype(np.int64)).cuda()
        reader = torch.cuda.Stream()  # type: ignore[no-untyped-call]

        def destination() -> bytes:
            if to_host:
                return region.numpy().tobytes()
            with torch.cuda.stream(reader):  # unordered with the copy's stream
                return kv.views[0].tensor[ids].cpu().numpy().tobytes()

        src, dst = (gpu, cpu) if to_host else (cpu, gpu)
        try:
            yield handler, src, dst, destination
        finally:
            handler.close()
            bridge.close()


@gpu_test
@pytest.mark.anyio
@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("strategy", [BridgeStrategy.THREAD, BridgeStrategy.POLL])
async def test_a_cancelled_copy_writes_nothing_after_it_returns(
    shm_dir: Path, strategy: BridgeStrategy, to_host: bool
) -> None:
    """The copy is queued behind GPU work when its job is cancelled: the job must return
    only after the copy's last write (the destination does not change afterwards, and holds
    the whole source), and raise the cancellation."""
    with big_transfer(shm_dir, to_host, strategy) as (handler, src, dst, destination):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        returned = []
        with anyio.fail_after(DEADLINE_S), anyio.CancelScope() as scope:

            async def job() -> None:
                await handler.transfer(src, dst)
                returned.append(True)

            async with anyio.create_task_group() as tg:
                tg.start_soon(job)
                await anyio.wait_all_tasks_blocked()
                in_flight = handler.copier.busy()
                scope.cancel()
        at_return = destination()
        torch.cuda.synchronize()
        assert in_flight, "the copy had already finished when the job was cancelled"
        assert scope.cancelled_caught and not returned
        assert destination() == at_return, "the copy wrote after its job returned"
        handler.execute(src, dst)  # the same copy, uncancelled: what the destination must hold
        assert destination() == at_return, "the cancelled copy did not finish"


# -- the pinned region ----------------------------------------------------------------

_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost; 0 is cudaMemoryTypeUnregistered


def memory_type(address: int) -> int:
    """``cudaPointerAttributes.type`` of ``address``, through the loaded CUDA runtime."""
    from kvtier_async._cudart import loaded_library_path

    path = loaded_library_path()
    assert path is not None, "libcudart is not loaded"
    cudart = ctypes.CDLL(path)
    attributes = ctypes.create_string_buffer(256)  # the struct, with room to spare
    code = cudart.cudaPointerGetAttributes(attributes, ctypes.c_void_p(address))
    assert code == 0, f"cudaPointerGetAttributes returned {code}"
    return int.from_bytes(attributes.raw[:4], sys.byteorder)


@gpu_test
def test_the_region_is_registered_and_unregistered(shm_dir: Path) -> None:
    torch.zeros(1, device="cuda")  # the runtime is loaded and a context exists
    region = SharedRegion(f"g{uuid.uuid4().hex}", 8, 3 << 20, directory=shm_dir)
    first, last = region.slot_address(0), region.slot_address(7) + (3 << 20) - 1
    try:
        assert memory_type(first) != _MEMORY_TYPE_HOST
        assert region.register_cuda() and region.is_cuda_registered
        assert memory_type(first) == memory_type(last) == _MEMORY_TYPE_HOST
        assert region.register_cuda()  # idempotent
        tensor = region.torch()
        assert tensor.is_pinned()
        assert HostSlots.from_region(region).pinned
        del tensor
    finally:
        region.close()
    assert not region.is_cuda_registered
    assert memory_type(first) != _MEMORY_TYPE_HOST, "close() left the range registered"


@gpu_test
def test_a_refused_pin_leaves_no_cuda_error_behind(tmp_path: Path) -> None:
    """A region on pytest's tmp_path (on disk here: Linux 6.x refuses to pin file-backed
    pages there) may fail to register; either way the caller's next kernel runs: a refusal
    leaves no last-error for torch to raise after that kernel's launch."""
    torch.zeros(1, device="cuda")
    region = SharedRegion(f"g{uuid.uuid4().hex}", 4, 64 << 10, directory=tmp_path)
    try:
        pinned = region.register_cuda()
        assert pinned == region.is_cuda_registered
        assert float(torch.ones(1024, device="cuda").sum()) == 1024.0
        torch.cuda.synchronize()
    finally:
        region.close()


@gpu_test
def test_the_default_path_is_chosen_per_transfer(shm_dir: Path) -> None:
    """One default handler: scattered short pages go to Triton, the same pages with
    contiguous ids (one merged run) to the copy engine; scattered 2 MiB pages too."""
    pages = {64 << 10: "triton", 2 << 20: "cudaMemcpyAsync"}
    for page, scattered_path in pages.items():
        kv = single_view_kv(page, 3)
        with open_region(shm_dir, page, pin=True, num_slots=NUM_BLOCKS) as region:
            bridge = EventBridge(name="paths")
            handler = CudaCopyHandler(
                kv, HostSlots.from_region(region), to_host=True, bridge=bridge
            )
            try:
                assert handler.uses_triton
                ids = np.random.default_rng(4).permutation(NUM_BLOCKS)[:32]
                scattered = (GPUSpec.of(ids), CPUSpec.of(ids[::-1].copy()))
                contiguous = (GPUSpec.of(range(32)), CPUSpec.of(range(32)))
                assert handler.path_for(*scattered) == scattered_path
                assert handler.path_for(*contiguous) == handler.copy_engine_path
                for specs in (scattered, contiguous):  # either path moves the right bytes
                    handler.execute(*specs)
                    gpu, cpu = specs
                    slots = region.numpy()
                    device = (
                        kv.views[0].tensor.view(torch.uint8).view(NUM_BLOCKS, page).cpu().numpy()
                    )
                    for block, slot in zip(gpu.block_ids, cpu.slot_ids, strict=True):
                        assert np.array_equal(slots[int(slot)], device[int(block)])
            finally:
                handler.close()
                bridge.close()


# -- TieredKVCache with device tensors ------------------------------------------------


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.mark.anyio
@pytest.mark.parametrize("device", DEVICES)
async def test_tiered_cache_with_device_blocks_end_to_end(
    tmp_path: Path, shm_dir: Path, device: str
) -> None:
    """Store 4 blocks, cascade them to the fs tier, evict them from the 4-slot CPU tier with
    4 others, promote them back with a lookup and load them into zeroed device blocks."""
    from kvtier_async.api import TieredKVCache

    block = 64 << 10
    config = {
        "block_bytes": block,
        "num_slots": 4,
        "region_dir": str(shm_dir),
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}],
    }
    data = random_bytes(8 * block, 11, device).view(torch.uint8).view(8, block)
    keys = [key(i) for i in range(8)]
    with anyio.fail_after(DEADLINE_S):
        async with TieredKVCache(config) as cache:
            first = await cache.store(keys[:4], list(data[:4]))
            assert first.stored == keys[:4]
            await cache.drain()  # cascaded to fs
            second = await cache.store(keys[4:], list(data[4:]))  # evicts the first four
            assert second.stored == keys[4:]
            await cache.drain()
            counters = cache.stats().tiers[0].counts
            assert counters.cascaded == 8
            assert await cache.lookup(keys[:4]) == 4
            assert cache.stats().tiers[0].counts.promoted == 4
            out = torch.zeros(4, block, dtype=torch.uint8, device=device)
            assert await cache.load(keys[:4], list(out)) == 4
            assert torch.equal(out, data[:4])
            stats = cache.ledger.primary.statistics()
            assert stats.writing == 0 and stats.pinned == 0


@gpu_test
@pytest.mark.anyio
async def test_tiered_cache_pins_its_region_and_copies_after_the_callers_stream(
    shm_dir: Path,
) -> None:
    """The async API's CUDA path is the transfer package's: the region is registered (pinned)
    at open, and a store waits for the work queued on the stream the caller was on (here a
    fill queued behind a long GPU sleep on a side stream), so it stores the filled bytes."""
    from kvtier_async.api import TieredKVCache

    block = 256 << 10
    config = {"block_bytes": block, "num_slots": 4, "region_dir": str(shm_dir)}
    with anyio.fail_after(DEADLINE_S):
        async with TieredKVCache(config) as cache:
            assert cache._region is not None and cache._region.is_cuda_registered
            assert memory_type(cache._region.slot_address(0)) == _MEMORY_TYPE_HOST
            data = torch.zeros(2, block, dtype=torch.uint8, device="cuda")
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
                data.fill_(0x5A)
                stored = await cache.store([key(1), key(2)], list(data))
            assert stored.stored == [key(1), key(2)]
            out = torch.zeros(2, block, dtype=torch.uint8, device="cuda")
            assert await cache.load([key(1), key(2)], list(out)) == 2
            torch.cuda.synchronize()
            assert bool((out == 0x5A).all()), "the store did not wait for the caller's stream"


@gpu_test
@pytest.mark.anyio
async def test_tiered_cache_moves_many_small_device_blocks_in_one_triton_launch(
    shm_dir: Path, kernel_launches: LaunchCounter
) -> None:
    """32 separate 64 KiB device blocks (32 runs: scattered) go in one Triton launch each
    way; 4 blocks (fewer than MIN_JOBS) and a misaligned block go to the copy engine; every
    byte arrives either way."""
    from kvtier_async.api import TieredKVCache

    block, count = 64 << 10, 32
    config = {"block_bytes": block, "num_slots": 2 * count, "region_dir": str(shm_dir)}
    with anyio.fail_after(DEADLINE_S):
        async with TieredKVCache(config) as cache:
            data = random_bytes(count * block, 41, "cuda").view(torch.uint8).view(count, block)
            blocks = [data[i].clone() for i in range(count)]  # separate allocations
            keys = [key(100 + i) for i in range(count)]
            assert (await cache.store(keys, blocks)).stored == keys
            assert kernel_launches.launches == 1
            out = [torch.zeros(block, dtype=torch.uint8, device="cuda") for _ in range(count)]
            assert await cache.load(keys, out) == count
            assert kernel_launches.launches == 2
            assert all(torch.equal(a, b) for a, b in zip(out, blocks, strict=True))
            few = [key(200 + i) for i in range(4)]
            assert (await cache.store(few, blocks[:4])).stored == few
            assert kernel_launches.launches == 2  # too few runs for a launch
            raw = torch.zeros(count * block + 4, dtype=torch.uint8, device="cuda")
            odd = [raw[4 + i * block : 4 + (i + 1) * block] for i in range(count)]  # 4 off
            assert await cache.load(keys, odd) == count
            assert kernel_launches.launches == 2  # misaligned: the copy engine
            assert all(torch.equal(a, b) for a, b in zip(odd, blocks, strict=True))


# -- the vLLM worker role on CUDA KV caches -------------------------------------------


@dataclass(frozen=True)
class _FullAttentionSpec:
    """Stand-in for ``vllm.v1.kv_cache_interface.FullAttentionSpec`` (the fields we read)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


def _vllm_stand_ins() -> dict[str, types.ModuleType]:
    """The part of vLLM's import surface our worker role uses, for machines without vLLM."""
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
    base.KVConnectorWorkerMetadata = type(  # type: ignore[attr-defined]
        "KVConnectorWorkerMetadata", (), {}
    )
    interface = types.ModuleType("vllm.v1.kv_cache_interface")
    interface.FullAttentionSpec = _FullAttentionSpec  # type: ignore[attr-defined]
    modules = {module.__name__: module for module in (base, interface)}
    for name in list(modules):
        while "." in name:
            name = name.rpartition(".")[0]
            modules.setdefault(name, types.ModuleType(name))
    # Our metrics module is built on vLLM's stats classes: the worker's copies are counted
    # by a stand-in that keeps what it is told (checked by the test).
    metrics = types.ModuleType("kvtier_async.integrations.vllm.metrics")
    metrics.WorkerMetrics = _WorkerMetrics  # type: ignore[attr-defined]
    modules[metrics.__name__] = metrics
    return modules


class _WorkerMetrics:
    """`kvtier_async.integrations.vllm.metrics.WorkerMetrics` without vLLM: the copies."""

    def __init__(self) -> None:
        self.copies: list[tuple[bool, int]] = []

    def record(self, is_store: bool, nbytes: int, seconds: float) -> None:
        assert seconds >= 0
        self.copies.append((is_store, nbytes))

    def take(self) -> None:
        return None


@pytest.fixture
def worker_role(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[types.ModuleType, Any]]:
    """``(kvtier_async.integrations.vllm.worker, FullAttentionSpec)``: vLLM's own classes
    where vLLM is importable, the stand-ins (forgotten again afterwards) where it is not."""
    name = "kvtier_async.integrations.vllm.worker"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # vLLM's import, under torch
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            worker = importlib.import_module(name)
    except ImportError:
        pass
    else:
        yield worker, FullAttentionSpec
        return
    for stand_in, module in _vllm_stand_ins().items():
        monkeypatch.setitem(sys.modules, stand_in, module)
    before = set(sys.modules)
    try:
        yield importlib.import_module(name), _FullAttentionSpec
    finally:
        for built_on_stand_ins in set(sys.modules) - before:
            del sys.modules[built_on_stand_ins]


GPU_BLOCK_TOKENS, HEAD_SIZE = 16, 64


def worker_caches(device: str) -> dict[str, torch.Tensor]:
    """Two layers of [B, H, N, 2 * head_size] fp16 (K|V packed) over one allocation, in
    FlashAttention's layout, as the V2 runner registers them."""
    shape = (2, NUM_BLOCKS, HEADS, GPU_BLOCK_TOKENS, 2 * HEAD_SIZE * 2)
    raw = random_bytes(int(np.prod(shape)), 21, device)
    view = torch.as_strided(raw, shape, strided(LAYOUTS["LBNHC"], shape))
    return {f"layers.{i}.attn": view[i].view(torch.float16) for i in range(2)}


def worker_configs(
    spec_cls: Any, device: str, block_size: int, shm_dir: Path, copies: str
) -> tuple[Any, Any, dict[str, Any]]:
    """vLLM's config objects, as far as the worker role reads them, and the extra config."""
    spec = spec_cls(
        block_size=GPU_BLOCK_TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=GPU_BLOCK_TOKENS),
        parallel_config=SimpleNamespace(
            world_size=1, rank=0, tensor_parallel_size=1, pipeline_parallel_size=1
        ),
        kv_transfer_config=SimpleNamespace(engine_id=f"gpu-test-{uuid.uuid4().hex[:8]}"),
        model_config=SimpleNamespace(model="tiny", dtype=torch.float16),
    )
    kv_cache_config = SimpleNamespace(
        num_blocks=NUM_BLOCKS,
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=spec, layer_names=["layers.0.attn", "layers.1.attn"])
        ],
    )
    extra = {
        "spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": 16 * (block_size // GPU_BLOCK_TOKENS) * 2 * spec.page_size_bytes,
        "block_size": block_size,
        "region_dir": str(shm_dir),
        "worker_copies": copies,
        "wait_timeout_s": DEADLINE_S,
    }
    return vllm_config, kv_cache_config, extra


def runner_step(worker: Any, meta: Any) -> tuple[set[str], set[int], dict[int, int]]:
    """One step's worker hooks in the V2 model runner's order (the per-layer hooks do
    nothing in this connector's worker): requests whose loads finished, block ids with load
    errors, and the jobs reported completed."""
    worker.handle_preemptions(meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    _, recving = worker.get_finished(set())
    errors = worker.get_block_ids_with_load_errors()
    reported = worker.build_connector_worker_meta()
    return recving or set(), errors, dict(reported.completed) if reported else {}


@pytest.mark.parametrize("copies", ["engine", "inline"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_worker_role_stores_and_loads_in_the_runners_order(
    shm_dir: Path, worker_role: tuple[types.ModuleType, Any], device: str, copies: str
) -> None:
    """Offloaded blocks of 2 GPU blocks, the first one unaligned: step 1 asks for a store,
    which the worker defers to step 2's start; step 2 flushes it (its blocks are about to
    be reused); step 3 loads the slots into other, zeroed blocks, reported once their bytes
    are in place."""
    worker_module, spec_cls = worker_role
    from kvtier_async.integrations.vllm.config import ConnectorConfig
    from kvtier_async.integrations.vllm.metadata import DeviceJob, KVTierMetadata

    vllm_config, kv_cache_config, extra = worker_configs(
        spec_cls, device, 2 * GPU_BLOCK_TOKENS, shm_dir, copies
    )
    worker = worker_module.ConnectorWorker(
        vllm_config, kv_cache_config, ConnectorConfig.from_extra_config(extra)
    )
    caches = worker_caches(device)
    worker.register_kv_caches(caches)
    kv = canonicalize(caches, [list(caches)], num_blocks=NUM_BLOCKS)  # to read the bytes
    rng = np.random.default_rng(22)
    blocks = rng.permutation(NUM_BLOCKS)
    stored = GPUSpec.of(blocks[:7], (7,), (1,))
    loaded = GPUSpec.of(blocks[7:14], (7,), (1,))
    slots = CPUSpec.of(rng.permutation(8)[:4])  # ceil((1 + 7) / 2) offloaded blocks
    try:
        # step 1: the scheduler asks for the store; it is deferred to the next step
        meta = KVTierMetadata(store_jobs={1: DeviceJob("a", stored, slots, is_store=True)})
        assert runner_step(worker, meta) == (set(), set(), {})
        # step 2: submitted at the start, flushed (waited for) before the forward pass
        done = runner_step(worker, KVTierMetadata(jobs_to_flush={1}))[2]
        if not done:  # the engine reports a flushed job on the next poll
            done = runner_step(worker, KVTierMetadata())[2]
        assert done == {1: 1}
        # step 3: load the slots into other blocks, zeroed first
        wipe(kv, loaded)
        before = snapshot(kv)
        meta = KVTierMetadata(load_jobs={2: DeviceJob("b", loaded, slots, is_store=False)})
        recving, errors, done = runner_step(worker, meta)
        deadline = time.monotonic() + DEADLINE_S
        while "b" not in recving:  # get_finished polls; the load runs on the worker's loop
            assert time.monotonic() < deadline, "the load was never reported"
            time.sleep(0.001)  # a poll, as the runner's next step would be
            more, errors, also = runner_step(worker, KVTierMetadata())
            recving |= more
            done.update(also)
        assert errors == set() and done == {2: 1}
        check_loaded(kv, before, stored, loaded)  # reported = the bytes are in place
        if isinstance(worker.metrics, _WorkerMetrics):  # without vLLM: the copies counted
            assert [is_store for is_store, _ in worker.metrics.copies] == [True, False]
    finally:
        worker.shutdown()
    assert not list(shm_dir.iterdir()), "the worker left its region file behind"


# -- kvtier bench gpu -------------------------------------------------------------------


def test_the_crossover_is_where_the_copy_engine_stays_ahead() -> None:
    from kvtier_async.bench.gpu import crossover

    sizes = [8, 16, 32, 64]
    assert crossover(sizes, [9, 8, 5, 4], [3, 6, 5, 7]) == 32  # a tie counts for the engine
    assert crossover(sizes, [9, 4, 9, 1], [3, 6, 5, 7]) == 64  # Triton wins again at 32
    assert crossover(sizes, [1, 1, 1, 1], [2, 2, 2, 2]) == 8
    assert crossover(sizes, [9, 9, 9, 9], [1, 2, 3, 4]) is None
    assert crossover([], [], []) is None


def test_percentiles_are_nearest_rank() -> None:
    from kvtier_async.bench.gpu import percentile

    samples = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile(samples, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_the_benchmark_says_it_did_not_run_without_cuda() -> None:
    from kvtier_async.bench.gpu import run

    notes: list[str] = []
    assert run(quick=True, progress=notes.append) == []
    assert any("did NOT run" in note for note in notes)


@gpu_test
def test_a_quick_benchmark_measures_everything_and_gives_no_verdict() -> None:
    from kvtier_async.bench.gpu import QUICK_PAGE_SIZES, run

    records = run(quick=True)
    cases = [r.case for r in records]
    assert len([c for c in cases if "scattered triton" in c]) == 2 * len(QUICK_PAGE_SIZES)
    assert len([c for c in cases if c.startswith("bridge ")]) >= 6
    latencies = [c for c in cases if c.startswith("latency ")]
    assert len(latencies) == 2 * 3 * 2  # each way, 1/16/128 blocks, awaited and blocking
    floors = [c for c in cases if c.startswith("loop floor ")]
    assert len(floors) >= 3 and "loop floor (asyncio) p99 budget" in floors
    assert not [c for c in cases if "crossover" in c]
    assert all(r.target is None and r.meets is None for r in records)
    assert all(r.reference is not None and r.ours > 0 for r in records)
