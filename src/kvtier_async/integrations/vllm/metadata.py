"""What crosses between the connector's scheduler and worker roles: plain, picklable data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier_async.ledger import CPUSpec, GPUSpec

__all__ = ["DeviceJob", "KVTierMetadata", "KVTierWorkerMetadata"]


@dataclass(frozen=True)
class DeviceJob:
    """One GPU<->CPU transfer: a load (CPU -> GPU) or a store (GPU -> CPU)."""

    req_id: str
    gpu: GPUSpec
    cpu: CPUSpec
    is_store: bool
    # A load its request waits for within the step (vLLM's sync load): done before the
    # forward pass, never reported in ``finished_recving``.
    sync: bool = False


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    load_jobs: dict[int, DeviceJob] = field(default_factory=dict)
    store_jobs: dict[int, DeviceJob] = field(default_factory=dict)
    # Jobs that must have finished before this step's forward pass writes KV
    # (their GPU blocks were freed and handed to another request, or the cache reset).
    jobs_to_flush: set[int] = field(default_factory=set)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: jobs each worker finished this step (counts add up over
    workers) and those that failed on some worker."""

    completed: dict[int, int] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)

    def aggregate(self, other: Any) -> KVTierWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        merged = dict(self.completed)
        for job_id, count in other.completed.items():
            merged[job_id] = merged.get(job_id, 0) + count
        return KVTierWorkerMetadata(merged, self.failed | other.failed)
