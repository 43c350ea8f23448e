"""The async runtime: jobs with awaitable handles, bounded lanes, and the engine that owns them."""

from .backend import TierBackend
from .engine import Engine, EngineClosed
from .jobs import CancelledJobError, Job, JobCancelled, JobError, JobHandle, JobResult
from .lane import Executor, KindTally, Lane, LaneStatistics
from .threaded import Deferred, ThreadedEngine

__all__ = [
    "CancelledJobError",
    "Deferred",
    "Engine",
    "EngineClosed",
    "Executor",
    "Job",
    "JobCancelled",
    "JobError",
    "JobHandle",
    "JobResult",
    "KindTally",
    "Lane",
    "LaneStatistics",
    "ThreadedEngine",
    "TierBackend",
]
