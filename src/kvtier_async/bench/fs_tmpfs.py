"""Benchmark ``fs``, its tmpfs cases: the fs tier where the disk is not the ceiling.

On a disk, vLLM's fs tier already runs at the device's limit, so a ratio against it says
little. Here the root is a fresh 0700 directory under /dev/shm (tmpfs, removed after the run),
where every store and load is a page-cache copy: the figures measure the software alone. For
each block size (256 KiB, 2 MiB), about 1 GiB of blocks (``quick``: 128 MiB) moves between a
shared CPU region and the tmpfs directory, four ways in the same run, in an order rotated each
repetition (the median of `fs.REPEATS`, after one unmeasured warm-up round: the first writes
into memory this VM has not handed out yet cost several times more):

- ours, native: `FsTier` on its default path (the C helper), driven as in the disk cases;
- ours, python: the same tier on its Python path (what ``KVTIER_NATIVE_FS=0`` selects; the
  variable is read once per process, so the bench swaps the seam the tests use);
- vLLM 0.33's fs tier (``tiering/fs/io.py`` in its ``DualQueueThreadPool``, as on the disk);
- memcpy: one numpy copy of the same bytes between the region and a prefaulted buffer, in one
  thread: the floor, printed as the reference of a line of its own.

Our loads verify every byte (the tier checks each block's CRC-32C; vLLM checks nothing), and a
sample of slots is compared with what was stored right after each of our load phases. tmpfs
has no device for O_DIRECT to bypass: the tier takes its buffered path there
(``io=buffered(tmpfs)``), and the run fails if it does not. Figures are payload GB/s (1 GB =
1e9 bytes) and the CPU seconds the process spent per GB (all threads); on a CPU-bound path the
second is what the first is made of. The GB/s target against vLLM (`TMPFS_TARGET`) is judged on
the default (native) path; the Python path's rows are for information.

*Where the time goes* (the 2-core dev VM, Xeon with AVX-512; perf with cpu-clock samples, and
plain C loops of the same system calls on one core; CPU seconds per GB):

- The kernel's copy is the floor, and most of both sides' time: a new tmpfs file written
  (open, pwrite, close, rename: page allocation, memcg charge, copy) costs 0.33 in a C loop
  (3 GB/s on a core), a tmpfs read (a page-cache lookup and ``copy_to_user`` per 4 KiB page)
  0.245 (4.1 GB/s), a memcpy of the same bytes 0.09 (11 GB/s). It is 65-75% of our samples
  and 82-93% of vLLM's, whose Python is 4-13%: vLLM's loads, and its 2 MiB stores, run within
  10-40% of that floor (0.31-0.37 and 0.47-0.50 in the runs), so 1.5x its GB/s there would
  take less CPU than the kernel's copy alone, whatever our code does. Only 256 KiB stores,
  where vLLM's Python per block shows (0.65-0.77), leave room.
- Ours beyond the floor: the CRC-32C that verifies every byte (vLLM verifies nothing) was
  0.07-0.11 (three CRC streams; a 2 MiB block had left the core's cache by the time of its
  check) and is 0.02-0.04 now: VPCLMULQDQ folding (49 against 15 GB/s on a block in cache),
  and buffered I/O in 256 KiB pieces, each checksummed right after the kernel's copy (a 2 MiB
  read and check in a C loop: 0.24-0.26, the bare read's cost, against 0.29-0.33 for read,
  then check). The Python and anyio work of a job of 16 blocks, as the engine drives it:
  about 100 us in the event loop and 150 us in the worker thread with nothing else running
  (17 us a block: 0.07 at 256 KiB, 0.01 at 2 MiB), 17-26% of our samples under load, where
  the GIL is contended. Thread hand-offs (futex, scheduling): 5-7%. Directories and names
  (mkdir, open, rename): about 8% of a store, as for vLLM.
- On a busy machine the GB/s also depend on how many cores each side wins from the other
  processes: with two other busy processes our C pool held 0.6-0.7 cores on 2 MiB loads
  against vLLM's 1.0-1.2 at the same CPU per GB, while on a quiet machine it held both cores
  and led vLLM (2 MiB, 1 GiB, three rounds: loads 5.3 against 4.7 GB/s, stores 3.9 against
  3.6). The CPU per GB is the steadier figure.
- Not taken: reading through ``mmap`` (MAP_POPULATE, a copy with the check fused in) costs
  0.21 against read's 0.245 in a C loop, but a file truncated under the mapping would kill
  the serving process with SIGBUS.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence

import anyio
import numpy as np

from kvtier_async.memory import SharedRegion
from kvtier_async.tiers.fs import files as fs_files

from .fs_kit import (
    GB,
    Phase,
    Samples,
    VllmFs,
    expected_checksums,
    filled_region,
    fs_type,
    notes,
    random_keys,
    run_ours,
    size_label,
    stopwatch,
    verify_loaded,
)
from .report import BenchRecord, latency_record, throughput_record

__all__ = ["MEMCPY_NAME", "TMPFS_BASE", "TMPFS_TARGET", "run_tmpfs"]

TMPFS_BASE = "/dev/shm"
TMPFS_TARGET = 1.5
MEMCPY_NAME = "memcpy of the same bytes (numpy copy, one thread)"
_PATHS = {"ours": "", "python": " python path"}  # our sides, and how their rows are named

Sides = dict[str, Callable[[str], tuple[Phase, Phase]]]


def run_tmpfs(
    block_sizes: Sequence[int],
    total: int,
    repeats: int,
    *,
    vllm: VllmFs | None,
    note: Callable[[str], None],
) -> list[BenchRecord]:
    """The tmpfs cases of each block size: ``total`` bytes of blocks moved each way in each of
    ``repeats`` repetitions (1: a quick run, without the warm-up round)."""
    records: list[BenchRecord] = []
    with _tmpfs_workdir() as workdir:
        note(f"fs tmpfs: working in {workdir} ({fs_type(workdir)})")
        for block_bytes in block_sizes:
            records += _run_size(workdir, block_bytes, total, repeats, vllm, note)
    return records


def _run_size(
    workdir: str,
    block_bytes: int,
    total: int,
    repeats: int,
    vllm: VllmFs | None,
    note: Callable[[str], None],
) -> list[BenchRecord]:
    count = total // block_bytes
    label = size_label(block_bytes)
    samples = Samples({})
    gigabytes = count * block_bytes / GB
    with filled_region(count, block_bytes) as region:
        keys, expected = random_keys(count), expected_checksums(region, count)
        floor = np.ones(count * block_bytes, dtype=np.uint8)  # prefaulted
        sides = _sides(region, keys, expected, floor, vllm, note)
        for rep in range(0 if repeats == 1 else -1, repeats):  # -1: the warm-up round
            note(f"fs tmpfs: {label} {'warm-up' if rep < 0 else f'repetition {rep + 1}'}")
            figures = _one_round(workdir, sides, rep)
            if rep < 0:
                continue
            samples.add_round(figures, gigabytes)
            note(f"fs tmpfs: {label} " + _summary(figures, gigabytes))
        del floor
    return _records(label, samples, vllm)


def _sides(
    region: SharedRegion,
    keys: Sequence[bytes],
    expected: dict[int, int],
    floor: np.ndarray,
    vllm: VllmFs | None,
    note: Callable[[str], None],
) -> Sides:
    def ours(directory: str, *, python: bool = False) -> tuple[Phase, Phase]:
        with fs_files.python_io() if python else contextlib.nullcontext():
            phases = anyio.run(run_ours, directory, region, keys, True)
        _check(region, expected, note)
        return phases

    sides: Sides = {
        "ours": ours,
        "python": functools.partial(ours, python=True),
        "memcpy": lambda _directory: _memcpy(region, floor),
    }
    if vllm is not None:
        sides["vllm"] = lambda directory: vllm.measure(directory, region, keys)
    return sides


def _one_round(workdir: str, sides: Sides, rep: int) -> dict[str, tuple[Phase, Phase]]:
    """Each side once, in an order rotated by ``rep``, each in a fresh directory removed
    right after it (tmpfs holds the files in memory)."""
    names = list(sides)
    names = names[rep % len(names) :] + names[: rep % len(names)]
    figures = {}
    for name in names:
        directory = tempfile.mkdtemp(prefix=f"{name}-", dir=workdir)
        try:
            figures[name] = sides[name](directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return figures


def _summary(figures: dict[str, tuple[Phase, Phase]], gigabytes: float) -> str:
    """``name store/load GB/s (CPU s/GB store/load)`` for each side."""
    parts = []
    for name, (w, r) in figures.items():
        cpu = f" ({(w.cpu or 0) / gigabytes:.2f}/{(r.cpu or 0) / gigabytes:.2f} cpu-s/GB)"
        parts.append(f"{name} {gigabytes / w.seconds:.2f}/{gigabytes / r.seconds:.2f}{cpu}")
    return "GB/s store/load: " + ", ".join(parts)


def _records(label: str, samples: Samples, vllm: VllmFs | None) -> list[BenchRecord]:
    records = []
    for direction in ("store", "load"):
        case = f"{direction} {label} tmpfs"
        for side, suffix in _PATHS.items():
            ours = samples.median(f"{side} {direction}")
            cpu = samples.median(f"{side} {direction} cpu")
            if vllm is not None:
                records.append(throughput_record(
                    "fs", f"{case}{suffix} vs vllm", "GB/s", ours,
                    reference=samples.median(f"vllm {direction}"), reference_name=vllm.name,
                    target=TMPFS_TARGET if side == "ours" else None,
                ))  # fmt: skip
                records.append(latency_record(
                    "fs", f"{case}{suffix} CPU vs vllm", "core-s/GB", cpu,
                    reference=samples.median(f"vllm {direction} cpu"), reference_name=vllm.name,
                ))  # fmt: skip
            records.append(throughput_record(
                "fs", f"{case}{suffix} vs memcpy", "GB/s", ours,
                reference=samples.median(f"memcpy {direction}"), reference_name=MEMCPY_NAME,
            ))  # fmt: skip
    return records


# -- sides -----------------------------------------------------------------------------------


def _check(region: SharedRegion, expected: dict[int, int], note: Callable[[str], None]) -> None:
    """Right after our load: the sampled slots hold what was stored, and the tier ran
    buffered, saying why."""
    verify_loaded(region, expected)
    detail = notes.detail
    if "io=buffered(tmpfs)" not in detail:
        raise RuntimeError(f"fs bench: the tier did not take its buffered path on tmpfs: {detail}")
    note(f"fs tmpfs: ours: {detail}")


def _memcpy(region: SharedRegion, floor: np.ndarray) -> tuple[Phase, Phase]:
    """One copy of the blocks' bytes into ``floor`` (as a store) and one back (as a load)."""
    view = region.rows.cast("B")
    try:
        slots = np.frombuffer(view, dtype=np.uint8, count=floor.nbytes)
        phases: list[Phase] = []
        with stopwatch(phases):
            np.copyto(floor, slots)
        with stopwatch(phases):
            np.copyto(slots, floor)
        del slots
    finally:
        view.release()
    return phases[0], phases[1]


@contextlib.contextmanager
def _tmpfs_workdir() -> Iterator[str]:
    """A fresh private directory on tmpfs (``mkdtemp``: mode 0700), removed at the end."""
    path = tempfile.mkdtemp(prefix="kvtier-bench-fs-tmpfs-", dir=TMPFS_BASE)
    try:
        if fs_type(path) != "tmpfs":
            raise RuntimeError(f"fs bench: {TMPFS_BASE} is {fs_type(path)}, not tmpfs")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
