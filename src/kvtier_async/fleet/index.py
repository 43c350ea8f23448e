"""The fleet's prefix index: which engine holds which block, in which medium.

Theory of operation. `FleetIndex` is sans-I/O: the feed (`kvtier_async.fleet.feed`) hands it
each engine's event batches with their sequence numbers, and it answers, for a prompt's block
keys (`kvtier_async.fleet.hashing`), how long a prefix each engine holds on its GPU and in its
CPU tier, and each shared tier in STORAGE. It never blocks and never does I/O; what it needs
done (a replay) it returns.

- GPU and CPU blocks are an engine's own: they die with it. STORAGE blocks are a tier's,
  named by the tier's name (vLLM's ``ownership``): every engine that names a tier ``fs[0]``
  shares it, which is what a fleet on one shared root or bucket is. An engine's restart, a
  gap in its events or an ``AllBlocksCleared`` drops its GPU and CPU blocks, never STORAGE.
- Sequence numbers. Batch ``n + 1`` after ``n`` is applied. A batch after a gap, or the first
  batch of an engine seen mid-stream (the index started after it), opens a replay from the
  next expected number: live batches wait (up to ``max_pending``) while the feed asks the
  engine's replay socket, and the replayed batches are applied in order. If the replay does
  not close the gap (no replay endpoint, the publisher's buffer moved on, a deadline), the
  engine is *resynced*: its GPU and CPU blocks are forgotten and the waiting batches applied,
  so the index may know less than the engine holds, never more. A sequence that starts again
  lower than the last (vLLM's PUB socket never sends a batch twice) is a restarted engine:
  its local blocks are dropped first, and if the new sequence did not start at 0 (its first
  batches were lost) it is replayed from 0.
- Wrong input never becomes state: a malformed batch, an event for an engine that was not
  configured, a medium that is not GPU, CPU or STORAGE are counted and logged by the feed,
  and the batch is not applied (a malformed batch resyncs its engine: what it said is lost).
- Memory is bounded: each engine's GPU and CPU sets and each tier's STORAGE set hold at most
  ``max_blocks`` keys, oldest stored first out. A key forgotten this way only costs a routing
  choice. A key is an int (64 bits of the hash): a set holds about ``BYTES_PER_BLOCK`` bytes
  per key (measured by ``kvtier bench fleet``).

Errors: `apply_*` never raise on what an engine sent; `KeyError` names an engine that is not
configured where a caller (not the wire) names one.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from .hashing import as_key
from .wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored

__all__ = ["EngineStats", "FleetIndex", "Match", "Receipt"]

LOCAL: Final = ("GPU", "CPU")
DEFAULT_MAX_BLOCKS: Final = 4_000_000
DEFAULT_MAX_PENDING: Final = 10_000


class Receipt(enum.Enum):
    """What `FleetIndex.receive` did with a batch."""

    APPLIED = "applied"
    RESTARTED = "restarted"  # the engine's sequence started again: its blocks dropped, applied
    REPLAY = "replay"  # a gap: the batch waits; ask the engine's replay socket (`replay_from`)
    WAITING = "waiting"  # a replay is open: the batch waits for it
    UNKNOWN_ENGINE = "unknown_engine"  # not configured: dropped


class EngineStats(NamedTuple):
    name: str
    next_seq: int | None
    gpu_blocks: int
    cpu_blocks: int
    batches: int
    events: int
    restarts: int
    gaps: int
    replayed: int
    resyncs: int
    malformed: int
    replaying: bool


@dataclass(slots=True)
class _Engine:
    name: str
    gpu: dict[int, None] = field(default_factory=dict)
    cpu: dict[int, None] = field(default_factory=dict)
    next_seq: int | None = None
    replay_from: int | None = None  # a replay is open from this sequence
    pending: deque[tuple[int, Batch]] = field(default_factory=deque)
    batches: int = 0
    events: int = 0
    restarts: int = 0
    gaps: int = 0
    replayed: int = 0
    resyncs: int = 0
    malformed: int = 0

    def local(self, medium: str) -> dict[int, None]:
        return self.gpu if medium == "GPU" else self.cpu

    def forget(self) -> None:
        self.gpu.clear()
        self.cpu.clear()


class Match(NamedTuple):
    """How many leading blocks of a prompt each holder has (in index blocks)."""

    blocks: int  # the prompt's full blocks
    gpu: dict[str, int]  # engine -> blocks on its GPU
    cpu: dict[str, int]  # engine -> blocks in its CPU tier
    storage: dict[str, int]  # shared tier -> blocks

    def local(self, engine: str) -> int:
        """The engine's own prefix: the longer of its GPU and CPU prefixes."""
        return max(self.gpu.get(engine, 0), self.cpu.get(engine, 0))

    @property
    def shared(self) -> int:
        """The longest prefix any shared tier holds."""
        return max(self.storage.values(), default=0)


