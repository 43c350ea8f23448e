"""Benchmark ``gpu``: device <-> pinned-host transfer bandwidth and event-bridge latency.

Without CUDA it reports that it did not run and returns no records.

With CUDA, for 8 KiB, 64 KiB, 256 KiB and 2 MiB blocks (a batch of random block ids and
random slots, 64 MiB; 16 MiB with ``quick``):

* D2H and H2D through `CudaCopyHandler` on the copy engine, runs issued with
  ``cudaMemcpyAsync`` (the default when its self-test passes) and with ``Tensor.copy_``,
  against one contiguous ``Tensor.copy_`` of the same bytes between the same buffers,
  timed the same way (submit, then wait for completion). Target 0.9 from 256 KiB up.
* Below the 28 KiB Triton threshold, the Triton swap-blocks kernel in both directions,
  against the copy engine (so the default path can be checked per direction).
* Event-bridge completion latency of both strategies: time from submitting a known amount
  of GPU work to the awaiting task waking up, against a blocking ``event.synchronize()``
  of the same work (the best any waiter can do). Lower is better.
"""

from __future__ import annotations

import functools
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier_async.ledger import CPUSpec, GPUSpec
from kvtier_async.memory import SharedRegion
from kvtier_async.transfer import (
    BridgeStrategy,
    CudaCopyHandler,
    EventBridge,
    HostSlots,
    canonicalize,
)

from .report import BenchRecord, latency_record, throughput_record

if TYPE_CHECKING:
    import torch

__all__ = ["run"]

