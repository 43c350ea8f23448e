"""Benchmark ``engine``: the cost of the job machinery, and the scheduler thread's calm.

``overhead`` (per anyio backend): no-op jobs through the full path (submit, queue, worker,
completion, handle resolved) next to a bare anyio round trip (memory-object-stream send +
receive + ``Event.set``) measured in the same run: jobs per second with a full pipeline, and
submit-to-complete latency of one job at a time (p50, p99).

``sched_thread``: a synchronous owner on its own thread (as vLLM's scheduler) drives the
engine through `ThreadedEngine` and a `TaskRunner` while a secondary tier's lookups take
100 ms: the p99 of its lookup, submit and poll calls, against the 50 us budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from kvtier_async.engine import Engine, Job, JobResult, TaskRunner, ThreadedEngine
from kvtier_async.ledger import JobKind, PrimaryLedger, TieringLedger, make_offload_key
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.memory import MemoryTier

from .report import BenchRecord, latency_record, throughput_record

__all__ = ["run"]

BARE = "bare anyio round trip (stream send+receive+Event.set)"
DEPTH = 256


@dataclass(frozen=True)
class _Figures:
    rate: float  # jobs per second, pipelined
    p50_us: float
    p99_us: float


def _percentiles(samples: Sequence[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] * 1e6, ordered[int(len(ordered) * 0.99)] * 1e6


# --- the engine's path ------------------------------------------------------------------


async def _engine_figures(n_rate: int, n_latency: int) -> _Figures:
    ok = (True,)

    async def noop(job: Job) -> tuple[Sequence[bool], int]:
        return ok, 0

    done = anyio.Event()
    count = [0]

    def finished(_result: JobResult) -> None:
        count[0] += 1
        if count[0] == n_rate:
            done.set()

    async with Engine(
        [], _no_memory, device=noop, device_workers=1, queue_depth=DEPTH, on_result=finished
    ) as eng:
        keys = (b"k" * 12,)
        start = time.perf_counter()
        for _ in range(n_rate):
            await eng.submit(Job(JobKind.STORE, keys))
        await done.wait()
        rate = n_rate / (time.perf_counter() - start)
        samples = []
        for _ in range(n_latency):
            t0 = time.perf_counter()
            await eng.submit_nowait(Job(JobKind.STORE, keys))  # submit, await the handle
            samples.append(time.perf_counter() - t0)
    return _Figures(rate, *_percentiles(samples))


def _no_memory(_slot: int) -> memoryview:
    return memoryview(b"")


# --- the bare reference -----------------------------------------------------------------


class _Item:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = anyio.Event()


async def _bare_figures(n_rate: int, n_latency: int) -> _Figures:
    send, receive = anyio.create_memory_object_stream[_Item](DEPTH)

    async def consumer() -> None:
        async with receive:
            async for item in receive:
                item.event.set()

    async with anyio.create_task_group() as tg, send:
        tg.start_soon(consumer)
        items = []
        start = time.perf_counter()
        for _ in range(n_rate):
            item = _Item()
            items.append(item)
            await send.send(item)
        await items[-1].event.wait()
        rate = n_rate / (time.perf_counter() - start)
        samples = []
        for _ in range(n_latency):
            t0 = time.perf_counter()
            item = _Item()
            await send.send(item)
            await item.event.wait()
            samples.append(time.perf_counter() - t0)
    return _Figures(rate, *_percentiles(samples))


def _overhead(backend: str, n_rate: int, n_latency: int) -> list[BenchRecord]:
    best_ours = max(
        (anyio.run(_engine_figures, n_rate, n_latency, backend=backend) for _ in range(3)),
        key=lambda f: f.rate,
    )
    best_bare = max(
        (anyio.run(_bare_figures, n_rate, n_latency, backend=backend) for _ in range(3)),
        key=lambda f: f.rate,
    )
    case = f"overhead-{backend}"
    return [
        throughput_record(
            "engine",
            case,
            "jobs_per_s",
            best_ours.rate,
            reference=best_bare.rate,
            reference_name=BARE,
            target=0.5,
            unit="jobs/s",
        ),
        throughput_record(
            "engine",
            case,
            "jobs_per_s_floor",
            best_ours.rate,
            reference=50_000.0,
            reference_name="required floor",
            target=1.0,
            unit="jobs/s",
        ),
        latency_record(
            "engine",
            case,
            "p50_latency_us",
            best_ours.p50_us,
            reference=best_bare.p50_us,
            reference_name=BARE,
            unit="us",
        ),
        latency_record(
            "engine",
            case,
            "p99_latency_us",
            best_ours.p99_us,
            reference=1000.0,
            reference_name="required ceiling (1 ms)",
            target=1.0,
            unit="us",
        ),
    ]


# --- the scheduler thread ---------------------------------------------------------------


def _sched_thread(steps: int) -> list[BenchRecord]:
    tier = MemoryTier("slow", TierContext(block_bytes=4096), lookup_latency_s=0.1)
    ledger = TieringLedger(PrimaryLedger(1024), ["slow"])
    memory = bytearray(4096)
    timings: dict[str, list[float]] = {
        "lookup": [],
        "take_tasks": [],
        "submit": [],
        "poll": [],
        "wake": [],
    }

    def make() -> Engine:
        return Engine([tier], lambda slot: memoryview(memory))

    runner = TaskRunner(ledger, [tier])
    with ThreadedEngine(make) as threaded:
        for step in range(steps):
            _one_step(step, runner, threaded, timings)
        threaded.drain(timeout_s=30)
    return [
        latency_record(
            "engine",
            "sched_thread",
            f"{name}_p99_us",
            _percentiles(samples)[1],
            reference=50.0,
            reference_name="required ceiling (50 us)",
            target=1.0,
            unit="us",
        )
        for name, samples in timings.items()
    ]


def _one_step(
    step: int, runner: TaskRunner, threaded: ThreadedEngine, timings: dict[str, list[float]]
) -> None:
    clock, ledger = time.perf_counter, runner.ledger
    req = f"req{step}"
    for i in range(4):
        key = make_offload_key(step.to_bytes(8, "big"), i)
        t0 = clock()
        ledger.lookup(key, req)
        timings["lookup"].append(clock() - t0)
    t0 = clock()
    tasks = ledger.take_tasks()
    timings["take_tasks"].append(clock() - t0)
    t0 = clock()
    threaded.submit(runner.jobs(tasks), wake=False)
    timings["submit"].append(clock() - t0)
    t0 = clock()
    runner.collect(threaded.poll())
    timings["poll"].append(clock() - t0)
    ledger.request_finished(req)
    t0 = clock()
    threaded.wake()  # end of the step: the scheduler is about to wait for the model
    timings["wake"].append(clock() - t0)
    time.sleep(0.001)  # the model's forward pass: the scheduler thread waits


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    say = progress or (lambda _msg: None)
    n_rate, n_latency = (5_000, 1_000) if quick else (50_000, 5_000)
    records: list[BenchRecord] = []
    for backend in ("asyncio", "trio"):
        say(f"engine: overhead on {backend}")
        records += _overhead(backend, n_rate, n_latency)
    say("engine: scheduler thread against a 100 ms tier")
    records += _sched_thread(500 if quick else 3000)
    return records
