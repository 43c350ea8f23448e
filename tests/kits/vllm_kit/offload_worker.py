"""`FakeOffloadingWorker`: a CPU stand-in for vLLM's ``CPUOffloadingWorker``.

vLLM's own `OffloadingConnector` refuses to create its worker without CUDA; the harness swaps
its spec's ``get_worker`` for this one (`install_fake_offloading_worker`), which moves the
bytes between the KV caches and the CPU tier (a private buffer, or with
``TieringOffloadingSpec`` the shared region vLLM's secondary tiers read and write) and reports
each job ``delay_steps`` steps after it was submitted, as `OffloadingWorker` reports them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

__all__ = ["FakeOffloadingWorker", "install_fake_offloading_worker"]


@dataclass
class _Job:
    job_id: int
    is_store: bool
    # (tensor index, gpu rows, cpu chunks, block in chunk)
    pairs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]
    ticks: int
    num_bytes: int
    copied: bool = False


class FakeOffloadingWorker(OffloadingWorker):  # type: ignore[misc, unused-ignore]
    """An `OffloadingWorker` for vLLM's `OffloadingConnector` on the CPU.

    Stores copy KV pages of GPU blocks to chunk slots of the CPU tier, loads copy them back:
    a private buffer, or given ``mmap_region`` (vLLM's `SharedOffloadRegion` of this worker,
    which vLLM's secondary tiers read and write) its rows as `CPUOffloadingWorker` lays them
    out. ``cpu[t]`` is tensor ``t``'s ``[num_chunks, blocks_per_chunk, page]`` view. With
    vLLM's addressing (``block_indices`` skips into the first chunk, one page per
    layer reference). Each direction completes in submission order, like a CUDA stream.
    A job submitted before the ``k``-th ``get_finished`` call is reported by call
    ``k + delay_steps`` (``0``: the same step's call), or by the next call once ``wait``
    covered it. With
    ``copy_at="complete"`` the bytes move when the job completes (the latest a real DMA could
    move them); with ``"submit"`` at submission.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_chunks: int,
        blocks_per_chunk: int,
        *,
        delay_steps: int = 1,
        copy_at: Literal["submit", "complete"] = "complete",
        mmap_region: Any = None,
    ) -> None:
        self.gpu = [t.tensor for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.blocks_per_chunk = blocks_per_chunk
        self.mmap_region = mmap_region
        shape = (num_chunks, blocks_per_chunk)
        if mmap_region is None:
            self.cpu = [
                torch.zeros(*shape, t.page_size_bytes, dtype=torch.int8) for t in kv_caches.tensors
            ]
        else:
            self.cpu = [
                mmap_region.create_next_worker_view(blocks_per_chunk * t.page_size_bytes).view(
                    *shape, t.page_size_bytes
                )
                for t in kv_caches.tensors
            ]
        self.delay_steps = delay_steps
        self.copy_at = copy_at
        self.queues: dict[bool, deque[_Job]] = {True: deque(), False: deque()}
        self.submitted = {"store": 0, "load": 0}

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._submit(job_id, dst_spec, src_spec, is_store=False)

    def _submit(
        self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, *, is_store: bool
    ) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        pairs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        num_bytes = 0
        gpu_offset = cpu_offset = 0
        bpc = self.blocks_per_chunk
        for group, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % bpc
            num_chunks = -(-(size + skip) // bpc)
            gpu_rows = torch.as_tensor(
                gpu.block_ids[gpu_offset : gpu_offset + size], dtype=torch.int64
            )
            chunks = torch.as_tensor(
                cpu.block_ids[cpu_offset : cpu_offset + num_chunks], dtype=torch.int64
            )
            sub = (chunks[:, None] * bpc + torch.arange(bpc)[None, :]).flatten()[skip : skip + size]
            for ref in self.refs[group]:
                pairs.append((ref.tensor_idx, gpu_rows, sub // bpc, sub % bpc))
                num_bytes += size * ref.page_size_bytes
            gpu_offset += size
            cpu_offset += num_chunks
        assert gpu_offset == len(gpu.block_ids) and cpu_offset == len(cpu.block_ids)
        job = _Job(job_id, is_store, pairs, self.delay_steps, num_bytes)
        self.submitted["store" if is_store else "load"] += 1
        if self.copy_at == "submit":
            self._copy(job)
        self.queues[is_store].append(job)
        return True

    def _copy(self, job: _Job) -> None:
        if job.copied:
            return
        for tensor_idx, gpu_rows, chunks, blocks in job.pairs:
            gpu, cpu = self.gpu[tensor_idx], self.cpu[tensor_idx]
            if job.is_store:
                cpu[chunks, blocks] = gpu[gpu_rows]
            else:
                gpu[gpu_rows] = cpu[chunks, blocks]
        job.copied = True

    def get_finished(self) -> list[TransferResult]:
        results = []
        for queue in self.queues.values():
            while queue and queue[0].ticks <= 0:
                job = queue.popleft()
                started = time.perf_counter()
                self._copy(job)
                elapsed = time.perf_counter() - started
                results.append(TransferResult(job.job_id, True, job.num_bytes, elapsed))
            for job in queue:
                job.ticks -= 1
        return results

    def wait(self, job_ids: set[int]) -> None:
        for queue in self.queues.values():
            last = max((i for i, job in enumerate(queue) if job.job_id in job_ids), default=-1)
            for job in list(queue)[: last + 1]:
                self._copy(job)
                job.ticks = 0

    def pending(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

    def shutdown(self) -> None:
        region, self.mmap_region = self.mmap_region, None
        if region is not None:
            self.cpu = []  # views of the region
            region.cleanup()


def install_fake_offloading_worker(
    connector: KVConnectorBase_V1, delay_steps: int, copy_at: Literal["submit", "complete"]
) -> Callable[[], FakeOffloadingWorker | None]:
    """Make vLLM's OffloadingConnector (worker role) build a `FakeOffloadingWorker`."""
    connector_worker = getattr(connector, "connector_worker", None)
    if connector_worker is None:
        return lambda: None
    spec = connector_worker.spec
    made: list[FakeOffloadingWorker] = []

    def get_worker(kv_caches: CanonicalKVCaches) -> FakeOffloadingWorker:
        if not made:
            made.append(
                FakeOffloadingWorker(
                    kv_caches,
                    spec.num_chunks,
                    spec.blocks_per_chunk,
                    delay_steps=delay_steps,
                    copy_at=copy_at,
                    mmap_region=_worker_region(spec),
                )
            )
        return made[0]

    spec.get_worker = get_worker
    return lambda: made[0] if made else None


def _worker_region(spec: Any) -> Any:
    """The worker's `SharedOffloadRegion`, made as vLLM's ``create_worker`` makes it, for a
    spec whose tiers share it (``TieringOffloadingSpec``); None for a private buffer."""
    if not spec._uses_shared_region():
        return None
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    return SharedOffloadRegion(
        engine_id=spec._engine_id,
        num_chunks=spec.num_chunks,
        rank=0 if spec.replicated_layout else spec.config.parallel.rank,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )
