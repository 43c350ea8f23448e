"""The tiering state machine: the primary ledger plus what the secondary tiers hold.

Theory of operation
-------------------
Sans-I/O like the primary ledger. It decides and describes work as `TierTask`s; the owner
runs them (on the engine) and applies each outcome with `apply`. Nothing here waits.

Store = cascade, fan-out: ``complete_store`` makes GPU->CPU blocks readable, then pins each
one once per secondary tier and queues a CASCADE task per tier (a copy to every tier, not an
overflow). The pin is released when that task is applied.

Load = promotion: ``lookup`` on a primary miss asks the tiers in order. A tier's first
answer about a key is RETRY: the key joins that tier's next batched LOOKUP task. A tier that
has the key gets a primary slot reserved for it (being written, so a repeated lookup answers
HIT_PENDING and the key is promoted once) and a PROMOTE task, batched per (tier, request)
and handed out by `take_tasks` at the end of the step. Applied, the keys that arrived become
readable; the others are freed and their cached answer turns into a miss. The slot is
reserved as vLLM 0.33's tiering manager does it (``prepare_write`` is the CPU manager's
``prepare_store`` with the request's context): an ordinary store of the key by the request
that looked it up, so it is that request's store miss and insertion (the admission
threshold aside: vLLM refuses ``store_threshold`` with tiers, we admit promotions). The
request's later load of the key is then not a reuse, since it inserted it. Cascades pin
their source slots without recording a use (vLLM's ``prepare_read``).

A tier has one lookup task out at a time: the keys asked while it is out wait for its
answer, then go together in the next one. A tier's answers take a round trip whatever the
batch holds, so one lookup per step queued behind slow answers would only add latency.

Lookup answers are kept while a request that asked is alive (`request_finished` releases
them), so one request sees one consistent answer per key; cascades and failed promotions
update them.

Walks. `walk_prefix` is `lookup` along a prefix: one `PrimaryLedger.walk`, which asks the
tiers (through a callback) about each key the primary lacks, except those this request
asked that no tier has answered yet (with one tier). `version` changes whenever a walk could
answer otherwise or start something new: the primary's `PrimaryLedger.version` (its keys'
states and reference counts, so the room for a promotion) plus every change of what the
tiers answered (a lookup answered, a promotion applied, a cascade or a tier's removal
changing a known answer, a reset). While it stays the same, a walk by a request that walked
the same keys before (and is still running: `request_finished` drops its answers) answers
as that walk did and starts nothing: the vLLM connector keys its one memo on it. One walk
is the exception, and says so (`walk_stable` False): one whose own promotion evicted a key
of its prefix, which it may have read as a hit before.

`reset` clears the primary and drops queued work; tasks already handed out must be applied
first (the owner drains the engine), since their memory is about to be reused.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ._types import (
    IntArray,
    JobKind,
    LedgerError,
    LookupResult,
    Medium,
    OffloadingEvent,
    PrepareStoreOutput,
)
from .counters import TierCounters
from .primary import PrimaryLedger

__all__ = ["StorePolicy", "TierTask", "TieringLedger"]

_NO_SLOTS: IntArray = np.zeros(0, dtype=np.int64)
_NONE: frozenset[bytes] = frozenset()


class StorePolicy(enum.Enum):
    BLOCK_LEVEL = "block_level"  # cascade only blocks this request stored
    REQUEST_LEVEL = "request_level"  # cascade the request's hit blocks too


@dataclass(frozen=True, slots=True)
class TierTask:
    """One job for a secondary tier: ``keys[i]`` moves from/to primary ``slot_ids[i]``."""

    task_id: int
    kind: JobKind
    tier: int
    keys: tuple[bytes, ...]
    slot_ids: IntArray
    generation: int


@dataclass(slots=True)
class _Probe:
    answer: bool | None = None
    in_flight: bool = False
    reqs: set[Hashable] = field(default_factory=set)


class _TierLookups:
    """One tier's lookup answers, the batch waiting to be asked, and who holds them."""

    __slots__ = ("asking", "batch", "by_req", "probes", "waiting")

    def __init__(self) -> None:
        self.probes: dict[bytes, _Probe] = {}
        self.batch: list[bytes] = []
        self.by_req: dict[Hashable, set[bytes]] = {}
        # Per request, the keys it asked that have no answer yet (a RETRY for it).
        self.waiting: dict[Hashable, set[bytes]] = {}
        self.asking = 0  # the id of this tier's lookup task out, 0 when none is

    def ask(self, key: bytes, req: Hashable) -> bool | None:
        probe = self.probes.get(key)
        if probe is None:
            probe = self.probes[key] = _Probe()
            self.batch.append(key)
        if req not in probe.reqs:
            probe.reqs.add(req)
            self.by_req.setdefault(req, set()).add(key)
            if probe.answer is None:
                self.waiting.setdefault(req, set()).add(key)
        return probe.answer

    def _answered(self, key: bytes, probe: _Probe) -> None:
        """``probe`` (of ``key``) got its first answer: no request waits for it now."""
        waiting = self.waiting
        for req in probe.reqs:
            keys = waiting.get(req)
            if keys is not None:
                keys.discard(key)

    def known_present(self, key: bytes) -> bool:
        probe = self.probes.get(key)
        return probe is not None and probe.answer is True

    def take_batch(self) -> list[bytes]:
        batch, self.batch = self.batch, []
        asked = []
        for key in batch:
            probe = self.probes.get(key)
            if probe is not None and probe.answer is None and not probe.in_flight:
                probe.in_flight = True
                asked.append(key)
        return asked

    def answer(self, keys: Iterable[bytes], present: Iterable[bool]) -> None:
        for key, value in zip(keys, present):
            probe = self.probes.get(key)
            if probe is None:
                continue
            probe.in_flight = False
            if probe.reqs:
                if probe.answer is None:
                    self._answered(key, probe)
                probe.answer = value
            else:
                del self.probes[key]

    def set_known(self, keys: Iterable[bytes], value: bool) -> bool:
        """Set the answers known of ``keys`` (those not being asked); whether one changed."""
        changed = False
        for key in keys:
            probe = self.probes.get(key)
            if probe is not None and not probe.in_flight and probe.answer is not value:
                if probe.answer is None:
                    self._answered(key, probe)
                probe.answer = value
                changed = True
        return changed

    def release(self, req: Hashable) -> None:
        self.waiting.pop(req, None)
        for key in self.by_req.pop(req, ()):
            probe = self.probes.get(key)
            if probe is None:
                continue
            probe.reqs.discard(req)
            if not probe.reqs and not probe.in_flight:
                del self.probes[key]

    def clear(self) -> None:
        self.probes.clear()
        self.batch.clear()
        self.by_req.clear()
        self.waiting.clear()
        self.asking = 0


