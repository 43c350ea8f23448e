"""What the fs benchmark's disk cases (`kvtier_async.bench.fs`) and tmpfs cases
(`kvtier_async.bench.fs_tmpfs`) share: the timing of a phase, the figures of the repetitions,
our tier driven as the engine's lane drives it (`run_ours`), vLLM 0.33's fs tier (`VllmFs`),
the filled CPU region the blocks come from, and where a directory is mounted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import resource
import shutil
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from kvtier_async._mounts import mount
from kvtier_async.ledger import make_offload_key
from kvtier_async.memory import SharedRegion
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.checksum import checksum
from kvtier_async.tiers.fs import DEFAULT_READ_WORKERS, DEFAULT_WRITE_WORKERS, FsTier

__all__ = [
    "GB",
    "JOB_BLOCKS",
    "STREAMS",
    "OursNotes",
    "Phase",
    "Samples",
    "VllmFs",
    "expected_checksums",
    "filled_region",
    "fs_type",
    "mount",
    "notes",
    "random_keys",
    "run_ours",
    "sample",
    "size_label",
    "stopwatch",
    "verify_loaded",
]

STREAMS = 16  # dd processes; vLLM threads each way (its defaults)
JOB_BLOCKS = 16  # blocks per store / load call (one engine job)
GB = 1e9


@dataclass(frozen=True)
class Phase:
    """One store or load phase: wall seconds, and this process's CPU seconds (all threads;
    None for ``dd``, which runs in other processes)."""

    seconds: float
    cpu: float | None = None


@contextlib.contextmanager
def stopwatch(phase: list[Phase]) -> Iterator[None]:
    """Append the wall and process CPU time of the ``with`` body to ``phase``."""
    started, cpu = time.perf_counter(), _cpu_seconds()
    yield
    phase.append(Phase(time.perf_counter() - started, _cpu_seconds() - cpu))


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (microsecond resolution)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Samples:
    """Each side's figures (GB/s, CPU seconds per GB) over the repetitions, by name."""

    values: dict[str, list[float]]

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])

    def add_round(self, figures: Mapping[str, tuple[Phase, Phase]], gigabytes: float) -> None:
        """One round's figures: per side and direction its GB/s, and its CPU seconds per GB
        where they were measured (not for ``dd``)."""
        for name, phases in figures.items():
            for direction, phase in zip(("store", "load"), phases, strict=True):
                self.add(f"{name} {direction}", gigabytes / phase.seconds)
                if phase.cpu is not None:
                    self.add(f"{name} {direction} cpu", phase.cpu / gigabytes)


# -- ours ------------------------------------------------------------------------------------


@dataclass
class OursNotes:
    """What the last run of ours saw: the tier's ``detail`` and our files' page-cache bytes."""

    detail: str = ""
    cached_bytes: int = -1


notes = OursNotes()


async def run_ours(
    directory: str, region: SharedRegion, keys: Sequence[bytes], memory: bool = False
) -> tuple[Phase, Phase]:
    """Store then load every block with our tier; ``memory``: on tmpfs (no sync, no page
    cache check)."""
    ctx = TierContext(block_bytes=region.slot_bytes)
    tier = FsTier("bench", ctx, DEFAULT_READ_WORKERS, DEFAULT_WRITE_WORKERS, root_dir=directory)
    await tier.open()
    try:
        views = [region.slot_view(i) for i in range(len(keys))]
        store = await _drive(tier.store, keys, views, tier.write_workers)
        if not memory:
            await anyio.to_thread.run_sync(os.sync)
            notes.cached_bytes = await anyio.to_thread.run_sync(_cached_bytes, directory)
        _scribble(views)
        load = await _drive(tier.load, keys, views, tier.read_workers)
        notes.detail = tier.statistics().detail
        del views
    finally:
        await tier.aclose()
    return store, load


async def _drive(
    call: Callable[[Sequence[bytes], Sequence[memoryview]], Any],
    keys: Sequence[bytes],
    views: Sequence[memoryview],
    tasks: int,
) -> Phase:
    """Time for ``tasks`` tasks to push every job of JOB_BLOCKS blocks through ``call``."""
    jobs = iter(range(0, len(keys), JOB_BLOCKS))
    failures: list[int] = []

    async def worker() -> None:
        for start in jobs:
            stop = start + JOB_BLOCKS
            ok = await call(keys[start:stop], views[start:stop])
            failures.extend(i for i, good in enumerate(ok, start) if not good)

    phase: list[Phase] = []
    with stopwatch(phase):
        async with anyio.create_task_group() as tg:
            for _ in range(tasks):
                tg.start_soon(worker)
    if failures:
        raise RuntimeError(f"fs bench: {len(failures)} blocks failed, first {failures[0]}")
    return phase[0]


def _cached_bytes(directory: str) -> int:
    """Bytes of the ``.bin`` files under ``directory`` resident in the page cache (fincore);
    -1 when ``fincore`` is unavailable."""
    files = [
        os.path.join(d, name) for d, _, names in os.walk(directory) for name in names
        if name.endswith(".bin")
    ][:512]  # fmt: skip
    if not files or shutil.which("fincore") is None:
        return -1
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
        capture_output=True,
        text=True,
        check=False,
    )
    return sum(int(v) for v in out.stdout.split() if v.isdigit())


