"""One typed counter set per secondary tier, and one for the copies to and from the caller.

Theory of operation. Each event is counted once, by the one part that sees it, into the
tier's one `TierCounters`: the tier creates it (`SecondaryTier.counters`), the tiering
ledger and the engine's lanes for that tier are handed the same object, and every reader
(`kvtier_async.metrics`, so ``/metrics``, ``cache.stats()``, the connector's stats and
``kvtier``) reads that object and nothing else about these events:

- the tiering ledger, as it applies a job's result: keys looked up and found, blocks
  promoted and cascaded, keys whose promotion or cascade failed;
- the tier's lanes, as each job ends: bytes of the blocks a job moved, seconds of job run
  time (summed over the workers), and the keys of lookup jobs that failed whole (a key not
  found is a miss, not a failure);
- the tier itself, inside a store: blocks it wrote, and blocks it found stored already
  (what only the tier can tell apart: the ledger sees both as cascaded).

The engine's device lane counts the copies between the caller's blocks and the CPU tier into
a `DeviceCounters` the same way. The counters are plain integers and floats, and each field
has one writer thread: the ledger's owner for the ledger's fields, the engine's event loop
for the lanes' and the tier's (one thread for both in `TieredKVCache`; the scheduler thread
and the engine's own thread in the vLLM connector). A reader on another thread sees each
figure exact; a read of all of them is not one atomic snapshot. `copy` takes a snapshot for
a report.
"""

from __future__ import annotations

import copy as _copy
from dataclasses import dataclass

from ._types import JobKind

__all__ = ["DeviceCounters", "TierCounters"]


@dataclass(slots=True)
class TierCounters:
    """Every counter of one secondary tier (see the module docstring for who feeds which)."""

    # the tiering ledger's
    lookups: int = 0  # keys looked up
    hits: int = 0  # keys the lookups found
    promoted: int = 0  # blocks, into the CPU tier
    cascaded: int = 0  # blocks, from the CPU tier (written, or found stored already)
    promote_failed: int = 0  # keys
    cascade_failed: int = 0  # keys
    # the lanes'
    bytes_read: int = 0  # blocks promoted, in bytes
    bytes_written: int = 0  # blocks cascaded, in bytes
    read_seconds: float = 0.0  # job run time, summed over the tier's workers
    write_seconds: float = 0.0
    lookup_seconds: float = 0.0
    lookup_failed: int = 0  # keys of lookup jobs that failed whole
    # the tier's
    written: int = 0  # blocks a store wrote
    present: int = 0  # blocks a store found stored already (not written again)

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def failed(self) -> int:
        return self.promote_failed + self.cascade_failed + self.lookup_failed

    @property
    def gbps(self) -> float:
        """Bytes moved per second of I/O job run time, both directions, in GB/s."""
        seconds = self.read_seconds + self.write_seconds
        return (self.bytes_read + self.bytes_written) / seconds / 1e9 if seconds else 0.0

    def job_ended(self, kind: JobKind, nbytes: int, seconds: float, failed_whole: int) -> None:
        """A lane's job of ``kind`` ended: ``nbytes`` moved (0 when it failed whole) in
        ``seconds`` of run time; ``failed_whole`` keys when it raised (0 otherwise). A kind
        a tier's lanes do not run (store, load) counts nothing."""
        if kind is JobKind.PROMOTE:
            self.bytes_read += nbytes
            self.read_seconds += seconds
        elif kind is JobKind.CASCADE:
            self.bytes_written += nbytes
            self.write_seconds += seconds
        elif kind is JobKind.LOOKUP:
            self.lookup_failed += failed_whole
            self.lookup_seconds += seconds

    def copy(self) -> TierCounters:
        """A snapshot (the figures now, not updated afterwards)."""
        return _copy.copy(self)


@dataclass(slots=True)
class DeviceCounters:
    """Copies between the caller's blocks and the CPU tier (the engine's device lane)."""

    store_bytes: int = 0  # caller -> CPU tier
    store_seconds: float = 0.0
    load_bytes: int = 0  # CPU tier -> caller
    load_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Bytes copied per second of copy job run time, both directions, in GB/s."""
        seconds = self.store_seconds + self.load_seconds
        return (self.store_bytes + self.load_bytes) / seconds / 1e9 if seconds else 0.0

    def job_ended(self, kind: JobKind, nbytes: int, seconds: float, failed_whole: int) -> None:
        """As `TierCounters.job_ended`, for the device lane's store and load jobs (other
        kinds count nothing)."""
        if kind is JobKind.STORE:
            self.store_bytes += nbytes
            self.store_seconds += seconds
        elif kind is JobKind.LOAD:
            self.load_bytes += nbytes
            self.load_seconds += seconds

    def copy(self) -> DeviceCounters:
        return _copy.copy(self)