class TieringLedger:
    """Primary ledger + secondary tiers' answers + the work between them."""

    def __init__(
        self,
        primary: PrimaryLedger,
        tier_names: Sequence[str],
        *,
        store_policy: StorePolicy = StorePolicy.BLOCK_LEVEL,
        counters: Sequence[TierCounters] | None = None,
    ) -> None:
        self.primary = primary
        self.tier_names = list(tier_names)
        self.store_policy = store_policy
        # Each tier's counter set (the tiers' own, `SecondaryTier.counters`, when a cache is
        # assembled): the ledger adds its lookups, hits, promotions and cascades.
        if counters is None:
            counters = [TierCounters() for _ in self.tier_names]
        elif len(counters) != len(self.tier_names):
            raise ValueError(
                f"counters: one per tier ({len(self.tier_names)}), got {len(counters)}"
            )
        self.counters = list(counters)
        self._lookups = [_TierLookups() for _ in self.tier_names]
        self._promotions: dict[tuple[int, Hashable], tuple[list[bytes], list[int]]] = {}
        self._queued: list[TierTask] = []  # cascades, pinned, not handed out yet
        self._out: dict[int, TierTask] = {}  # handed out by take_tasks, not applied yet
        self._ids = itertools.count(1)
        self._events: list[OffloadingEvent] = []
        self.generation = 0
        self._tier_changes = 0  # changes of what the tiers answer (see `version`)
        self._evicted: list[bytes] = []  # by promotions since the last walk began
        # Whether the last `walk_prefix`'s answer is a walk's now, nothing changed since.
        self.walk_stable = True

    # --- lookups -----------------------------------------------------------------------

    def lookup(self, key: bytes, req: Hashable) -> LookupResult:
        """HIT / HIT_PENDING from the primary; else ask the tiers in order: a tier that has
        the key starts its promotion (HIT_PENDING, or MISS when the primary has no room); a
        tier that has not answered yet makes it RETRY."""
        result = self.primary.lookup(key)
        if result is not LookupResult.MISS:
            return result
        return self._lookup_tiers(key, req)

    def _lookup_tiers(self, key: bytes, req: Hashable) -> LookupResult:
        """`lookup` of a key the primary does not hold."""
        retry = False
        for index, tier in enumerate(self._lookups):
            answer = tier.ask(key, req)
            if answer is None:
                retry = True
            elif answer:
                return self._promote(index, key, req)
        return LookupResult.RETRY if retry else LookupResult.MISS

    @property
    def version(self) -> int:
        """Changes whenever a walk could answer otherwise or start something new (see the
        module docstring): the primary's version plus the changes of the tiers' answers,
        both only ever growing."""
        return self.primary.version + self._tier_changes

    def walk_prefix(self, req: Hashable, groups: Sequence[Sequence[bytes]]) -> tuple[int, bool]:
        """`lookup` along a prefix, head first, for request ``req``: position ``i`` is the
        key ``groups[g][i]`` of each KV-cache group ``g`` (one group: ``[keys]``). Returns
        how many leading positions are a HIT in every group, and whether a position before
        the first MISS (in any group) is still on its way: RETRY or HIT_PENDING, to ask
        again once the tasks `take_tasks` hands out were applied. Positions after a pending
        one are still looked up, up to that MISS, so their probes and promotions start now
        (and are batched); at a position every group's key is looked up.

        `walk_stable` says afterwards whether a walk now would answer the same (see the
        module docstring): False when a promotion it started evicted a key of the prefix."""
        evicted = self._evicted
        if evicted:
            evicted.clear()
        if len(groups) == 1:  # the common case: no list per position
            # The primary walks the keys; the tiers are asked about each key it lacks
            # (with one tier, not those this request asked that it has not answered yet:
            # a RETRY with nothing to record).
            lookups = self._lookups
            waiting = lookups[0].waiting.get(req, _NONE) if len(lookups) == 1 else _NONE
            tiers, miss = self._lookup_tiers, LookupResult.MISS
            hits, end = self.primary.walk(
                groups[0],
                0,
                waiting,
                (lambda key: tiers(key, req) is not miss) if lookups else None,
            )
            answer = hits, end > hits
        else:
            answer = self._walk_groups(req, groups)
        self.walk_stable = not evicted or set(evicted).isdisjoint(itertools.chain(*groups))
        return answer

    def _walk_groups(self, req: Hashable, groups: Sequence[Sequence[bytes]]) -> tuple[int, bool]:
        """`walk_prefix` of several groups: `lookup` at each position."""
        hits, pending, lookup = 0, False, self.lookup
        hit, miss = LookupResult.HIT, LookupResult.MISS
        for keys in zip(*groups):
            results = [lookup(key, req) for key in keys]
            if miss in results:
                break
            if all(r is hit for r in results):
                hits += not pending
            else:
                pending = True
        return hits, pending

    def _promote(self, tier: int, key: bytes, req: Hashable) -> LookupResult:
        # vLLM's tiering manager reserves the slot with the CPU manager's own prepare_store
        # and the request's context: the key is a store miss and an insertion of ``req``.
        out = self.primary.prepare_store((key,), req, admit_all=True)
        if out is None or not out.keys_to_store:
            return LookupResult.MISS
        if out.evicted_keys:
            self._evicted += out.evicted_keys
        keys, slots = self._promotions.setdefault((tier, req), ([], []))
        keys.append(key)
        slots.append(int(out.store_spec.slot_ids[0]))
        return LookupResult.HIT_PENDING

    def request_finished(self, req: Hashable) -> None:
        """Release the request's lookup answers; the primary closes its request."""
        for tier in self._lookups:
            tier.release(req)
        self.primary.request_finished(req)

    # --- the primary's calls -----------------------------------------------------------

    def note_positions(self, req: Hashable, keys: Sequence[bytes], first: int = 1) -> None:
        self.primary.note_positions(req, keys, first)

    def prepare_store(
        self, keys: Sequence[bytes], req: Hashable | None = None
    ) -> PrepareStoreOutput | None:
        out = self.primary.prepare_store(keys, req)
        if out is not None and self.store_policy is StorePolicy.REQUEST_LEVEL:
            new = set(out.keys_to_store)
            present = self.primary.lookup
            self._queue_cascades(
                [k for k in keys if k not in new and present(k) is LookupResult.HIT]
            )
        return out

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> list[bytes]:
        """Finish GPU->CPU writes; cascade the blocks that became readable to every tier."""
        done = self.primary.complete_store(keys, success)
        if success and done:
            self._queue_cascades(done)
        return done

    def _queue_cascades(self, keys: list[bytes]) -> None:
        for index, tier in enumerate(self._lookups):
            todo = [key for key in keys if not tier.known_present(key)]
            if todo:
                spec = self.primary.prepare_load(todo, record=False)  # not a request's use
                self._queued.append(self._task(JobKind.CASCADE, index, todo, spec.slot_ids))

    def slots_of(self, keys: Iterable[bytes]) -> list[int | None]:
        """The primary slot of each key (None where it holds none), in order."""
        return self.primary.slots_of(keys)

    def prepare_load(self, keys: Sequence[bytes], req: Hashable | None = None) -> IntArray:
        return self.primary.prepare_load(keys, req).slot_ids

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.primary.complete_load(keys)

    def touch(self, keys: Sequence[bytes], req: Hashable | None = None) -> None:
        self.primary.touch(keys, req)

    # --- work out, results in ----------------------------------------------------------

    def _task(self, kind: JobKind, tier: int, keys: Sequence[bytes], slots: object) -> TierTask:
        ids = np.asarray(slots, dtype=np.int64)
        return TierTask(next(self._ids), kind, tier, tuple(keys), ids, self.generation)

    def take_tasks(self, *, cascades: bool = True) -> list[TierTask]:
        """Everything decided since the last call: promotions batched per (tier, request),
        one lookup batch per tier that has none out, and the cascades (unless ``cascades``
        is False: they stay queued, pinned, for a later call). The owner must `apply`
        each."""
        tasks = [
            self._task(JobKind.PROMOTE, tier, keys, slots)
            for (tier, _req), (keys, slots) in self._promotions.items()
        ]
        self._promotions.clear()
        for index, tier in enumerate(self._lookups):
            if tier.asking:
                continue  # its keys wait for the answer of the lookup out
            batch = tier.take_batch()
            if batch:
                task = self._task(JobKind.LOOKUP, index, batch, _NO_SLOTS)
                tier.asking = task.task_id
                tasks.append(task)
        if cascades:
            tasks += self._queued
            self._queued = []
        for task in tasks:
            self._out[task.task_id] = task
        return tasks

    def apply(self, task_id: int, ok: Sequence[bool]) -> None:
        """Apply a task's outcome (``ok[i]`` for ``keys[i]``; for a lookup: present)."""
        task = self._out.pop(task_id, None)
        if task is None:
            raise LedgerError(f"task {task_id} is not outstanding")
        counters, lookups = self.counters[task.tier], self._lookups[task.tier]
        good = [key for key, flag in zip(task.keys, ok) if flag]
        bad = [key for key, flag in zip(task.keys, ok) if not flag]
        if task.kind is JobKind.LOOKUP:
            lookups.asking = 0
            lookups.answer(task.keys, ok)
            counters.lookups += len(task.keys)
            counters.hits += len(good)
            self._tier_changes += 1  # answers: a RETRY turns into a promotion or a miss
        elif task.kind is JobKind.PROMOTE:
            self._tier_changes += 1
            self.primary.complete_store(good, True)
            self.primary.complete_store(bad, False)
            lookups.set_known(bad, False)
            counters.promoted += len(good)
            counters.promote_failed += len(bad)
        else:
            self.primary.complete_load(task.keys)
            self._tier_changes += lookups.set_known(good, True)
            counters.cascaded += len(good)
            counters.cascade_failed += len(bad)
            if good:
                self._emit(task.tier, good, removed=False)

    def tier_removed(self, tier: int, keys: Sequence[bytes]) -> None:
        """Tier ``tier`` deleted ``keys`` itself (a block failed verification, or its own
        GC): later lookups ask it again, and a removal is announced."""
        if keys:
            self._tier_changes += 1
            self._lookups[tier].set_known(keys, False)
            self._emit(tier, list(keys), removed=True)

    def _emit(self, tier: int, keys: list[bytes], *, removed: bool) -> None:
        if self.primary.events_enabled:
            name = self.tier_names[tier]
            self._events.append(OffloadingEvent(keys, Medium.STORAGE, removed=removed, tier=name))

    # --- state -------------------------------------------------------------------------

    @property
    def queued_cascades(self) -> int:
        """Blocks of the cascades queued, not handed out yet."""
        return sum(len(task.keys) for task in self._queued)

    def has_urgent_work(self) -> bool:
        """Whether `take_tasks` would hand out a promotion or a lookup (what a request
        waits for, unlike a cascade)."""
        return bool(self._promotions) or any(t.batch and not t.asking for t in self._lookups)

    def has_pending_work(self) -> bool:
        return bool(
            self._out
            or self._queued
            or self._promotions
            or any(tier.batch for tier in self._lookups)
        )

    @property
    def events_enabled(self) -> bool:
        """Whether events are recorded (for `take_events`); off, none are kept."""
        return self.primary.events_enabled

    @events_enabled.setter
    def events_enabled(self, value: bool) -> None:
        self.primary.events_enabled = value
        if not value:
            self.take_events()  # what was recorded is nobody's now

    @property
    def num_probes(self) -> int:
        """Lookup answers held for running requests (and queued or in flight)."""
        return sum(len(tier.probes) for tier in self._lookups)

    def outstanding(self) -> list[TierTask]:
        return list(self._out.values())

    def take_events(self) -> list[OffloadingEvent]:
        events = self.primary.take_events()
        events += self._events
        self._events = []
        return events

    def reset(self) -> None:
        """Clear the primary and drop queued work; secondary tiers keep their data.

        Raises `LedgerError` (changing nothing) while tasks handed out are not applied.
        """
        if self._out:
            raise LedgerError(f"{len(self._out)} tier tasks are outstanding: drain them first")
        self._promotions.clear()
        self._queued.clear()
        for tier in self._lookups:
            tier.clear()
        self.primary.reset()
        self.generation += 1
        self._tier_changes += 1
