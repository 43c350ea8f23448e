"""The primary (CPU) tier's ledger: which key owns which slot, pins, eviction.

Theory of operation
-------------------
Sans-I/O and single-owner: plain synchronous calls, no threads, no awaits, no I/O. The
ledger never moves bytes; it answers with specs (slot ids) that the engine executes, and
the owner applies the engine's results back through the ``complete_*`` calls.

A slot is free (never allocated, or on the free list) or owned by exactly one key. An owned
slot's ``ref`` is::

    -1  being written        (prepare_store -> complete_store)   not readable, not evictable
     0  readable, idle       evictable
    >0  readable, pinned     (prepare_load -> complete_load)     not evictable

Transitions (anything else raises `LedgerError` and changes nothing):

    prepare_store   absent  -> -1        (evicting idle keys outside the batch if needed;
                                          all or nothing: None when not enough is evictable)
    complete_store  -1 -> 0 (success) | -1 -> absent, slot freed (failure)
    prepare_load    r >= 0  -> r + 1
    complete_load   r > 0   -> r - 1
    reset           everything -> absent

Counters (free, evictable, writing) are kept incrementally, never recomputed by a scan.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from ._types import CPUSpec, LedgerError, LookupResult, Medium, OffloadingEvent, PrepareStoreOutput
from .policies import CachePolicy, SlotTable, make_policy

__all__ = ["LedgerStatistics", "PrimaryLedger"]

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING


class LedgerStatistics(NamedTuple):
    capacity: int
    used: int
    free: int
    evictable: int
    writing: int
    pinned: int
    generation: int


class PrimaryLedger:
    """Books of the CPU tier's ``num_slots`` slots.

    ``req`` arguments are any hashable request id: keys one request uses are kept together
    in recency order (see `policies`); call `request_finished` when it ends. Without one,
    each call is its own group.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        policy: str = "lru",
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        medium: Medium = Medium.CPU,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if store_threshold < 1:
            raise ValueError(f"store_threshold must be >= 1, got {store_threshold}")
        self.num_slots = num_slots
        self.medium = medium
        self.store_threshold = store_threshold
        self._max_tracker = max_tracker_size
        self._table = SlotTable(num_slots)
        self._slot_of = self._table.slot_of
        self._ref = self._table.ref
        self._key_of: list[bytes | None] = [None] * num_slots
        self.policy: CachePolicy = make_policy(policy, num_slots, self._table)
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._req_group: dict[Hashable, int] = {}
        self._events: list[OffloadingEvent] = []
        self.generation = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._free: list[int] = []
        self._fresh = 0
        self._num_evictable = 0
        self._num_writing = 0
        self._next_gid = 0

    # --- queries -----------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        """HIT if readable, HIT_PENDING while being written, MISS if absent."""
        slot = self._slot_of.get(key)
        if slot is None:
            return _MISS
        return _HIT if self._ref[slot] >= 0 else _PENDING

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def slot_of(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def ref_count(self, key: bytes) -> int | None:
        slot = self._slot_of.get(key)
        return None if slot is None else self._ref[slot]

    def keys(self) -> list[bytes]:
        return list(self._slot_of)

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_slots - self._fresh

    def statistics(self) -> LedgerStatistics:
        used = len(self._slot_of)
        pinned = used - self._num_evictable - self._num_writing
        return LedgerStatistics(
            self.num_slots,
            used,
            self.num_free,
            self._num_evictable,
            self._num_writing,
            pinned,
            self.generation,
        )

    # --- loads -------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[bytes]) -> CPUSpec:
        """Pin readable keys against eviction; their slots, in key order."""
        slot_of, ref = self._slot_of, self._ref
        slots = [slot_of.get(key, -1) for key in keys]
        for key, slot in zip(keys, slots):
            if slot < 0 or ref[slot] < 0:
                self._refuse_load(key)
        for slot in slots:
            count = ref[slot]
            if count == 0:
                self._num_evictable -= 1
            ref[slot] = count + 1
        return CPUSpec(np.array(slots, dtype=np.int64))

    def _refuse_load(self, key: bytes) -> None:
        state = "absent" if key not in self._slot_of else "being written"
        raise LedgerError(f"cannot load key {key.hex()}: it is {state}")

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpin keys pinned by `prepare_load`."""
        slot_of, ref = self._slot_of, self._ref
        slots = [slot_of.get(key, -1) for key in keys]
        needed = Counter(slots) if len(set(slots)) < len(slots) else dict.fromkeys(slots, 1)
        for key, slot in zip(keys, slots):
            if slot < 0 or ref[slot] < needed[slot]:
                state = "absent" if slot < 0 else "not pinned"
                raise LedgerError(f"cannot complete load of key {key.hex()}: it is {state}")
        for slot, n in needed.items():
            count = ref[slot] - n
            ref[slot] = count
            if count == 0:
                self._num_evictable += 1

    def touch(self, keys: Sequence[bytes], req: Hashable | None = None) -> None:
        """Mark keys (head -> tail of a prefix) as recently used."""
        self.policy.touch(keys, self._group(req))

    def _group(self, req: Hashable | None) -> int:
        if req is not None:
            gid = self._req_group.get(req)
            if gid is not None:
                return gid
        self._next_gid += 1
        if req is not None:
            self._req_group[req] = self._next_gid
        return self._next_gid

    def request_finished(self, req: Hashable) -> None:
        """Forget a request's recency group (its keys keep their place)."""
        self._req_group.pop(req, None)

    # --- stores ------------------------------------------------------------------------

    def prepare_store(
        self, keys: Iterable[bytes], req: Hashable | None = None, *, admit_all: bool = False
    ) -> PrepareStoreOutput | None:
        """Reserve slots (state: being written) for the keys not held yet.

        Evicts idle keys outside the batch if free slots are short. Returns None, with no
        state changed, when not enough is evictable. ``admit_all`` skips the
        ``store_threshold`` admission (promotions from a secondary tier).
        """
        batch = dict.fromkeys(keys)
        new = [key for key in batch if key not in self._slot_of]
        admitted = new if admit_all else self._admitted(new)
        victims: list[bytes] = []
        if admitted:
            deficit = len(admitted) - self.num_free
            if deficit > self._num_evictable:
                return None
            found = self.policy.evict(max(deficit, 0), batch, admitted)
            if found is None:
                return None
            victims = found
        self._record_offers(new)
        self._release(victims)
        slots = self._allocate(admitted, self._group(req))
        return PrepareStoreOutput(admitted, CPUSpec(np.array(slots, dtype=np.int64)), victims)

    def _admitted(self, new: list[bytes]) -> list[bytes]:
        """Keys offered at least ``store_threshold`` times, counting this offer."""
        if self.store_threshold == 1:
            return new
        need, seen = self.store_threshold - 1, self._seen
        return [key for key in new if seen.get(key, 0) >= need]

    def _record_offers(self, new: list[bytes]) -> None:
        if self.store_threshold == 1:
            return
        seen = self._seen
        for key in new:
            seen[key] = seen.pop(key, 0) + 1
        while len(seen) > self._max_tracker:
            seen.popitem(last=False)

    def _release(self, victims: list[bytes]) -> None:
        if not victims:
            return
        for key in victims:
            slot = self._slot_of.pop(key)
            self._key_of[slot] = None
            self._free.append(slot)
        self._num_evictable -= len(victims)
        self._events.append(OffloadingEvent(victims, self.medium, removed=True))

    def _allocate(self, keys: list[bytes], gid: int) -> list[int]:
        num_fresh = min(len(keys), self.num_slots - self._fresh)
        slots = list(range(self._fresh, self._fresh + num_fresh))
        self._fresh += num_fresh
        free = self._free
        slots.extend(free.pop() for _ in range(len(keys) - num_fresh))
        slot_of, key_of, ref = self._slot_of, self._key_of, self._ref
        for key, slot in zip(keys, slots):
            slot_of[key] = slot
            key_of[slot] = key
            ref[slot] = -1
        self.policy.insert(keys, gid)
        self._num_writing += len(keys)
        return slots

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> list[bytes]:
        """Finish writes: readable on success; on failure the slots still being written
        are freed. Keys not being written (already readable, or gone) are left alone.
        Returns the keys whose write this call finished."""
        slot_of, ref = self._slot_of, self._ref
        done: list[bytes] = []
        for key in dict.fromkeys(keys):
            slot = slot_of.get(key)
            if slot is not None and ref[slot] == -1:
                done.append(key)
        if not done:
            return done
        self._num_writing -= len(done)
        if success:
            for key in done:
                ref[slot_of[key]] = 0
            self._num_evictable += len(done)
        else:
            for key in done:
                slot = slot_of.pop(key)
                self._key_of[slot] = None
                self._free.append(slot)
                self.policy.remove(key)
        self._events.append(OffloadingEvent(done, self.medium, removed=not success))
        return done

    # --- events and reset --------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget every key (a removal event lists them) and start a new generation."""
        if self._slot_of:
            self._events.append(OffloadingEvent(list(self._slot_of), self.medium, removed=True))
        self._slot_of.clear()
        self._key_of[:] = [None] * self.num_slots
        self.policy.clear()
        self._req_group.clear()
        self._seen.clear()
        self._reset_counters()
        self.generation += 1
