"""Benchmark ``gpu``: device <-> pinned-host transfers and event-bridge wake latency.

Without CUDA it says so and returns no records. With CUDA, every figure is compared with a
reference measured in the same run, on the same buffers:

*Copy engine.* For pages of 8 KiB to 2 MiB (`PAGE_SIZES`), a 64 MiB batch (16 MiB with
``quick``) of one KV cache ``(blocks, page)`` moves D2H and H2D through `CudaCopyHandler`
on the copy engine (``cudaMemcpyAsync`` runs, the default issue path), with contiguous
block and slot ids (the plan merges into one run) and with scattered ones (random ids out
of twice as many). The reference is one ``Tensor.copy_`` of the same number of bytes
between the same pinned region and the same device cache. Target: 0.9 of it from 256 KiB
pages up (`COPY_TARGET`). The ``Tensor.copy_`` issue path is reported too (scattered ids,
no target).

*Triton or copy engine.* On the scattered batches the Triton swap-blocks kernel runs at
every page size (forced on), against the copy engine on the same blocks. Per direction the
run finds the crossover: the smallest page size from which the copy engine is at least as
fast as Triton at that size and every larger one ('none' when Triton wins everywhere; the
record's ``ours`` is then 0), shown against today's `DEFAULT_TRITON_THRESHOLD`. And at
every size, the path a default handler takes for the scattered batch (`CudaCopyHandler`
with ``use_triton=None``, its `path_for`) is compared with the faster of the two measured:
target 0.95 of it (`CHOICE_TARGET`: the faster one chosen, within measurement noise).

*Event bridge.* One round: GPU work of about 0.1 ms (``torch.cuda._sleep`` between two
timing events), an event recorded after it, then the wait; the wake latency is the time
from just before the launch to the waiter's wake-up, less the GPU work's own duration (the
events' elapsed time): the waiter's delay plus the launch's few microseconds, the same in
ours and the reference (floored at `MIN_WAKE_US`, the events' resolution). Ours: a task
awaiting `EventBridge.wait` in an anyio loop (each strategy; asyncio, and when they are
installed, asyncio on uvloop's loop, as vLLM's API server runs it, and trio). Reference: a
bare ``torch.cuda.Event.synchronize()`` in a waiting thread. p50 and p99 over
`BRIDGE_ROUNDS` rounds (no target: the ratio shows the cost of the hand-off to the loop),
and the p99 against the 100 us budget (`BRIDGE_P99_BUDGET_US`, a fixed
figure, not a measurement: target 1.0). The *loop floor* is measured the same way: the bare
``synchronize()`` in a waiting thread, then the backend's own cross-thread wake of a task
(asyncio's ``call_soon_threadsafe`` setting a future, trio's ``run_sync_soon``), no anyio and
no bridge: what any thread-based design pays at least. Its p99 is shown against the budget
(no target: it is the platform's) and the bridge's p99 against it (no target: the ratio is
what the bridge adds).

*One transfer's latency.* Small transfers one at a time, as a request's load waits for
them: 1, 16 and 128 scattered blocks of 256 KiB (`LATENCY_BLOCKS`, `LATENCY_PAGE`) each
way through a default `CudaCopyHandler`, ``transfer`` awaited in an asyncio loop (through
the bridge) and the blocking ``execute``, against one ``Tensor.copy_`` of the same bytes
followed by ``torch.cuda.synchronize()``, rounds interleaved, p50 (no target: the ratio
shows what a transfer costs beside moving its bytes).

Times are best of `REPEATS` runs (each synchronised); other load on the machine only adds
time. ``quick`` measures fewer sizes and rounds, and gives no verdict (no targets, no
crossover): too few samples to support one.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import itertools
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier_async.ledger import CPUSpec, GPUSpec
from kvtier_async.memory import SharedRegion
from kvtier_async.transfer import (
    BridgeStrategy,
    CanonicalKV,
    CudaCopyHandler,
    EventBridge,
    HostSlots,
    canonicalize,
)
from kvtier_async.transfer.copier import DEFAULT_TRITON_THRESHOLD

from .report import BenchRecord, latency_record, throughput_record

__all__ = ["crossover", "percentile", "run"]

KIB = 1 << 10
PAGE_SIZES = tuple(n * KIB for n in (8, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048))
QUICK_PAGE_SIZES = (8 * KIB, 64 * KIB, 2048 * KIB)
REPEATS, QUICK_REPEATS = 10, 3
COPY_TARGET_FROM = 256 * KIB
COPY_TARGET = 0.9
CHOICE_TARGET = 0.95
BRIDGE_ROUNDS, QUICK_BRIDGE_ROUNDS = 1000, 50
BRIDGE_SLEEP_CYCLES = 200_000  # ~0.1 ms at ~2 GHz: the waiter is parked before completion
BRIDGE_P99_BUDGET_US = 100.0
UVLOOP = "asyncio+uvloop"
LATENCY_PAGE = 256 * KIB
LATENCY_BLOCKS = (1, 16, 128)
MIN_WAKE_US = 0.5  # CUDA events time to about half a microsecond
CONTIGUOUS = "one Tensor.copy_ of the same bytes, same pinned region and device"
COPY_ENGINE = "copy engine (cudaMemcpyAsync runs) on the same blocks"
FASTER = "the faster of Triton and the copy engine at this size, measured above"
THRESHOLD = "today's DEFAULT_TRITON_THRESHOLD"
SYNCHRONIZE = "bare torch.cuda.Event.synchronize() in a waiting thread"
BUDGET = "the 100 us budget (a fixed figure)"
ONE_COPY = "one Tensor.copy_ of the same bytes, then torch.cuda.synchronize()"
FLOOR = "the loop floor: bare synchronize, then the loop's own cross-thread wake"


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Measure transfers and the bridge on the current CUDA device, or report no device."""
    say = progress or (lambda _msg: None)
    try:
        import torch
    except ImportError:
        say("gpu: torch is not importable; the gpu benchmark did NOT run")
        return []
    if not torch.cuda.is_available():
        say("gpu: no CUDA device on this machine; the gpu benchmark did NOT run")
        return []
    say(f"gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    settings = _Settings(quick)
    records: list[BenchRecord] = []
    measured: dict[str, list[_PathSpeeds]] = {"D2H": [], "H2D": []}
    for page in settings.page_sizes:
        pages = settings.batch_bytes // page
        with _pinned_region(2 * pages, page) as region:
            if not region.is_cuda_registered:
                say("gpu: cudaHostRegister failed: pageable host memory, no Triton path")
            for to_host in (True, False):
                speeds, found = _page_cases(region, page, pages, to_host, settings, say)
                records += found
                if speeds is not None:
                    measured[_direction(to_host)].append(speeds)
    if quick:
        say("gpu: quick run: no crossover (too few page sizes), no verdicts")
    else:
        records += [_crossover_record(name, speeds, say) for name, speeds in measured.items()]
    records += _latency_cases(settings, say)
    records += _bridge_cases(settings, say)
    return records


@dataclass(frozen=True)
class _Settings:
    quick: bool

    @property
    def page_sizes(self) -> tuple[int, ...]:
        return QUICK_PAGE_SIZES if self.quick else PAGE_SIZES

    @property
    def batch_bytes(self) -> int:
        return (16 if self.quick else 64) << 20

    @property
    def repeats(self) -> int:
        return QUICK_REPEATS if self.quick else REPEATS

    @property
    def rounds(self) -> int:
        return QUICK_BRIDGE_ROUNDS if self.quick else BRIDGE_ROUNDS

    def target(self, value: float | None) -> float | None:
        """No verdict from a quick run."""
        return None if self.quick else value


@dataclass(frozen=True)
class _PathSpeeds:
    """GB/s of both paths on the scattered batch of one page size, one direction."""

    page: int
    triton: float
    engine: float


# -- transfers ----------------------------------------------------------------------


def _page_cases(
    region: SharedRegion,
    page: int,
    pages: int,
    to_host: bool,
    settings: _Settings,
    say: Callable[[str], None],
) -> tuple[_PathSpeeds | None, list[BenchRecord]]:
    import torch

    capacity = region.num_slots
    cache = torch.randint(0, 256, (capacity, page), dtype=torch.uint8, device="cuda")
    kv = canonicalize({"cache": cache})
    host = HostSlots.from_region(region)
    total = pages * page
    device_flat, host_flat = cache.view(-1)[:total], host.flat()[:total]

    def contiguous() -> None:
        if to_host:
            host_flat.copy_(device_flat, non_blocking=True)
        else:
            device_flat.copy_(host_flat, non_blocking=True)
        torch.cuda.synchronize()

    reference = total / _best(contiguous, settings.repeats) / 1e9
    case = f"{_direction(to_host)} {_size(page)}"
    say(f"gpu: {case}: one contiguous Tensor.copy_ {reference:.1f} GB/s")
    rng = np.random.default_rng(page + to_host)
    ids = {
        "contiguous": (GPUSpec.of(range(pages)), CPUSpec.of(range(pages))),
        "scattered": (
            GPUSpec.of(rng.permutation(capacity)[:pages]),
            CPUSpec.of(rng.permutation(capacity)[:pages]),
        ),
    }
    bridge = EventBridge(name="bench")
    gbps = functools.partial(_gbps, kv, host, to_host, bridge, total, settings.repeats)
    target = settings.target(COPY_TARGET if page >= COPY_TARGET_FROM else None)
    records = []
    try:
        speeds = {}
        for pattern, (gpu, cpu) in ids.items():
            specs = (gpu, cpu) if to_host else (cpu, gpu)
            speeds[pattern] = gbps(specs, use_triton=False)
            say(f"gpu: {case} {pattern}: copy engine {speeds[pattern]:.1f} GB/s")
            records.append(
                _throughput(f"{case} {pattern} copy engine", speeds[pattern], reference, target)
            )
        gpu, cpu = ids["scattered"]
        specs = (gpu, cpu) if to_host else (cpu, gpu)
        torch_copy = gbps(specs, use_triton=False, use_cudart=False)
        records.append(
            _throughput(f"{case} scattered copy engine (Tensor.copy_ runs)", torch_copy, reference)
        )
        if not host.pinned:
            return None, records
        triton = gbps(specs, use_triton=True)
        engine = speeds["scattered"]
        say(f"gpu: {case} scattered: triton {triton:.1f} GB/s, copy engine {engine:.1f} GB/s")
        records.append(
            throughput_record(
                "gpu",
                f"{case} scattered triton",
                "GB/s",
                triton,
                reference=engine,
                reference_name=COPY_ENGINE,
                unit="GB/s",
            )
        )
        records.append(
            _choice_record(kv, host, to_host, bridge, specs, case, triton, engine, settings)
        )
        return _PathSpeeds(page, triton, engine), records
    finally:
        bridge.close()


def _gbps(
    kv: CanonicalKV,
    host: HostSlots,
    to_host: bool,
    bridge: EventBridge,
    total: int,
    repeats: int,
    specs: tuple[Any, Any],
    **options: Any,
) -> float:
    handler = CudaCopyHandler(kv, host, to_host=to_host, bridge=bridge, **options)
    try:
        return total / _best(functools.partial(handler.execute, *specs), repeats) / 1e9
    finally:
        handler.close()


def _throughput(
    case: str, gbps: float, reference: float, target: float | None = None
) -> BenchRecord:
    return throughput_record(
        "gpu", case, "GB/s", gbps, reference=reference, reference_name=CONTIGUOUS,
        target=target, unit="GB/s",
    )  # fmt: skip


def _choice_record(
    kv: CanonicalKV,
    host: HostSlots,
    to_host: bool,
    bridge: EventBridge,
    specs: tuple[Any, Any],
    case: str,
    triton: float,
    engine: float,
    settings: _Settings,
) -> BenchRecord:
    """The path a default handler takes for this transfer, against the faster one."""
    handler = CudaCopyHandler(kv, host, to_host=to_host, bridge=bridge)
    chose_triton = handler.path_for(*specs) == "triton"
    handler.close()
    chosen = triton if chose_triton else engine
    return throughput_record(
        "gpu",
        f"{case} default path ({'triton' if chose_triton else 'copy engine'})",
        "GB/s",
        chosen,
        reference=max(triton, engine),
        reference_name=FASTER,
        target=settings.target(CHOICE_TARGET),
        unit="GB/s",
    )


def crossover(sizes: Sequence[int], triton: Sequence[float], engine: Sequence[float]) -> int | None:
    """The smallest size from which the copy engine is at least as fast as Triton at that
    size and every larger one (sizes ascending); None when Triton wins at the largest."""
    found = None
    for size, t, e in reversed(list(zip(sizes, triton, engine, strict=True))):
        if e < t:
            break
        found = size
    return found


def _crossover_record(
    direction: str, speeds: list[_PathSpeeds], say: Callable[[str], None]
) -> BenchRecord:
    size = crossover(
        [s.page for s in speeds], [s.triton for s in speeds], [s.engine for s in speeds]
    )
    text = "none (Triton wins at every size)" if size is None else f"from {_size(size)}"
    say(f"gpu: {direction} crossover, copy engine >= Triton: {text}")
    return BenchRecord(
        "gpu",
        f"{direction} crossover: copy engine >= Triton {text}",
        "page_bytes",
        float(size or 0),
        reference=float(DEFAULT_TRITON_THRESHOLD),
        reference_name=THRESHOLD,
        unit="B",
    )


# -- one transfer's latency ----------------------------------------------------------


def _latency_cases(settings: _Settings, say: Callable[[str], None]) -> list[BenchRecord]:
    """Small transfers, one at a time, as a load for one request waits for them: p50 over
    rounds of the time from the call to its return, ours through `CudaCopyHandler` (its
    default path; ``transfer`` awaited in an asyncio loop through the bridge, and the
    blocking ``execute``) against one ``Tensor.copy_`` of the same bytes followed by
    ``torch.cuda.synchronize()``, the rounds interleaved. No target: what a transfer costs
    beside its bytes (planning, the side stream, the wake-up)."""
    import torch

    rounds = settings.rounds if settings.quick else settings.rounds // 4
    page, most = LATENCY_PAGE, max(LATENCY_BLOCKS)
    records: list[BenchRecord] = []
    with _pinned_region(2 * most, page) as region:
        cache = torch.randint(0, 256, (2 * most, page), dtype=torch.uint8, device="cuda")
        kv = canonicalize({"cache": cache})
        host = HostSlots.from_region(region)
        rng = np.random.default_rng(7)
        bridge = EventBridge(name="bench-latency")
        try:
            for to_host, blocks in itertools.product((True, False), LATENCY_BLOCKS):
                gpu = GPUSpec.of(rng.permutation(2 * most)[:blocks])
                cpu = CPUSpec.of(rng.permutation(2 * most)[:blocks])
                handler = CudaCopyHandler(kv, host, to_host=to_host, bridge=bridge)
                try:
                    specs = (gpu, cpu) if to_host else (cpu, gpu)
                    path = handler.path_for(*specs)
                    device_flat = cache.view(-1)[: blocks * page]
                    host_flat = host.flat()[: blocks * page]
                    samples = _latency_rounds(
                        handler, specs, (device_flat, host_flat) if to_host else
                        (host_flat, device_flat), rounds,
                    )  # fmt: skip
                finally:
                    handler.close()
                case = f"{_direction(to_host)} {blocks} x {_size(page)} ({path})"
                ref50 = percentile(samples["bare"], 50)
                for how in ("awaited", "blocking"):
                    p50 = percentile(samples[how], 50)
                    say(f"gpu: latency {case} {how}: p50 {p50:.1f} us, one copy {ref50:.1f} us")
                    records.append(
                        latency_record(
                            "gpu", f"latency {case} {how} p50", "us", p50, reference=ref50,
                            reference_name=ONE_COPY, unit="us",
                        )
                    )  # fmt: skip
        finally:
            bridge.close()
    return records


def _latency_rounds(
    handler: CudaCopyHandler, specs: tuple[Any, Any], flats: tuple[Any, Any], rounds: int
) -> dict[str, list[float]]:
    """``rounds`` interleaved rounds of the three ways to move the same bytes (microseconds
    from the call to its return): ``awaited`` (``transfer`` in an asyncio loop), ``blocking``
    (``execute``) and ``bare`` (``Tensor.copy_`` of ``flats``, source to destination, then a
    device synchronize)."""
    import anyio
    import torch

    src, dst = flats

    def bare() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    async def measure() -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {"awaited": [], "blocking": [], "bare": []}
        for _ in range(rounds):
            began = time.perf_counter()
            with anyio.fail_after(10.0):
                await handler.transfer(*specs)
            samples["awaited"].append((time.perf_counter() - began) * 1e6)
            began = time.perf_counter()
            handler.execute(*specs)
            samples["blocking"].append((time.perf_counter() - began) * 1e6)
            began = time.perf_counter()
            bare()
            samples["bare"].append((time.perf_counter() - began) * 1e6)
        return samples

    bare()
    handler.execute(*specs)  # warm up: the kernel, the streams
    return anyio.run(measure, backend="asyncio")


# -- the event bridge ---------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``samples``, nearest rank."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = min(len(ordered), max(1, math.ceil(len(ordered) * q / 100)))
    return ordered[rank - 1]


def _launch() -> tuple[Any, Any, float]:
    """GPU work between two timing events (the second is the one to wait on), and the
    time just before the launch (the work cannot end before that plus its duration)."""
    import torch

    launched = time.perf_counter()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    torch.cuda._sleep(BRIDGE_SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    end.record()
    return start, end, launched


def _wake_us(start: Any, end: Any, launched: float, woke: float) -> float:
    gpu_ms: float = start.elapsed_time(end)
    return max(MIN_WAKE_US, (woke - launched - gpu_ms / 1e3) * 1e6)


@contextmanager
def _synchronizer(name: str) -> Iterator[Callable[[Any, Callable[[], object]], None]]:
    """A waiting thread: ``submit(event, then)`` has it call ``event.synchronize()``, then
    ``then()`` (in the thread). Stopped and joined on exit."""
    requests: queue.SimpleQueue[tuple[Any, Callable[[], object]] | None] = queue.SimpleQueue()

    def waiter() -> None:
        while (item := requests.get()) is not None:
            event, then = item
            event.synchronize()
            then()

    thread = threading.Thread(target=waiter, name=name, daemon=True)
    thread.start()
    try:
        yield lambda event, then: requests.put((event, then))
    finally:
        requests.put(None)
        thread.join(10.0)


def _reference_wakes(rounds: int) -> list[float]:
    """A bare ``synchronize()`` in a waiting thread: when does it return?"""
    replies: queue.SimpleQueue[float] = queue.SimpleQueue()
    samples = []
    with _synchronizer("kvtier-bench-sync") as submit:
        for _ in range(rounds):
            start, end, launched = _launch()
            submit(end, lambda: replies.put(time.perf_counter()))
            woke = replies.get(timeout=10.0)
            samples.append(_wake_us(start, end, launched, woke))
    return samples


def _floor_wakes(backend: str, rounds: int) -> list[float]:
    """The loop's own floor: the same bare ``synchronize()`` in a waiting thread, which then
    wakes a task through the backend's native cross-thread call (asyncio's
    ``call_soon_threadsafe`` setting a future, trio's ``run_sync_soon`` setting a
    ``trio.Event``), no anyio and no bridge. What a thread-based design cannot go below."""
    with _synchronizer("kvtier-bench-floor") as submit:
        if backend == "trio":
            import trio

            async def on_trio() -> list[float]:
                token = trio.lowlevel.current_trio_token()
                samples = []
                for _ in range(rounds):
                    start, end, launched = _launch()
                    done = trio.Event()
                    submit(end, functools.partial(token.run_sync_soon, done.set))
                    with trio.fail_after(10.0):
                        await done.wait()
                    samples.append(_wake_us(start, end, launched, time.perf_counter()))
                return samples

            return trio.run(on_trio)

        async def on_asyncio() -> list[float]:
            loop = asyncio.get_running_loop()
            samples = []
            for _ in range(rounds):
                start, end, launched = _launch()
                future: asyncio.Future[None] = loop.create_future()
                submit(end, functools.partial(loop.call_soon_threadsafe, future.set_result, None))
                async with asyncio.timeout(10.0):
                    await future
                samples.append(_wake_us(start, end, launched, time.perf_counter()))
            return samples

        loop_factory = None
        if backend == UVLOOP:
            import uvloop

            loop_factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(on_asyncio())


def _bridge_wakes(strategy: BridgeStrategy, backend: str, rounds: int) -> list[float]:
    import anyio

    bridge = EventBridge(strategy, name="bench")

    async def measure() -> list[float]:
        samples = []
        for _ in range(rounds):
            start, end, launched = _launch()
            with anyio.fail_after(10.0):
                await bridge.wait(end)
            samples.append(_wake_us(start, end, launched, time.perf_counter()))
        return samples

    try:
        if backend == UVLOOP:
            return anyio.run(measure, backend="asyncio", backend_options={"use_uvloop": True})
        return anyio.run(measure, backend=backend)
    finally:
        bridge.close()
        bridge.join(10.0)


def _backends() -> list[str]:
    """asyncio; asyncio on uvloop's loop (as vLLM's API server runs) and trio when they are
    installed."""
    found = ["asyncio"]
    for name, module in ((UVLOOP, "uvloop"), ("trio", "trio")):
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        found.append(name)
    return found


def _bridge_cases(settings: _Settings, say: Callable[[str], None]) -> list[BenchRecord]:
    import torch

    torch.cuda.synchronize()
    _reference_wakes(10)  # warm up: the thread, the events, the sleep kernel
    reference = _reference_wakes(settings.rounds)
    ref50, ref99 = percentile(reference, 50), percentile(reference, 99)
    say(f"gpu: bare synchronize in a thread: wake p50 {ref50:.1f} us, p99 {ref99:.1f} us")
    records = []
    for backend in _backends():
        floor = _floor_wakes(backend, settings.rounds)
        floor50, floor99 = percentile(floor, 50), percentile(floor, 99)
        say(f"gpu: loop floor ({backend}): wake p50 {floor50:.1f} us, p99 {floor99:.1f} us")
        records += [
            latency_record(
                "gpu", f"loop floor ({backend}) p{q}", "wake_us", value, reference=ref,
                reference_name=SYNCHRONIZE, unit="us",
            )
            for q, value, ref in ((50, floor50, ref50), (99, floor99, ref99))
        ]  # fmt: skip
        records.append(
            latency_record(
                "gpu", f"loop floor ({backend}) p99 budget", "wake_us", floor99,
                reference=BRIDGE_P99_BUDGET_US, reference_name=BUDGET, unit="us",
            )
        )  # fmt: skip
        for strategy in (BridgeStrategy.THREAD, BridgeStrategy.POLL):
            ours = _bridge_wakes(strategy, backend, settings.rounds)
            p50, p99 = percentile(ours, 50), percentile(ours, 99)
            case = f"bridge {strategy.value} ({backend})"
            say(f"gpu: {case}: wake p50 {p50:.1f} us, p99 {p99:.1f} us")
            records += [
                latency_record(
                    "gpu", f"{case} p50", "wake_us", p50, reference=ref50,
                    reference_name=SYNCHRONIZE, unit="us",
                ),
                latency_record(
                    "gpu", f"{case} p99 vs floor", "wake_us", p99, reference=floor99,
                    reference_name=f"{FLOOR} ({backend})", unit="us",
                ),
                latency_record(
                    "gpu", f"{case} p99", "wake_us", p99, reference=ref99,
                    reference_name=SYNCHRONIZE, unit="us",
                ),
                latency_record(
                    "gpu", f"{case} p99 budget", "wake_us", p99,
                    reference=BRIDGE_P99_BUDGET_US, reference_name=BUDGET,
                    target=settings.target(1.0), unit="us",
                ),
            ]  # fmt: skip
    return records


# -- helpers ------------------------------------------------------------------------


def _best(fn: Callable[[], object], repeats: int) -> float:
    import torch

    fn()  # warm up (and compile the kernel)
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


def _direction(to_host: bool) -> str:
    return "D2H" if to_host else "H2D"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