class FleetIndex:
    """Which of ``engines`` holds which block (see the module docstring).

    ``offload_factor``: index blocks (vLLM's GPU block size) per offloaded block: CPU and
    STORAGE events name the hash of an offloaded block's last GPU block, so with a factor
    of 4 they name every 4th key of a prompt.
    """

    def __init__(
        self,
        engines: Iterable[str],
        *,
        offload_factor: int = 1,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        names = list(engines)
        if not names:
            raise ValueError("engines: at least one engine is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"engines: names must be unique, got {names}")
        for what, value in (
            ("offload_factor", offload_factor),
            ("max_blocks", max_blocks),
            ("max_pending", max_pending),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what}: must be a positive int, got {value!r}")
        self.offload_factor = offload_factor
        self.max_blocks = max_blocks
        self.max_pending = max_pending
        self._engines = {name: _Engine(name) for name in names}
        self._storage: dict[str, dict[int, None]] = {}
        self.unknown_batches = 0

    # -- the feed's side ----------------------------------------------------------------------

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self._engines)

    def receive(self, engine: str, seq: int, batch: Batch) -> Receipt:
        """A live batch of ``engine`` with sequence ``seq``: applied, or what to do."""
        st = self._engines.get(engine)
        if st is None:
            self.unknown_batches += 1
            return Receipt.UNKNOWN_ENGINE
        if st.replay_from is not None:
            self._wait(st, seq, batch)
            return Receipt.WAITING
        expected = st.next_seq
        if (expected is None and seq == 0) or seq == expected:
            self._apply(st, seq, batch)
            return Receipt.APPLIED
        if expected is not None and seq < expected:
            # A PUB/SUB stream never sends a batch twice: a lower sequence is a new publisher
            # under this name, the engine restarted (or two engines share one name).
            st.restarts += 1
            st.forget()
            if seq == 0:
                self._apply(st, seq, batch)
                return Receipt.RESTARTED
            st.next_seq = None  # its first batches were lost: replay them from 0
            expected = None
        # A gap, or an engine first seen mid-stream: replay from what is missing.
        st.gaps += expected is not None
        st.replay_from = 0 if expected is None else expected
        self._wait(st, seq, batch)
        return Receipt.REPLAY

    def replay_from(self, engine: str) -> int | None:
        """The sequence a replay of ``engine`` should start at (None: none is open)."""
        return self._engines[engine].replay_from

    def replayed(self, engine: str, seq: int, batch: Batch) -> None:
        """A batch the replay socket sent, applied in order. If it is later than the next
        one expected (the publisher's buffer moved on), or the engine's first contact is
        not sequence 0, what came before is lost: its local blocks are forgotten first."""
        st = self._engines[engine]
        if st.replay_from is None or (st.next_seq is not None and seq < st.next_seq):
            return
        if (st.next_seq is None and seq != 0) or (st.next_seq is not None and seq > st.next_seq):
            st.resyncs += 1
            st.forget()
        self._apply(st, seq, batch)
        st.replayed += 1

    def replay_done(self, engine: str) -> bool:
        """The replay ended (its end marker, or it failed or ran out of time): apply the
        waiting batches in order, resyncing the engine (its local blocks forgotten) where
        one does not follow the last applied. True if no resync was needed."""
        st = self._engines[engine]
        if st.replay_from is None:
            return True
        pending, st.pending = st.pending, deque()
        st.replay_from = None
        closed = True
        for seq, batch in pending:
            if st.next_seq is not None and seq < st.next_seq:
                continue  # the replay brought it already
            if st.next_seq is None or seq > st.next_seq:
                closed = False
                st.resyncs += 1
                st.forget()
            self._apply(st, seq, batch)
        return closed

    def malformed(self, engine: str, seq: int | None) -> None:
        """A batch of ``engine`` that could not be decoded: what it said is lost, so the
        engine's local blocks are forgotten (a resync) and the sequence moves past it (if
        its sequence frame could be read: ``seq``)."""
        st = self._engines.get(engine)
        if st is None:
            self.unknown_batches += 1
            return
        st.malformed += 1
        st.resyncs += 1
        st.forget()
        if st.replay_from is None and seq is not None:
            st.next_seq = seq + 1

    def forget(self, engine: str) -> None:
        """``engine`` is down (a router found it dead): drop its GPU and CPU blocks; its next
        batch is taken as a first one (a replay from 0 if it is not sequence 0)."""
        st = self._engines[engine]
        st.forget()
        st.next_seq = None
        st.replay_from = None
        st.pending.clear()

    def _wait(self, st: _Engine, seq: int, batch: Batch) -> None:
        st.pending.append((seq, batch))
        if len(st.pending) > self.max_pending:  # the replay takes too long: give it up
            self.replay_done(st.name)

    def _apply(self, st: _Engine, seq: int, batch: Batch) -> None:
        st.next_seq = seq + 1
        st.batches += 1
        st.events += len(batch.events)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                st.forget()  # vLLM's reset of its prefix cache, or of our CPU tier
                continue
            medium = event.medium or "GPU"
            where = st.local(medium) if medium in LOCAL else self._tier(event.ownership)
            keys = [as_key(h) for h in event.block_hashes]
            if isinstance(event, BlockStored):
                self._add(where, keys)
            elif isinstance(event, BlockRemoved):
                for key in keys:
                    where.pop(key, None)

    def _tier(self, name: str | None) -> dict[int, None]:
        return self._storage.setdefault(name or "STORAGE", {})

    def _add(self, where: dict[int, None], keys: Sequence[int]) -> None:
        for key in keys:
            where.pop(key, None)  # stored again: the newest
            where[key] = None
        while len(where) > self.max_blocks:
            del where[next(iter(where))]

    # -- the router's side --------------------------------------------------------------------

    def match(self, keys: Sequence[int]) -> Match:
        """How long a prefix of ``keys`` (a prompt's block keys, `BlockHasher.keys`) each
        engine holds on its GPU and in its CPU tier, and each shared tier holds."""
        factor = self.offload_factor
        ends = keys[factor - 1 :: factor]
        gpu = {name: _prefix(st.gpu, keys) for name, st in self._engines.items()}
        cpu = {name: _prefix(st.cpu, ends) * factor for name, st in self._engines.items()}
        storage = {name: _prefix(held, ends) * factor for name, held in self._storage.items()}
        return Match(len(keys), gpu, cpu, storage)

    def stats(self) -> list[EngineStats]:
        return [
            EngineStats(
                st.name,
                st.next_seq,
                len(st.gpu),
                len(st.cpu),
                st.batches,
                st.events,
                st.restarts,
                st.gaps,
                st.replayed,
                st.resyncs,
                st.malformed,
                st.replay_from is not None,
            )
            for st in self._engines.values()
        ]

    def storage_blocks(self) -> dict[str, int]:
        return {name: len(held) for name, held in self._storage.items()}


def _prefix(held: dict[int, None], keys: Sequence[int]) -> int:
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
