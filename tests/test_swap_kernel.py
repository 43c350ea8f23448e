"""The swap-blocks Triton kernel under the interpreter, against raw CPU buffers.

``TRITON_INTERPRET=1`` must be in the environment before Triton decorates the kernel, and
another test module may already have imported it in this process, so the kernel checks
run in one child process (this file run as a script); each test asserts on the child's
report for one case. The interpreter dereferences the descriptors' raw addresses, as the
GPU does for device and pinned host memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUARD = 0x5A
SIZES = [0, 1, 7, 8, 9, 15, 16, 24, 63, 64, 65, 1000, 4095, 4096, 4104, 8192, 8200, 20000, 28664]
CASES = [
    "sizes-one-launch",
    "sizes-one-program",
    "adjacent-jobs",
    "odd-counts",
    "chunk-smaller-than-jobs",
    "scattered-destinations",
    "descriptors-from-specs",
    "reused-table",
]


# -- the child: runs with TRITON_INTERPRET=1 ----------------------------------------


def _child() -> dict[str, dict[str, Any]]:
    import torch
    from kvtier_async.kernels.swap_blocks import build_descriptors, launch_swap_blocks

    rng = np.random.default_rng(0)
    report: dict[str, dict[str, Any]] = {}

    def buffers(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
        return src, torch.full((n,), GUARD, dtype=torch.uint8)

    def run(
        name: str,
        sizes: list[int],
        *,
        programs: int,
        gap: int,
        reverse: bool = False,
        max_size: int | None = None,
    ) -> None:
        """Jobs of ``sizes`` packed ``gap`` bytes apart (rounded up to 8) in both buffers;
        the destination order is reversed when ``reverse``."""
        offsets, position = [], 0
        for size in sizes:
            offsets.append(position)
            position += -(-(size + gap) // 8) * 8
        src, dst = buffers(position + 64)
        dst_offsets = offsets[::-1] if reverse else offsets
        dst_sizes = sizes[::-1] if reverse else sizes
        jobs_src = [src.data_ptr() + o for o in offsets]
        jobs_dst = [dst.data_ptr() + o for o in dst_offsets]
        # job i copies sizes[i] bytes from offsets[i] to dst_offsets[i]; with reverse, the
        # slots are swapped, so size them for the larger of the two.
        jobs_size = [min(a, b) for a, b in zip(sizes, dst_sizes)] if reverse else sizes
        table = build_descriptors(jobs_src, jobs_dst, jobs_size)
        launch_swap_blocks(table, num_programs=programs, max_size=max_size)
        expected = torch.full_like(dst, GUARD)
        for s, d, n in zip(offsets, dst_offsets, jobs_size):
            expected[d : d + n] = src[s : s + n]
        bad = torch.nonzero(expected != dst).flatten()
        report[name] = {
            "ok": bool(len(bad) == 0),
            "detail": f"{len(bad)} wrong bytes, first at {bad[:5].tolist()}",
        }

    run("sizes-one-launch", SIZES, programs=12, gap=8)
    run("sizes-one-program", SIZES, programs=1, gap=3)
    # Jobs back to back: each ends where the next one's 8-byte slot starts.
    run(
        "adjacent-jobs",
        [8 * k + t for k in (1, 3, 5, 129, 1025) for t in (0, 5)],
        programs=4,
        gap=0,
    )
    odd = [37 * 8 + 3, 5, 4096 + 1, 9]
    report["odd-counts"] = {"ok": True, "detail": ""}
    for count in (1, 3, 17, 33):
        run("odd", [odd[i % 4] for i in range(count)], programs=12, gap=8)
        if not report.pop("odd")["ok"]:
            report["odd-counts"] = {"ok": False, "detail": f"{count} jobs"}
    run("chunk-smaller-than-jobs", [9000, 20000, 4096], programs=2, gap=0, max_size=64)
    run("scattered-destinations", SIZES[::-1], programs=5, gap=16, reverse=True)
    report["descriptors-from-specs"] = _from_specs(rng)
    report["reused-table"] = _reused_table(rng)
    return report


def _reused_table(rng: np.random.Generator) -> dict[str, Any]:
    """`launch_device_table` as the CUDA copier uses it: one table reused, the jobs of each
    launch its first ``3 * n`` values, a longer earlier table's values after them. Only
    this launch's jobs are copied."""
    import torch
    from kvtier_async.kernels.swap_blocks import launch_device_table

    src = torch.from_numpy(rng.integers(0, 256, 64 * 1024, dtype=np.uint8))
    dst = torch.full_like(src, GUARD)
    table = torch.zeros(1024, dtype=torch.int64)

    def fill(offsets: list[int], size: int) -> int:
        jobs = len(offsets)
        table[:jobs] = torch.tensor([src.data_ptr() + o for o in offsets])
        table[jobs : 2 * jobs] = torch.tensor([dst.data_ptr() + o for o in offsets])
        table[2 * jobs : 3 * jobs] = size
        return jobs

    first = [o * 4096 for o in range(8)]  # eight jobs of 1000 bytes
    launch_device_table(table, fill(first, 1000), max_size=1000)
    if not torch.equal(dst[:1000], src[:1000]):
        return {"ok": False, "detail": "the first launch copied wrong bytes"}
    dst.fill_(GUARD)
    second = [40960 + o * 8 for o in range(3)]  # three jobs of 8 bytes, back to back
    launch_device_table(table, fill(second, 8), max_size=8)
    expected = torch.full_like(dst, GUARD)
    expected[40960 : 40960 + 24] = src[40960 : 40960 + 24]
    bad = torch.nonzero(expected != dst).flatten()
    ok = len(bad) == 0
    return {"ok": ok, "detail": "" if ok else f"{len(bad)} wrong bytes, first at {bad[:5]}"}