# -- vLLM ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmFs:
    """vLLM 0.33's fs tier (its ``io`` module in a ``DualQueueThreadPool``), when it imports:
    `load`, then `measure` in a directory."""

    io: Any
    pool_type: Any
    name: str

    @classmethod
    def load(cls) -> VllmFs | None:
        try:
            from vllm.v1.kv_offload.tiering.fs import io
            from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool
        except ImportError:
            return None
        path = "C fs_io_C" if io._HAS_FSIO_C else "Python, fs_io_C unavailable"
        name = f"vllm-0.33 tiering/fs io.py ({path}) + DualQueueThreadPool({STREAMS},{STREAMS})"
        return cls(io, DualQueueThreadPool, name)

    def measure(
        self, directory: str, region: SharedRegion, keys: Sequence[bytes]
    ) -> tuple[Phase, Phase]:
        direct = bool(self.io.probe_o_direct(directory))
        view = region.rows.cast("B")
        row = region.row_bytes
        jobs = [
            ([_vllm_path(directory, k) for k in keys[s : s + JOB_BLOCKS]],
             [i * row for i in range(s, min(s + JOB_BLOCKS, len(keys)))])
            for s in range(0, len(keys), JOB_BLOCKS)
        ]  # fmt: skip
        pool = self.pool_type(STREAMS, STREAMS, thread_name_prefix="bench_vllm_fs")
        try:
            store = functools.partial(self.io.batch_store_block, block_size=region.slot_bytes)
            write = _run_pool(pool, pool.enqueue_store, store, view, jobs, direct)
            os.sync()
            load = functools.partial(self.io.batch_load_block, block_size=region.slot_bytes)
            read = _run_pool(pool, pool.enqueue_load, load, view, jobs, direct)
        finally:
            pool.shutdown(wait=True)
            view.release()
        return write, read


def _vllm_path(directory: str, key: bytes) -> str:
    """vLLM's FileMapper layout: ``<base>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``."""
    hash_hex, group = key[:-4].hex(), int.from_bytes(key[-4:], "big")
    return (
        f"{directory}/model_000000000000_r0/{hash_hex[:3]}/{hash_hex[3:5]}_g{group}/{hash_hex}.bin"
    )


def _run_pool(
    pool: Any,
    enqueue: Callable[..., None],
    fn: Callable[..., None],
    view: memoryview,
    jobs: Sequence[tuple[list[str], list[int]]],
    direct: bool,
) -> Phase:
    phase: list[Phase] = []
    with stopwatch(phase):
        for job_id, (paths, offsets) in enumerate(jobs):
            task = functools.partial(fn, paths, view, offsets, use_o_direct=direct)
            enqueue(job_id, 1, [task])
        pool.wait_idle()
    failed = [job for job, ok, _t in pool.get_finished() if not ok]
    if failed:
        raise RuntimeError(f"fs bench: vLLM jobs failed: {failed[:5]}")
    return phase[0]


# -- helpers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def filled_region(count: int, block_bytes: int) -> Iterator[SharedRegion]:
    """A new region of ``count`` slots of ``block_bytes``, each filled with random bytes and
    its index first (every block differs); closed at the end."""
    region = SharedRegion(f"bench-fs-{uuid.uuid4().hex[:12]}", count, block_bytes)
    try:
        pattern = random.randbytes(1 << 20)
        for i in range(count):
            view = region.slot_view(i)
            for offset in range(0, block_bytes, len(pattern)):
                chunk = min(len(pattern), block_bytes - offset)
                view[offset : offset + chunk] = pattern[:chunk]
            view[:8] = i.to_bytes(8, "little")  # every block differs
            del view
        yield region
    finally:
        region.close()


def _scribble(views: Sequence[memoryview]) -> None:
    """Overwrite each block's first bytes, so a load that did nothing fails the check."""
    for view in views:
        view[:8] = b"\xff" * 8


def random_keys(count: int) -> list[bytes]:
    """``count`` offload keys of random block hashes (group 0)."""
    return [make_offload_key(random.randbytes(32), 0) for _ in range(count)]


def sample(count: int) -> list[int]:
    """The slots a load check compares: the first, the last and up to 64 at random."""
    return sorted({0, count - 1, *random.sample(range(count), min(count, 64))})


def expected_checksums(region: SharedRegion, count: int) -> dict[int, int]:
    """The checksums of a `sample` of the region's ``count`` slots, taken before a store."""
    return {i: checksum(region.slot_view(i)) for i in sample(count)}


def verify_loaded(region: SharedRegion, expected: Mapping[int, int]) -> None:
    """Right after a load: the sampled slots hold what was stored (else RuntimeError)."""
    bad = [i for i, value in expected.items() if checksum(region.slot_view(i)) != value]
    if bad:
        raise RuntimeError(f"fs bench: loaded blocks differ from stored ones: slots {bad[:5]}")


def size_label(block_bytes: int) -> str:
    """A block size as the case names write it: ``256KiB``, ``2MiB``."""
    return f"{block_bytes >> 20}MiB" if block_bytes >= 1 << 20 else f"{block_bytes >> 10}KiB"


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path``."""
    return mount(path)[1]
