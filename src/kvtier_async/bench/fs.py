"""Benchmark ``fs``: the fs tier's store and load GB/s against parallel ``dd`` and vLLM's fs tier,
on the disk (this module) and on tmpfs, where the disk is not the ceiling
(`kvtier_async.bench.fs_tmpfs`, with a memcpy floor). A ``quick`` run gives no verdicts.

For each block size (256 KiB, 2 MiB), about 1 GiB of blocks (``quick``: 128 MiB) moves between
a shared CPU region in /dev/shm and a fresh directory on the real disk (``/var/tmp``, or
``$KVTIER_BENCH_DIR``; never a tmpfs), three ways, in the same run:

- ours: `FsTier` with its default workers (`DEFAULT_READ_WORKERS` readers,
  `DEFAULT_WRITE_WORKERS` writers), driven as the engine's lane does: as many tasks as the
  tier has workers that way, each awaiting ``store`` / ``load`` of jobs of `JOB_BLOCKS` blocks.
- ``dd``: 16 parallel ``dd`` processes, ``oflag=direct`` / ``iflag=direct``, same block size
  and total, one file each: the disk's sequential direct-I/O ceiling (no file creation).
- vLLM 0.33 (when importable): ``tiering/fs/io.py``'s ``batch_store_block`` /
  ``batch_load_block`` run by its ``DualQueueThreadPool(16, 16)``, one task per job of
  `JOB_BLOCKS` blocks, as ``FileSystemTierManager.submit_store`` / ``submit_load`` enqueue
  them, with its own ``probe_o_direct`` and file layout. Its C extension ``fs_io_C`` is used
  when it loads (the report says which).

The three alternate within each repetition (rotating who goes first), and each figure is the
median of `REPEATS` (a noisy virtual disk, shared with other processes). Every write phase
ends with ``sync()`` outside the timing. Files are not deleted until the run ends: after a
block size they are truncated to free the space, keeping their inodes, because on ext4
without a journal (this project's dev VM) the kernel then skips every inode deleted in the
last 60-360 s on each file creation (``recently_deleted()`` in ``fs/ext4/ialloc.c``; perf
showed it taking 40% of the CPU), which halves any one-file-per-block store for minutes
after a mass delete while ``dd`` is untouched. The run says so when it finds such a file
system; nothing else should delete many files there shortly before. Loads are checked
byte for byte on a sample of blocks, and ``fincore`` checks that our files are not in the page
cache after the store phase (O_DIRECT really used). Figures are payload bytes per second
(1 GB = 1e9 bytes). Next to vLLM, the CPU each side's process spent per GB moved (user +
system, all threads, ``getrusage``) is reported too ("CPU vs vllm", ratio above 1: we used
less): on a small VM the file system's metadata work and the checksums compete for the same
cores, so this is what a store or load costs the serving process beside its speed.

Changes measured with it (2 vCPUs, virtio ext4 without a journal, 256 KiB stores unless
said): the C batch path (`kvtier_async.tiers.fs.native`) took stores from 0.55-0.74x to
0.97-1.13x of ``dd`` and from 0.87x to 1.21-1.27x of vLLM in settled runs; 32 writers
against 16: at or above in two of three A/B runs; CRC-32C in three streams: 18 GB/s instead
of 7 (CPU per GB only); pre-creating the 4096 top-level directories, O_TMPFILE + ``linkat``
instead of a named temporary + ``rename``, 64 writers or 32-64 readers: no gain beyond the
run-to-run noise. A C thread pool per tier instead of one worker-thread call per 4 MiB
chunk (A/B, six alternating runs each, 1 GiB): 2 MiB loads 0.19 instead of 0.27 core-s/GB,
2 MiB stores 0.30 instead of 0.43, 256 KiB unchanged in CPU; GB/s the same within the noise.
Loads stay at 0.90-1.0x of vLLM's, which already reads at this disk's ceiling; the CPU
beyond vLLM's is mostly the CRC check vLLM does not make, which runs at this VM's memory
read speed when cold (15 GB/s against 13 for a plain summing pass), so a faster CRC would
not lower it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import anyio

from kvtier_async.memory import SharedRegion

from .fs_kit import (
    GB,
    JOB_BLOCKS,
    STREAMS,
    Phase,
    Samples,
    VllmFs,
    expected_checksums,
    filled_region,
    fs_type,
    mount,
    notes,
    random_keys,
    run_ours,
    size_label,
    verify_loaded,
)
from .fs_tmpfs import run_tmpfs
from .report import BenchRecord, as_quick, latency_record, throughput_record

__all__ = ["JOB_BLOCKS", "REPEATS", "STREAMS", "run"]

REPEATS = 5
BLOCK_SIZES = (256 << 10, 2 << 20)
PLACES = ("disk", "tmpfs")  # the disk cases (this module), the tmpfs ones (`fs_tmpfs`)
TOTAL_BYTES = 1 << 30
QUICK_TOTAL_BYTES = 128 << 20
DD_TARGET = 0.9
VLLM_TARGET = 1.2
DD_NAME = f"{STREAMS} parallel dd, oflag/iflag=direct"


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    note = progress or (lambda _msg: None)
    vllm = VllmFs.load()
    records: list[BenchRecord] = []
    if "disk" in PLACES:
        records += _run_disk(quick, vllm, note)
    if "tmpfs" in PLACES:
        total = QUICK_TOTAL_BYTES if quick else TOTAL_BYTES
        repeats = 1 if quick else REPEATS
        records += run_tmpfs(BLOCK_SIZES, total, repeats, vllm=vllm, note=note)
    return as_quick(records) if quick else records


def _run_disk(quick: bool, vllm: VllmFs | None, note: Callable[[str], None]) -> list[BenchRecord]:
    total = QUICK_TOTAL_BYTES if quick else TOTAL_BYTES
    repeats = 1 if quick else REPEATS
    records: list[BenchRecord] = []
    with _workdir() as workdir:
        note(f"fs: working in {workdir} ({fs_type(workdir)})")
        if _ext4_without_journal(workdir):
            note(
                "fs: ext4 without a journal here: file creation is slow for 1-6 minutes after"
                " many files were deleted on this file system; the figures assume none were"
            )
        for block_bytes in BLOCK_SIZES:
            size_dir = tempfile.mkdtemp(dir=workdir)
            records += _run_size(size_dir, block_bytes, total, repeats, vllm, note)
            _truncate_all(size_dir)
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
    with filled_region(count, block_bytes) as region:
        keys, expected = random_keys(count), expected_checksums(region, count)
        mode = ""
        for rep in range(repeats):
            note(f"fs: {label} repetition {rep + 1}/{repeats}")
            figures = _one_round(workdir, region, keys, vllm, rep)
            gigabytes = len(keys) * block_bytes / GB
            samples.add_round(figures, gigabytes)
            note(
                f"fs: {label} GB/s store/load: "
                + ", ".join(
                    f"{name} {gigabytes / w.seconds:.2f}/{gigabytes / r.seconds:.2f}"
                    for name, (w, r) in figures.items()
                )
            )
            mode = _check_ours(region, expected, note)
    return _records(label, samples, mode, vllm)


def _one_round(
    workdir: str, region: SharedRegion, keys: Sequence[bytes], vllm: VllmFs | None, rep: int
) -> dict[str, tuple[Phase, Phase]]:
    """Each side once, in an order rotated by ``rep``, each in a fresh directory."""
    block_bytes, total = region.slot_bytes, len(keys) * region.slot_bytes
    sides: dict[str, Callable[[str], tuple[Phase, Phase]]] = {
        "dd": lambda directory: _dd(directory, block_bytes, total),
        "ours": lambda directory: anyio.run(run_ours, directory, region, keys),
    }
    if vllm is not None:
        sides["vllm"] = lambda directory: vllm.measure(directory, region, keys)
    names = list(sides)
    names = names[rep % len(names) :] + names[: rep % len(names)]
    return {name: sides[name](_fresh_dir(workdir, name)) for name in names}


def _records(label: str, samples: Samples, mode: str, vllm: VllmFs | None) -> list[BenchRecord]:
    records = []
    for direction in ("store", "load"):
        ours = samples.median(f"ours {direction}")
        case = f"{direction} {label} {mode}"
        records.append(
            throughput_record(
                "fs",
                case,
                "GB/s",
                ours,
                reference=samples.median(f"dd {direction}"),
                reference_name=DD_NAME,
                target=DD_TARGET,
            )
        )
        if vllm is not None:
            records.append(
                throughput_record(
                    "fs",
                    f"{case} vs vllm",
                    "GB/s",
                    ours,
                    reference=samples.median(f"vllm {direction}"),
                    reference_name=vllm.name,
                    target=VLLM_TARGET,
                )
            )
            records.append(
                latency_record(
                    "fs",
                    f"{case} CPU vs vllm",
                    "core-s/GB",
                    samples.median(f"ours {direction} cpu"),
                    reference=samples.median(f"vllm {direction} cpu"),
                    reference_name=vllm.name,
                )
            )
    return records


def _check_ours(region: SharedRegion, expected: dict[int, int], note: Callable[[str], None]) -> str:
    """Verify the sampled slots after our load; return the I/O mode for the case names."""
    verify_loaded(region, expected)
    detail, cached = notes.detail, notes.cached_bytes
    cache = "not checked (no fincore)" if cached < 0 else f"{cached} bytes"
    note(f"fs: ours: {detail}; our files in the page cache after the store: {cache}")
    direct = "io=O_DIRECT" in detail
    if direct and cached > 0:
        note("fs: WARNING: our files are in the page cache although O_DIRECT is reported")
    return "O_DIRECT" if direct else "buffered"


# -- dd --------------------------------------------------------------------------------------


def _dd(directory: str, block_bytes: int, total: int) -> tuple[Phase, Phase]:
    count = total // block_bytes // STREAMS
    files = [os.path.join(directory, f"dd{i}") for i in range(STREAMS)]
    bs = f"bs={block_bytes}"
    write_s = _parallel(
        [["dd", "if=/dev/zero", f"of={f}", bs, f"count={count}", "oflag=direct"] for f in files]
    )
    os.sync()
    read_s = _parallel([["dd", f"if={f}", "of=/dev/null", bs, "iflag=direct"] for f in files])
    scale = total / (count * STREAMS * block_bytes)  # as if dd had moved ``total`` bytes
    return Phase(write_s * scale), Phase(read_s * scale)


def _parallel(commands: Sequence[Sequence[str]]) -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen([*cmd, "status=none"]) for cmd in commands]
    codes = [proc.wait() for proc in procs]
    elapsed = time.perf_counter() - started
    if any(codes):
        raise RuntimeError(f"fs bench: dd failed with exit codes {codes}")
    return elapsed


# -- helpers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    base = os.environ.get("KVTIER_BENCH_DIR", "/var/tmp")
    path = tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=base)
    try:
        if fs_type(path) in ("tmpfs", "ramfs"):
            raise RuntimeError(f"fs bench needs a real disk, {base} is {fs_type(path)}")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _fresh_dir(workdir: str, name: str) -> str:
    """A new directory; nothing is deleted before the end of the run (see the module
    docstring)."""
    return tempfile.mkdtemp(prefix=f"{name}-", dir=workdir)


def _truncate_all(directory: str) -> None:
    """Free the space of every file under ``directory`` but keep the files (and inodes)."""
    for parent, _dirs, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                os.truncate(os.path.join(parent, name), 0)


def _ext4_without_journal(path: str) -> bool:
    """Whether ``path`` is on ext4 with no jbd2 journal (``/proc/fs/jbd2/<dev>-8`` absent)."""
    device, kind = mount(path)
    if kind != "ext4" or not os.path.isdir(f"/proc/fs/ext4/{device}"):
        return False
    try:
        journals = os.listdir("/proc/fs/jbd2")
    except OSError:
        journals = []
    return not any(entry.startswith(f"{device}-") for entry in journals)
