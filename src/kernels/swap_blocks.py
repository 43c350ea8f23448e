"""The swap-blocks Triton kernel: copy many small byte runs between device and pinned host.

A persistent grid of ``num_programs`` programs walks a descriptor array of jobs
``(source address, destination address, byte size)``: program ``p`` takes jobs ``p``,
``p + num_programs``, ... and copies each in chunks of ``BYTES_PER_CHUNK`` as 8-byte words,
then the job's last ``size % 8`` bytes one by one. The addresses are raw virtual addresses:
device memory, or pinned (``cudaHostRegister``-ed) host memory, which the GPU dereferences
over PCIe through unified addressing. So one launch moves a whole batch of small pages,
GPU -> pinned host or pinned host -> GPU, where the copy engine would need a command per
page. Under ``TRITON_INTERPRET=1`` the same kernel runs on the CPU against CPU buffers
(the interpreter dereferences raw addresses), which is how it is tested without a GPU.

Word copies need 8-byte aligned addresses: `launch_swap_blocks` checks them.

Constants, as vLLM 0.33 tuned them on an H100 over PCIe Gen5 (``vllm/v1/kv_offload/cpu/
swap_blocks_triton.py``); ``kvtier bench gpu`` re-measures the choice of path, and on an
H200 it found Triton ahead of the copy engine on scattered pages up to 512 KiB, so our
handlers do not use ``THRESHOLD_BYTES``: they choose per transfer by mean run length
(``kvtier_async.transfer.copier.DEFAULT_TRITON_THRESHOLD``, 1 MiB):

* ``NUM_PROGRAMS = 12``: the smallest slice of SMs within 5% of peak bandwidth for 8-32 KiB
  pages (more programs only contend for the link).
* ``THRESHOLD_BYTES = 28 KiB``: vLLM's page size from which it uses the copy engine.
* ``MIN_JOBS = 16``: below this many jobs the launch cost is not amortised; use the copy
  engine.

Importing this module needs neither a GPU nor Triton; `triton_available` says whether the
kernel can run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_BYTES_PER_CHUNK",
    "MIN_JOBS",
    "NUM_PROGRAMS",
    "THRESHOLD_BYTES",
    "build_descriptors",
    "chunk_bytes_for",
    "launch_device_table",
    "launch_swap_blocks",
    "triton_available",
]

NUM_PROGRAMS: Final = 12
THRESHOLD_BYTES: Final = 28 * 1024
MIN_JOBS: Final = 16
MAX_BYTES_PER_CHUNK: Final = 8192

try:  # Triton is optional (not on every platform); the kernel is defined only with it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None


def triton_available() -> bool:
    """Whether the kernel can be launched (Triton is importable)."""
    return triton is not None


if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def _swap_blocks_kernel(  # type: ignore[no-untyped-def]
        descriptors,  # int64[3, n_jobs]: source addresses, destination addresses, sizes
        n_jobs,
        BYTES_PER_CHUNK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        WORDS_PER_CHUNK: tl.constexpr = BYTES_PER_CHUNK // 8
        words_in_chunk = tl.arange(0, WORDS_PER_CHUNK)
        tail_bytes = tl.arange(0, 8)
        job = pid
        while job < n_jobs:
            src_addr = tl.load(descriptors + job)
            dst_addr = tl.load(descriptors + n_jobs + job)
            size = tl.load(descriptors + 2 * n_jobs + job)
            words = size // 8
            src = src_addr.to(tl.pointer_type(tl.int64))
            dst = dst_addr.to(tl.pointer_type(tl.int64))
            for start in range(0, words, WORDS_PER_CHUNK):
                index = start + words_in_chunk
                mask = index < words
                data = tl.load(src + index, mask=mask, other=0)
                tl.store(dst + index, data, mask=mask)
            tail = size - words * 8
            if tail > 0:
                src_tail = (src_addr + words * 8).to(tl.pointer_type(tl.int8))
                dst_tail = (dst_addr + words * 8).to(tl.pointer_type(tl.int8))
                mask = tail_bytes < tail
                data = tl.load(src_tail + tail_bytes, mask=mask, other=0)
                tl.store(dst_tail + tail_bytes, data, mask=mask)
            job += num_programs


def chunk_bytes_for(max_size: int) -> int:
    """Bytes per chunk for jobs up to ``max_size`` bytes: the next power of two, between
    8 and `MAX_BYTES_PER_CHUNK` (vLLM's choice)."""
    chunk = 8
    while chunk < max_size and chunk < MAX_BYTES_PER_CHUNK:
        chunk *= 2
    return chunk


def build_descriptors(
    src: npt.ArrayLike, dst: npt.ArrayLike, size: npt.ArrayLike, *, pin_memory: bool = False
) -> torch.Tensor:
    """Pack job arrays into the kernel's ``int64[3, n]`` descriptor tensor (on the CPU).

    Raises:
        ValueError: Lengths differ, a size is negative, or an address is not 8-byte
            aligned.
    """
    import torch

    arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (src, dst, size)]
    if len({len(a) for a in arrays}) != 1:
        raise ValueError("src, dst and size must have the same length")
    table = np.stack(arrays)
    if table.shape[1] and int(table[2].min()) < 0:
        raise ValueError("job sizes must be >= 0")
    misaligned = (table[0] | table[1]) & 7
    if misaligned.any():
        job = int(np.flatnonzero(misaligned)[0])
        raise ValueError(
            f"job {job}: addresses {int(table[0, job]):#x} -> {int(table[1, job]):#x} are not "
            "8-byte aligned"
        )
    descriptors = torch.from_numpy(np.ascontiguousarray(table))
    return descriptors.pin_memory() if pin_memory else descriptors


