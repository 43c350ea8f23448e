"""Benchmark ``copy``: batch copies between a CPU KV tensor and the shared region.

The transfer handler's CPU path (`HostCopyHandler.execute`: planning, merging, the batch
copy) moves a batch of pages between a CPU tensor standing in for the device KV cache and
a `SharedRegion` (in ``/dev/shm``), for 8 KiB, 64 KiB, 256 KiB and 2 MiB pages, with
random and with contiguous block and slot ids, in both directions. The reference, timed
in the same run and alternating with ours, is one ``numpy.copyto`` of the same number of
bytes between the same two buffers: one contiguous memcpy. Target: 80% of it.

Each side is timed with this thread's CPU clock (``time.thread_time``: both run
synchronously in the calling thread), best of 100 alternating rounds, so that time slices
lost to other processes on a shared machine count for neither; contention for memory
bandwidth still shows.

The plan rows time a small transfer's fixed cost: the plan of 1, 4 and 16 scattered blocks of
a 32-layer model (vLLM's per-layer caches, K and V apart: 64 views, so 64 runs a block), as
a handler makes it (`Planner`: C where it was built), against numpy's planner with its merge
on the same specs, alternating, and against a budget of 5 us (fixed, not measured); best of
rounds of many calls, per call, thread CPU time.

A batch is 16 MiB (4 MiB with ``quick``), drawn from buffers four times that size. Keep
batches below glibc's non-temporal-store threshold (``ld.so --list-tunables``:
``x86_non_temporal_threshold``, 114 MiB on the dev VM): above it one big memcpy switches
to streaming stores and runs ~1.5x faster than any copy made of smaller pieces, which
would compare two different kinds of store.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtier_async.ledger import CPUSpec, GPUSpec
from kvtier_async.memory import SharedRegion
from kvtier_async.transfer import HostCopyHandler, HostSlots, canonicalize, plan_transfer

from .report import BenchRecord, latency_record, throughput_record

__all__ = ["run"]

PAGE_SIZES = (8 << 10, 64 << 10, 256 << 10, 2 << 20)
TARGET = 0.8
REFERENCE_NAME = "numpy copyto of the same bytes (one contiguous memcpy)"
PLAN_BLOCKS = (1, 4, 16)
PLAN_BUDGET_S = 5e-6
PLAN_LAYERS = 32


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Measure every (page size, id pattern, direction) case against a contiguous copy."""
    say = progress or (lambda _msg: None)
    batch_bytes = (4 if quick else 16) << 20
    repeats = 10 if quick else 100
    records: list[BenchRecord] = []
    for page in PAGE_SIZES:
        pages = max(1, batch_bytes // page)
        with _region(4 * pages, page) as region:
            records += _page_cases(region, page, pages, repeats, say)
    return records + _plan_cases(quick, say)


def _plan_cases(quick: bool, say: Callable[[str], None]) -> list[BenchRecord]:
    """The plan of a small transfer (see the module docstring), C or numpy, per call."""
    import torch

    num_blocks = 64
    caches = {  # vLLM's FlashAttention shape per layer: (2, blocks, tokens, heads, head size)
        f"layers.{i}": torch.zeros(2, num_blocks, 16, 1, 64, dtype=torch.bfloat16)
        for i in range(PLAN_LAYERS)
    }
    kv = canonicalize(caches)
    layout = kv.slot_layout(1)
    slots = torch.zeros(num_blocks, layout.slot_bytes, dtype=torch.uint8)
    host = HostSlots.from_tensor(slots)
    handler = HostCopyHandler(kv, host, to_host=True)
    native = handler.planner_path
    say(f"copy: plans of {len(kv.views)} views, planner: {native}")
    rng = np.random.default_rng(7)
    calls, rounds = (200, 5) if quick else (2000, 20)
    records = []
    for blocks in PLAN_BLOCKS:
        gpu = GPUSpec.of(rng.permutation(num_blocks)[:blocks])
        cpu = CPUSpec.of(rng.permutation(num_blocks)[:blocks])

        def ours(gpu: GPUSpec = gpu, cpu: CPUSpec = cpu) -> None:
            handler.plan(gpu, cpu)

        def numpy_plan(gpu: GPUSpec = gpu, cpu: CPUSpec = cpu) -> None:
            plan_transfer(kv, layout, host, gpu, cpu, to_host=True).merged()

        best_ours, best_numpy = _per_call(ours, numpy_plan, calls, rounds)
        case = f"plan {blocks} block{'s' if blocks > 1 else ''} ({len(kv.views)} views)"
        say(f"copy: {case}: {best_ours * 1e6:.1f} us, numpy {best_numpy * 1e6:.1f} us")
        records.append(
            latency_record(
                "copy",
                f"{case}, {native} vs numpy",
                "s",
                best_ours,
                reference=best_numpy,
                reference_name="numpy's planner and merge, same specs (measured)",
                unit="s",
            )
        )
        records.append(
            latency_record(
                "copy",
                f"{case}, {native} vs budget",
                "s",
                best_ours,
                reference=PLAN_BUDGET_S,
                reference_name="a budget of 5 us per plan (fixed, not measured)",
                target=1.0,
                unit="s",
            )
        )
    handler.close()
    return records


def _per_call(
    ours: Callable[[], None], reference: Callable[[], None], calls: int, rounds: int
) -> tuple[float, float]:
    """Best seconds per call of each (thread CPU time over ``calls`` calls), alternating."""
    best = [float("inf"), float("inf")]
    for function in (ours, reference):
        function()  # warm up
    for _ in range(rounds):
        for side, function in enumerate((ours, reference)):
            start = time.thread_time()
            for _ in range(calls):
                function()
            best[side] = min(best[side], (time.thread_time() - start) / calls)
    return best[0], best[1]


def _page_cases(
    region: SharedRegion, page: int, pages: int, repeats: int, say: Callable[[str], None]
) -> list[BenchRecord]:
    """Every case of one page size. Returns before the region closes, so its views die."""
    import torch

    capacity = region.num_slots
    cache = torch.zeros(capacity, page, dtype=torch.uint8)
    cache.view(-1).copy_(torch.randint(0, 256, (capacity * page,), dtype=torch.uint8))
    kv = canonicalize({"cache": cache})
    host = HostSlots.from_region(region)
    handlers = {
        "store": HostCopyHandler(kv, host, to_host=True),
        "load": HostCopyHandler(kv, host, to_host=False),
    }
    if page == PAGE_SIZES[0]:
        say(f"copy: batch {pages * page >> 20} MiB, batch copy: {handlers['store'].copier_name}")
    total = pages * page
    device = cache.numpy().reshape(-1)[:total]
    slots = np.asarray(region.rows).reshape(-1)[:total]  # slot rows back to back (1 worker)
    records = []
    for ids in ("random", "contiguous"):
        gpu, cpu = _specs(ids, pages, capacity)
        for name, specs, (dst, src) in (
            ("store", (gpu, cpu), (slots, device)),
            ("load", (cpu, gpu), (device, slots)),
        ):
            case = f"{name} {_size(page)} {ids}"
            say(f"copy: {case}")
            ours, ref = _measure(handlers[name], specs, dst, src, repeats)
            records.append(
                throughput_record(
                    "copy",
                    case,
                    "GB/s",
                    ours,
                    reference=ref,
                    reference_name=REFERENCE_NAME,
                    target=TARGET,
                    unit="GB/s",
                )
            )
    for handler in handlers.values():
        handler.close()
    return records


def _specs(ids: str, pages: int, capacity: int) -> tuple[GPUSpec, CPUSpec]:
    rng = np.random.default_rng(pages)
    if ids == "random":
        return GPUSpec.of(rng.permutation(capacity)[:pages]), CPUSpec.of(
            rng.permutation(capacity)[:pages]
        )
    # the very bytes the reference copies: blocks and slots 0..pages-1
    return GPUSpec.of(np.arange(pages)), CPUSpec.of(np.arange(pages))


def _measure(
    handler: HostCopyHandler,
    specs: tuple[GPUSpec | CPUSpec, GPUSpec | CPUSpec],
    dst: npt.NDArray[np.uint8],
    src: npt.NDArray[np.uint8],
    repeats: int,
) -> tuple[float, float]:
    """Best GB/s of ours and of the reference (thread CPU time), alternating rounds."""
    best_ours = best_ref = float("inf")
    handler.execute(*specs)  # warm up: page faults, the native library
    np.copyto(dst, src)
    for _ in range(repeats):
        start = time.thread_time()
        handler.execute(*specs)
        best_ours = min(best_ours, time.thread_time() - start)
        start = time.thread_time()
        np.copyto(dst, src)
        best_ref = min(best_ref, time.thread_time() - start)
    return src.nbytes / best_ours / 1e9, src.nbytes / best_ref / 1e9


@contextmanager
def _region(num_slots: int, slot_bytes: int) -> Iterator[SharedRegion]:
    shm = Path("/dev/shm")
    directory = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=shm if shm.is_dir() else None))
    try:
        with SharedRegion(
            f"bench-{uuid.uuid4().hex[:12]}", num_slots, slot_bytes, directory=directory
        ) as region:
            yield region
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
