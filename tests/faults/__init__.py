"""The fault suite: real faults against the real parts, and one table of figures.

``nox -s faults`` (``python -m faults`` with ``tests/`` on ``sys.path``) runs every scenario
below against what production runs: the CPU tier in a /dev/shm region, the fs tier on a disk
directory, on /dev/shm and on a small tmpfs the suite mounts, the obj tier against moto's S3
server on 127.0.0.1 (in this process, in a child process, behind a delaying proxy), and the
vLLM connector inside vLLM 0.33's real Scheduler. Nothing is mocked; faults are made the way
they happen: files damaged on disk, objects overwritten through S3, ``kill -9``, servers
stopped, paused (SIGSTOP) or replaced by a socket that never answers, a file system filled
up, a root removed, calls cancelled.

Every block's bytes are a function of its key (`faults._common.content`), so every byte any
call hands back is checked. Each scenario reports, per fault:

- trials;
- wrong bytes served: bytes a load or promotion handed out that differ from what was stored
  (must be 0);
- durable blocks lost: blocks the cache had confirmed stored in a tier (after ``drain``, the
  ledger's STORAGE events) that a later lookup and load could not find (must be 0);
- the longest public call made during the fault, against a bound derived from the
  configured timeouts;
- recovery: from the end of the fault until a store reached the tier again.

Each scenario runs in a child process with an outer deadline, seeded, with a deadline on
every wait; the runner (`faults.__main__`) prints the table and fails on any wrong byte,
lost block, call past its bound or failed check.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Scenario:
    name: str  # for the command line
    title: str  # its row, if it dies before reporting
    target: str  # "module:function", called with the seed, yields rows
    deadline_s: float  # the outer deadline of its process

    def load(self) -> Callable[[int], Any]:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("fs-damage", "fs: file damage", "faults.fs_damage:run", 180),
    Scenario("s3-damage", "S3: object damage", "faults.s3_damage:run", 180),
    Scenario("kill", "kill -9 during stores", "faults.kill:run", 240),
    Scenario("shared", "two processes on one root / bucket", "faults.shared:run", 300),
    Scenario("s3-outage", "S3 refused, hung and slow", "faults.s3_outage:run", 420),
    Scenario("enospc", "ENOSPC", "faults.enospc:run", 120),
    Scenario("root-removed", "fs root removed while running", "faults.root_removed:run", 180),
    Scenario("cancel", "cancellation of every public call", "faults.cancel:run", 240),
    Scenario("connector", "vLLM connector, tier failing mid-run", "faults.connector:run", 420),
    Scenario("hostile", "hostile neighbours", "faults.hostile:run", 240),
)
