"""The connector's device jobs: the GPU<->CPU copies its workers run, until all reported.

The scheduler gives each store and load of a step a job id (`DeviceJobs.new`); every worker
copies its own rows of the blocks and reports the job at a later step. A job is done when
every worker reported it (`DeviceJobs.reported` returns it then, failed if any worker
failed it), and only then does the ledger learn its outcome.

A cache reset forgets the jobs in flight (`DeviceJobs.fence`): the workers are told to flush
them, and until every worker reported each (a job abandoned at a worker's deadline is
reported only once its copy ended) the fence holds (`DeviceJobs.fenced`): the scheduler then
offers no new store and answers no lookup, so no freed slot is reused while a late copy may
still touch it. Reports of jobs from before the reset only count down the fence.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier_async._log import get_logger

__all__ = ["DeviceJobState", "DeviceJobs"]

log = get_logger(__name__)


@dataclass
class DeviceJobState:
    """One device job: whose, which keys, which way, the reports still due, its GPU blocks."""

    req_id: str
    keys: Sequence[bytes]
    is_store: bool
    pending: int  # workers that have not reported it yet
    blocks: list[int]
    failed: bool = False
    sync: bool = False  # a sync load (see `ConnectorScheduler._load_async`)


class DeviceJobs:
    """The device jobs in flight, by id, and a reset's fence (see the module docstring)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._jobs: dict[int, DeviceJobState] = {}
        self._ids = itertools.count(1)
        self._stale_below = 0  # jobs from before a reset only count down the fence
        self._fence: dict[int, int] = {}  # job flushed by a reset -> reports still due

    def new(self, req_id: str, keys: Sequence[bytes], *, is_store: bool, blocks: list[int]) -> int:
        """A new job's id; every worker will report it."""
        job_id = next(self._ids)
        self._jobs[job_id] = DeviceJobState(req_id, keys, is_store, self.num_workers, blocks)
        return job_id

    def __getitem__(self, job_id: int) -> DeviceJobState:
        return self._jobs[job_id]

    def __iter__(self) -> Iterator[DeviceJobState]:
        return iter(self._jobs.values())

    def __len__(self) -> int:
        return len(self._jobs)

    def items(self) -> Iterator[tuple[int, DeviceJobState]]:
        return iter(self._jobs.items())

    def reported(self, job_id: int, count: int, failed: bool) -> DeviceJobState | None:
        """``count`` workers reported ``job_id`` (``failed``: one of them failed it); the
        job once every worker has (it is forgotten then), else None."""
        if job_id < self._stale_below:
            self._fence_reported(job_id, count)
            return None
        job = self._jobs.get(job_id)
        if job is None:
            return None
        job.pending -= count
        job.failed |= failed
        if job.pending > 0:
            return None
        del self._jobs[job_id]
        return job

    def _fence_reported(self, job_id: int, count: int) -> None:
        due = self._fence.get(job_id)
        if due is None:
            return
        if due > count:
            self._fence[job_id] = due - count
            return
        del self._fence[job_id]
        if not self._fence:
            log.info("every device job a cache reset flushed was reported")

    @property
    def fenced(self) -> bool:
        """A reset's jobs are not all reported yet (see the module docstring)."""
        return bool(self._fence)

    def fence(self) -> set[int]:
        """A cache reset: forget every job in flight, fence until each is reported; returns
        their ids (the workers flush them)."""
        flushed = set(self._jobs)
        for job_id, job in self._jobs.items():
            self._fence[job_id] = job.pending
        self._jobs.clear()
        self._stale_below = next(self._ids)
        return flushed