def _from_specs(rng: np.random.Generator) -> dict[str, Any]:
    """Plan a store and a load from specs, copy with the kernel, compare with memmove."""
    import torch
    from kvtier_async.kernels.swap_blocks import build_descriptors, launch_swap_blocks

    from kvtier_async.ledger import CPUSpec, GPUSpec
    from kvtier_async.transfer import HostSlots, canonicalize, plan_transfer
    from kvtier_async.transfer.hostcopy import memmove_copier

    cache = torch.from_numpy(rng.integers(0, 256, (12, 2, 16, 40), dtype=np.uint8))
    kv = canonicalize({"a": cache[:, 0], "b": cache[:, 1]}, groups=[["a"], ["b"]])
    layout = kv.slot_layout(3)
    results = []
    for copier in ("kernel", "memmove"):
        slots = torch.zeros(6, layout.slot_bytes, dtype=torch.uint8)
        host = HostSlots.from_tensor(slots)
        gpu = GPUSpec.of([7, 2, 9, 4, 11, 0, 3], [4, 3], [2, 1])
        cpu = CPUSpec.of([5, 1, 3, 0])
        plan = plan_transfer(kv, layout, host, gpu, cpu, to_host=True).merged()
        if copier == "kernel":
            launch_swap_blocks(build_descriptors(plan.src, plan.dst, plan.size))
        else:
            memmove_copier(plan)
        results.append(slots.clone())
    same = torch.equal(results[0], results[1]) and bool(results[1].any())
    return {"ok": same, "detail": "kernel and memmove slot bytes differ" if not same else ""}


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    print(json.dumps(_child()))
    sys.exit(0)


# -- the tests --------------------------------------------------------------------


@pytest.fixture(scope="module")
def report() -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("case", CASES)
def test_kernel_is_byte_exact(report: dict[str, dict[str, Any]], case: str) -> None:
    assert report[case]["ok"], report[case]["detail"]


def test_module_imports_without_cuda() -> None:
    from kvtier_async.kernels import swap_blocks

    assert swap_blocks.THRESHOLD_BYTES == 28 * 1024
    assert isinstance(swap_blocks.triton_available(), bool)


def test_descriptors_reject_misaligned_addresses() -> None:
    from kvtier_async.kernels.swap_blocks import build_descriptors

    table = build_descriptors([8, 16], [24, 32], [5, 40])
    assert table.shape == (3, 2)
    assert table[2].tolist() == [5, 40]
    with pytest.raises(ValueError, match=r"job 1: .* not 8-byte aligned"):
        build_descriptors([8, 12], [24, 32], [8, 8])
    with pytest.raises(ValueError, match="same length"):
        build_descriptors([8], [8, 16], [8])


def test_chunk_sizes() -> None:
    from kvtier_async.kernels.swap_blocks import MAX_BYTES_PER_CHUNK, chunk_bytes_for

    assert [chunk_bytes_for(n) for n in (0, 8, 9, 1000, 4096, 28 * 1024)] == [
        8,
        8,
        16,
        1024,
        4096,
        MAX_BYTES_PER_CHUNK,
    ]