def launch_swap_blocks(
    descriptors: torch.Tensor,
    *,
    max_size: int | None = None,
    num_programs: int = NUM_PROGRAMS,
    device: torch.device | str | None = None,
) -> None:
    """Launch the kernel on the current stream for a descriptor table from
    `build_descriptors`.

    Args:
        descriptors: ``int64[3, n]`` on the CPU (pinned for an asynchronous upload).
        max_size: The largest job, to size chunks; computed when omitted.
        num_programs: Programs in the persistent grid (at most one per job).
        device: Where the kernel runs; None or ``"cpu"`` under ``TRITON_INTERPRET=1``.

    The descriptors are uploaded with ``non_blocking=True`` on the current stream; keep
    the (pinned) table alive until the stream has passed this launch.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; the swap-blocks kernel cannot run")
    n_jobs = int(descriptors.shape[1])
    if n_jobs == 0:
        return
    if max_size is None:
        max_size = int(descriptors[2].max())
    table: Any = descriptors
    if device is not None and str(device) != "cpu":
        table = descriptors.to(device, non_blocking=True)
    launch_device_table(table, n_jobs, max_size=max_size, num_programs=num_programs)


def launch_device_table(
    table: torch.Tensor, n_jobs: int, *, max_size: int, num_programs: int = NUM_PROGRAMS
) -> None:
    """Launch the kernel on the current stream for a table where the kernel runs already
    (device memory; the CPU under ``TRITON_INTERPRET=1``): int64, its first ``3 * n_jobs``
    values the rows of `build_descriptors` back to back (sources, destinations, sizes),
    each address and size a multiple of 8 (not checked here). The transfer copier writes
    its tables this way, into one device table it reuses, with no allocation per launch.

    Args:
        table: The descriptor values (more than ``3 * n_jobs`` may follow; unread).
        n_jobs: Jobs to run.
        max_size: The largest job's bytes, to size chunks.
        num_programs: Programs in the persistent grid (at most one per job).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; the swap-blocks kernel cannot run")
    if n_jobs <= 0:
        return
    grid = (max(1, min(num_programs, n_jobs)),)
    _swap_blocks_kernel[grid](table, n_jobs, BYTES_PER_CHUNK=chunk_bytes_for(max_size))
