"""The defaults both faces share, stated once: the config models (`kvtier_async.settings`,
`kvtier_async.integrations.vllm.config`), the ledger and the engine take theirs from here,
so a constructor called without a config behaves as an empty config does. A tier's own
defaults live with its config model (`kvtier_async.tiers.fs.tier`, `kvtier_async.tiers.s3.config`,
`kvtier_async.tiers.memory`), which its constructor uses too."""

from __future__ import annotations

from typing import Final

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DEVICE_WORKERS",
    "EVICTION_POLICY",
    "MAX_TRACKER_SIZE",
    "QUEUE_DEPTH",
    "REGION_DIR",
    "STORE_THRESHOLD",
    "WAIT_TIMEOUT_S",
]

#: The CPU tier's eviction policy (vLLM's default).
EVICTION_POLICY: Final = "lru"
#: How many times a block is seen before it is stored (vLLM's: the first time).
STORE_THRESHOLD: Final = 1
#: How many blocks the store-threshold tracker remembers (vLLM's ``max_tracker_size``).
MAX_TRACKER_SIZE: Final = 64_000
#: Where the shared CPU region's file lives (a tmpfs).
REGION_DIR: Final = "/dev/shm"
#: How many jobs may wait in each engine lane.
QUEUE_DEPTH: Final = 1024
#: Workers of the engine's device lane (GPU <-> CPU copies).
DEVICE_WORKERS: Final = 2
#: How long a clean close drains before it cancels (seconds).
CLOSE_TIMEOUT_S: Final = 30.0
#: How long a vLLM worker waits on the scheduler's CPU region (seconds).
WAIT_TIMEOUT_S: Final = 60.0
