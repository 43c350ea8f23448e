"""The async runtime: jobs with awaitable handles, bounded lanes, the engine that owns them,
and the task runner through which the ledger's owner sends tasks and applies results."""

from .backend import TierBackend
from .engine import Engine, EngineClosed
from .jobs import Job, JobCancelled, JobError, JobHandle, JobResult
from .lane import Executor, JobCounters, Lane, LaneStatistics
from .runner import TaskRunner
from .threaded import Deferred, ThreadedEngine

__all__ = [
    "Deferred",
    "Engine",
    "EngineClosed",
    "Executor",
    "Job",
    "JobCancelled",
    "JobCounters",
    "JobError",
    "JobHandle",
    "JobResult",
    "Lane",
    "LaneStatistics",
    "TaskRunner",
    "ThreadedEngine",
    "TierBackend",
]