PAGE_SIZES = (8 << 10, 64 << 10, 256 << 10, 2 << 20)
TRITON_THRESHOLD = 28 << 10
COPY_TARGET_FROM = 256 << 10
COPY_TARGET = 0.9
CONTIGUOUS = "one contiguous Tensor.copy_ of the same bytes"
COPY_ENGINE = "copy engine (default issue path) on the same blocks"
SYNCHRONIZE = "blocking event.synchronize() of the same work"


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Measure transfers and the bridge on the current CUDA device, or report no device."""
    say = progress or (lambda _msg: None)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        say("gpu: torch is not importable; the gpu benchmark did NOT run")
        return []
    if not torch.cuda.is_available():
        say("gpu: no CUDA device on this machine; the gpu benchmark did NOT run")
        return []
    say(f"gpu: {torch.cuda.get_device_name()}")
    batch_bytes = (16 if quick else 64) << 20
    repeats = 5 if quick else 20
    records: list[BenchRecord] = []
    for page in PAGE_SIZES:
        pages = batch_bytes // page
        with _pinned_region(4 * pages, page) as region:
            records += _page_cases(region, page, pages, repeats, say)
    records += _bridge_cases(quick, say)
    return records


def _page_cases(
    region: SharedRegion, page: int, pages: int, repeats: int, say: Callable[[str], None]
) -> list[BenchRecord]:
    import torch

    capacity = region.num_slots
    cache = torch.randint(0, 256, (capacity, page), dtype=torch.uint8, device="cuda")
    kv = canonicalize({"cache": cache})
    host = HostSlots.from_region(region)
    if not host.pinned:
        say("gpu: cudaHostRegister failed; host memory is pageable (slow, no Triton path)")
    rng = np.random.default_rng(page)
    gpu = GPUSpec.of(rng.permutation(capacity)[:pages])
    cpu = CPUSpec.of(rng.permutation(capacity)[:pages])
    total = pages * page
    device_flat, host_flat = cache.view(-1)[:total], host.flat()[:total]
    bridge = EventBridge(name="bench")
    records: list[BenchRecord] = []
    for to_host, name in ((True, "D2H"), (False, "H2D")):
        specs: tuple[Any, Any] = (gpu, cpu) if to_host else (cpu, gpu)

        def contiguous(to_host: bool = to_host) -> None:
            if to_host:
                host_flat.copy_(device_flat, non_blocking=True)
            else:
                device_flat.copy_(host_flat, non_blocking=True)
            torch.cuda.synchronize()

        reference = total / _best(contiguous, repeats) / 1e9
        case = f"{name} {_size(page)}"
        engine_gbps = 0.0
        for use_cudart in (True, False):
            engine = CudaCopyHandler(
                kv, host, to_host=to_host, bridge=bridge, use_triton=False, use_cudart=use_cudart
            )
            path = engine.copy_engine_path
            gbps = total / _best(functools.partial(engine.execute, *specs), repeats) / 1e9
            engine.close()
            engine_gbps = engine_gbps or gbps  # the default path is the first one
            say(f"gpu: {case}: copy engine via {path} {gbps:.1f} GB/s, contiguous {reference:.1f}")
            records.append(
                throughput_record(
                    "gpu",
                    f"{case} copy engine ({path})",
                    "GB/s",
                    gbps,
                    reference=reference,
                    reference_name=CONTIGUOUS,
                    target=COPY_TARGET if page >= COPY_TARGET_FROM else None,
                    unit="GB/s",
                )
            )
            if path == "torch copy_":
                break  # cudaMemcpyAsync unavailable: the two runs would be the same
        if page < TRITON_THRESHOLD and host.pinned:
            kernel = CudaCopyHandler(kv, host, to_host=to_host, bridge=bridge, use_triton=True)
            triton_gbps = total / _best(functools.partial(kernel.execute, *specs), repeats) / 1e9
            kernel.close()
            say(f"gpu: {case}: triton {triton_gbps:.1f} GB/s")
            records.append(
                throughput_record(
                    "gpu",
                    f"{case} triton",
                    "GB/s",
                    triton_gbps,
                    reference=engine_gbps,
                    reference_name=COPY_ENGINE,
                    unit="GB/s",
                )
            )
    bridge.close()
    return records


def _bridge_cases(quick: bool, say: Callable[[str], None]) -> list[BenchRecord]:
    """Launch-to-wake-up time through each bridge strategy vs a blocking synchronize."""
    import anyio
    import torch

    rounds = 20 if quick else 200
    cycles = 200_000  # ~0.1 ms of GPU time: the wait is real, not already complete

    def launch() -> torch.cuda.Event:
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    def blocking() -> float:
        start = time.perf_counter()
        launch().synchronize()
        return time.perf_counter() - start

    torch.cuda.synchronize()
    reference = statistics.median(blocking() for _ in range(rounds))
    records = []
    for strategy in (BridgeStrategy.THREAD, BridgeStrategy.POLL):
        bridge = EventBridge(strategy, name="bench")

        async def measure(bridge: EventBridge = bridge) -> float:
            samples = []
            for _ in range(rounds):
                start = time.perf_counter()
                await bridge.wait(launch())
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        ours = anyio.run(measure)
        bridge.close()
        say(
            f"gpu: bridge {strategy.value}: {ours * 1e6:.0f} us launch-to-wake-up, "
            f"blocking synchronize {reference * 1e6:.0f} us"
        )
        records.append(
            latency_record(
                "gpu",
                f"bridge {strategy.value}",
                "completion_us",
                ours * 1e6,
                reference=reference * 1e6,
                reference_name=SYNCHRONIZE,
                unit="us",
            )
        )
    return records


def _best(fn: Callable[[], object], repeats: int) -> float:
    import torch

    fn()  # warm up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@contextmanager
def _pinned_region(num_slots: int, slot_bytes: int) -> Iterator[SharedRegion]:
    import shutil
    import tempfile

    shm = Path("/dev/shm")
    directory = Path(tempfile.mkdtemp(prefix="kvtier-gpu-", dir=shm if shm.is_dir() else None))
    try:
        with SharedRegion(
            f"gpu-{uuid.uuid4().hex[:12]}", num_slots, slot_bytes, directory=directory
        ) as region:
            region.register_cuda()
            yield region
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
