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

Requests. The decisions (hits, keys to store, victims) are vLLM 0.33's
``CPUOffloadingManager``'s for the same calls, and so are the signals that order the keys:
vLLM's scheduler never calls ``touch``. A request is any hashable ``req``; while it runs
the ledger keeps a `RequestAccess` for it (vLLM keeps one in the ``ReqContext``):

- ``prepare_load(keys, req)`` records the keys as seen and reused by the request (a key the
  request stored itself is not a reuse);
- ``prepare_store(keys, req)``, with ``store_threshold >= 2``, first counts the whole offer
  in the admission tracker; the absent keys admitted are store candidates, and those the
  request has not missed before are store misses (ARC adapts on its ghost lists); the
  candidates and the resident *ready* keys of the offer are recorded as seen, the ready
  ones as reuses; only then are slots reserved (all or nothing);
- ``request_finished(req)`` hands the policy the request's keys head -> tail, which of them
  it only inserted and which it reused, and drops the request's state.

A key's position in its request orders it there (tail keys go first). A caller that knows
positions (the vLLM connector: the end token of each key's block, as vLLM's scheduler sets
them) gives them with ``note_positions(req, keys, first)`` before the calls that use them;
otherwise a key gets the next position when its request first records it, which is right
when a request records its keys head -> tail.

``req=None`` is an anonymous call: a request of its own, recorded and finished before the
call returns; nothing of it outlives the call. ``touch(keys)`` (vLLM's classic signal) is
still there with vLLM's meaning: fresh recency, tail first (LRU); ready T1 keys to T2 (ARC).

What a refused call leaves behind: a refused ``prepare_load`` / ``complete_load`` changes
nothing. A ``prepare_store`` answering None reserves and evicts nothing, but keeps what
vLLM keeps from the offer: its admission counts, its store misses (and ARC's adaptation to
them) and what the request saw.

Walks and the version. `walk` is `lookup` along a prefix in one call: the loop over the
keys is here, not in every caller. ``version`` counts the calls that changed a key's state
(absent / being written / readable) or a reference count (so the room a reservation would
find): `prepare_store` when it reserved or evicted, `complete_store` when it finished a
write, `prepare_load`, `complete_load`, `reset`. While it stays the same, every `walk` and
`lookup` answers as before, and so does a reservation; a caller may keep an answer keyed on
it (the vLLM connector does: `TieringLedger.version`). A bump that changed nothing (an
empty `prepare_load`) only makes such a caller ask again.

Events: a key evicted or written is announced; a failed write announces a
``metadata_only`` removal (the key was never announced), dropped at `take_events` for keys
written again since, as vLLM does.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from typing import NamedTuple, cast

import numpy as np

from kvtier_async import defaults

from ._types import CPUSpec, LedgerError, LookupResult, Medium, OffloadingEvent, PrepareStoreOutput
from .policies import CachePolicy, RequestAccess, SlotTable
from .registry import make_policy

__all__ = ["LedgerStatistics", "PrimaryLedger"]

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_NO_SLOTS = np.zeros(0, dtype=np.int64)


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

    ``req`` arguments are any hashable request id (None: an anonymous one-call request);
    call `request_finished` when a request ends. See the module docstring.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        policy: str = defaults.EVICTION_POLICY,
        store_threshold: int = defaults.STORE_THRESHOLD,
        max_tracker_size: int = defaults.MAX_TRACKER_SIZE,
        medium: Medium = Medium.CPU,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if store_threshold < 1:
            raise ValueError(f"store_threshold must be >= 1, got {store_threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        self.num_slots = num_slots
        self.medium = medium
        self.store_threshold = store_threshold
        self._max_tracker = max_tracker_size
        self._table = SlotTable(num_slots)
        self._slot_of = self._table.slot_of
        self._ref = self._table.ref
        self.policy: CachePolicy = make_policy(policy, num_slots, self._table)
        # offers per key, oldest first (vLLM's ``counts``); only with a threshold
        self._counts: OrderedDict[bytes, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self._reqs: dict[Hashable, RequestAccess] = {}
        self._events: list[OffloadingEvent] = []
        # Off: events are not recorded at all (an owner that never takes them, such as the
        # async API with no listener, must not accumulate them).
        self.events_enabled = True
        self.generation = 0
        # Changes whenever a walk could answer otherwise (see the module docstring).
        self.version = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._free: list[int] = []
        self._fresh = 0
        self._num_evictable = 0
        self._num_writing = 0

    # --- queries -----------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        """HIT if readable, HIT_PENDING while being written, MISS if absent."""
        slot = self._slot_of.get(key)
        if slot is None:
            return _MISS
        return _HIT if self._ref[slot] >= 0 else _PENDING

    def walk(
        self,
        keys: Sequence[bytes],
        start: int = 0,
        waiting: Container[bytes] = (),
        on_absent: Callable[[bytes], bool] | None = None,
    ) -> tuple[int, int]:
        """`lookup` along ``keys[start:]``, head first, in one call: ``(ready, end)``. The
        first ``ready`` keys are readable (HIT); ``end`` is the index of the first key that
        is absent (MISS), not in ``waiting`` (the caller's keys on their way from
        elsewhere) and, when ``on_absent`` is given, not on its way either by
        ``on_absent(key)`` (True: it is; the call may store keys, evict, pin); ``len(keys)``
        if there is no such key. Every key from ``start`` to ``end`` is held (readable or
        being written) or on its way, so one of them is not readable exactly when
        ``end - start > ready``. The keys after ``end`` are not read."""
        slot_of, ref = self._slot_of, self._ref
        ready = -1  # until the first key not readable
        i = start
        for key in itertools.islice(keys, start, None) if start else keys:
            slot = slot_of.get(key)
            if slot is None:
                if key not in waiting and (on_absent is None or not on_absent(key)):
                    break
                if ready < 0:
                    ready = i - start
            elif ready < 0 and ref[slot] < 0:
                ready = i - start
            i += 1
        return (i - start if ready < 0 else ready), i

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def slot_of(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def slots_of(self, keys: Iterable[bytes]) -> list[int | None]:
        """`slot_of` of each key, in order."""
        return list(map(self._slot_of.get, keys))

    def ref_count(self, key: bytes) -> int | None:
        slot = self._slot_of.get(key)
        return None if slot is None else self._ref[slot]

    def keys(self) -> list[bytes]:
        return list(self._slot_of)

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_slots - self._fresh

    @property
    def num_requests(self) -> int:
        """Requests with state kept (recorded, not finished yet)."""
        return len(self._reqs)

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

    # --- requests ----------------------------------------------------------------------

    def note_positions(self, req: Hashable, keys: Sequence[bytes], first: int = 1) -> None:
        """Give ``keys[i]`` the position ``first + i`` in request ``req`` (vLLM: the end
        token of the key's block, ``ReqContext.set_offload_key_position``); a later note
        of a key replaces the earlier one."""
        if req is None:
            raise ValueError("note_positions needs a request id (req), got None")
        if first < 0:
            raise ValueError(f"first must be >= 0, got {first}")
        state = self._request(req)
        noted, seen = state.noted, state.seen
        if seen.keys().isdisjoint(keys):  # the rule: keys are noted before they are seen
            noted.update(zip(keys, itertools.count(first)))
        else:
            for position, key in enumerate(keys, first):
                noted[key] = position
                if key in seen and seen[key] != position:
                    seen[key] = position
                    state.in_order = False
        state.next_position = max(state.next_position, first + len(keys))

    def request_finished(self, req: Hashable) -> None:
        """The request ended: its keys get their recency (and ARC its frequency) from what
        it recorded, and its state is dropped. A request without state is ignored."""
        state = self._reqs.pop(req, None)
        if state is not None:
            self._finish(state)

    def _request(self, req: Hashable | None) -> RequestAccess:
        if req is None:
            return RequestAccess()
        state = self._reqs.get(req)
        if state is None:
            state = self._reqs[req] = RequestAccess()
        return state

    def _finish(self, state: RequestAccess) -> None:
        if state.seen or state.policy_state is not None:
            self.policy.on_request_finished(state.order(), state.inserted, state.reused, state)

    def _record(self, state: RequestAccess, keys: Sequence[bytes], reused: Sequence[bytes]) -> None:
        """vLLM's ``_record_request_cache_access``: keys seen for the first time (in call
        order) go to the policy; ``reused`` keys not inserted by the request are reuses."""
        seen, noted = state.seen, state.noted
        new = (
            list(keys)
            if not seen or seen.keys().isdisjoint(keys)
            else [key for key in keys if key not in seen]
        )
        if new:
            following = state.next_position
            if not noted:  # every position derived: in record order, after all others
                seen.update(zip(new, range(following, following + len(new))))
                state.next_position = following + len(new)
                state.last_position = following + len(new) - 1
            else:
                self._record_noted(state, new)
            self.policy.on_request_access(new, state)
        if reused:
            inserted = state.inserted
            if inserted:
                state.reused.update(key for key in reused if key not in inserted)
            else:
                state.reused.update(reused)

    @staticmethod
    def _record_noted(state: RequestAccess, new: list[bytes]) -> None:
        seen, noted = state.seen, state.noted
        found = list(map(noted.get, new))
        if None not in found:  # every position noted (the connector notes them all)
            positions = cast("list[int]", found)
            if positions[0] > state.last_position:  # from after the last one seen
                seen.update(zip(new, positions))
                if positions != sorted(set(positions)):  # not strictly rising
                    state.in_order = False
                state.last_position = positions[-1]
                return
        following, last, in_order = state.next_position, state.last_position, state.in_order
        for key in new:
            position = noted.get(key)
            if position is None:
                position = following
                following += 1
            seen[key] = position
            if position <= last:
                in_order = False
            last = position
        state.next_position, state.last_position, state.in_order = following, last, in_order

    # --- loads -------------------------------------------------------------------------

    def prepare_load(
        self, keys: Sequence[bytes], req: Hashable | None = None, *, record: bool = True
    ) -> CPUSpec:
        """Pin readable keys against eviction; their slots, in key order. The keys are a
        reuse by ``req`` unless ``record`` is False (a pin for a copy to another tier)."""
        slot_of, ref = self._slot_of, self._ref
        slots = [slot_of.get(key, -1) for key in keys]
        counts = [ref[slot] for slot in slots]
        if slots and (-1 in slots or min(counts) < 0):
            self._refuse_load(keys, slots)
        for slot in slots:
            ref[slot] += 1
        self.version += 1
        idle = counts.count(0)
        if idle:  # a key twice in ``keys`` leaves idle once
            self._num_evictable -= (
                idle
                if len(set(slots)) == len(slots)
                else len({slot for slot, count in zip(slots, counts) if count == 0})
            )
        if record:
            state = self._request(req)
            self._record(state, keys, keys)
            if req is None:
                self._finish(state)
        return CPUSpec(np.array(slots, dtype=np.int64))

    def _refuse_load(self, keys: Sequence[bytes], slots: list[int]) -> None:
        for key, slot in zip(keys, slots):
            if slot < 0 or self._ref[slot] < 0:
                state = "absent" if slot < 0 else "being written"
                raise LedgerError(f"cannot load key {key.hex()}: it is {state}")

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpin keys pinned by `prepare_load`."""
        slot_of, ref = self._slot_of, self._ref
        slots = [slot_of.get(key, -1) for key in keys]
        if -1 not in slots and len(set(slots)) == len(slots):  # the usual case, at C speed
            counts = [ref[slot] for slot in slots]
            if not slots or min(counts) > 0:
                for slot in slots:
                    ref[slot] -= 1
                self._num_evictable += counts.count(1)
                self.version += 1
                return
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
        self.version += 1

    def touch(self, keys: Sequence[bytes], req: Hashable | None = None) -> None:
        """Mark keys (head -> tail of a prefix) as recently used, as vLLM's ``touch`` does
        (``req`` is accepted like vLLM's request context, which its policies ignore)."""
        self.policy.touch(keys)

    # --- stores ------------------------------------------------------------------------

    def prepare_store(
        self, keys: Iterable[bytes], req: Hashable | None = None, *, admit_all: bool = False
    ) -> PrepareStoreOutput | None:
        """Reserve slots (state: being written) for the absent keys admitted.

        Evicts idle keys outside the batch if free slots are short. Returns None, with no
        slot reserved and nothing evicted, when not enough is evictable (the offer's
        signals are kept: see the module docstring). ``admit_all`` skips the
        ``store_threshold`` admission and its counting (promotions from a secondary tier).
        """
        batch = dict.fromkeys(keys)
        state = self._request(req)
        counts = None if admit_all else self._counts
        if counts is not None:
            self._count_offer(counts, batch)
        slot_of, ref = self._slot_of, self._ref
        new = [key for key in batch if key not in slot_of]
        ready = (
            [key for key in batch if key in slot_of and ref[slot_of[key]] >= 0]
            if len(new) < len(batch)
            else []
        )
        if counts is not None:
            need = self.store_threshold
            new = [key for key in new if counts.get(key, 0) >= need]
        if new and self.policy.observes_store_misses:
            misses = state.store_misses
            first_misses = [key for key in new if key not in misses] if misses else new
            if first_misses:
                self.policy.on_store_miss(first_misses, state)
                misses.update(first_misses)
        if ready:
            recorded = set(new).union(ready)
            self._record(state, [key for key in batch if key in recorded], ready)
        elif new:
            self._record(state, new, ())
        out = self._reserve(batch, new, state)
        if req is None:
            self._finish(state)
        return out

    def _count_offer(self, counts: OrderedDict[bytes, int], keys: Iterable[bytes]) -> None:
        """vLLM's ``_record_accesses``: count every key of the offer; a new key pushes out
        the oldest count not of this offer, or is not counted when all are of it."""
        offered = 0
        absent: list[bytes] = []
        for key in keys:
            count = counts.get(key)
            if count is None:
                absent.append(key)
            else:
                counts.move_to_end(key)
                counts[key] = count + 1
                offered += 1
        others = len(counts) - offered
        limit = self._max_tracker
        for key in absent:
            if len(counts) >= limit:
                if others == 0:
                    continue
                counts.popitem(last=False)
                others -= 1
            counts[key] = 1

    def _reserve(
        self, batch: dict[bytes, None], new: list[bytes], state: RequestAccess
    ) -> PrepareStoreOutput | None:
        """Evict (all or nothing) and allocate slots for ``new``."""
        if not new:
            return PrepareStoreOutput([], CPUSpec(_NO_SLOTS), [])
        victims: list[bytes] = []
        deficit = len(new) - self.num_free
        if deficit > 0:
            if deficit > self._num_evictable:
                return None
            found = self.policy.evict(deficit, batch)
            if found is None:
                return None
            victims = found
            self._release(victims)
        slots = self._allocate(new, state)
        state.inserted.update(new)
        self.version += 1
        return PrepareStoreOutput(new, CPUSpec(np.array(slots, dtype=np.int64)), victims)

    def _release(self, victims: list[bytes]) -> None:
        self._free.extend(map(self._slot_of.pop, victims))
        self._num_evictable -= len(victims)
        if self.events_enabled:
            self._events.append(OffloadingEvent(victims, self.medium, removed=True))

    def _emit(self, event: OffloadingEvent) -> None:
        if self.events_enabled:
            self._events.append(event)

    def _allocate(self, keys: list[bytes], state: RequestAccess) -> list[int]:
        """Fresh slots first, then the free list from its end (vLLM's order)."""
        num_fresh = min(len(keys), self.num_slots - self._fresh)
        slots = list(range(self._fresh, self._fresh + num_fresh))
        self._fresh += num_fresh
        reused = len(keys) - num_fresh
        if reused:
            free = self._free
            slots += reversed(free[-reused:])
            del free[-reused:]
        self._slot_of.update(zip(keys, slots))
        ref = self._ref
        for slot in slots:
            ref[slot] = -1
        self.policy.insert(keys, state)
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
        self.version += 1
        self._num_writing -= len(done)
        if success:
            for key in done:
                ref[slot_of[key]] = 0
            self._num_evictable += len(done)
        else:
            self._free.extend(map(slot_of.pop, done))
            for key in done:
                self.policy.remove(key)
        if self.events_enabled:
            self._events.append(
                OffloadingEvent(done, self.medium, removed=not success, metadata_only=not success)
            )
        return done

    # --- events and reset --------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, oldest first. A failed write's removal leaves out
        the keys written again since."""
        events, self._events = self._events, []
        if not any(event.metadata_only for event in events):
            return events
        slot_of, kept = self._slot_of, []
        for event in events:
            if event.metadata_only:
                gone = [key for key in event.keys if key not in slot_of]
                if not gone:
                    continue
                if len(gone) < len(event.keys):
                    event = OffloadingEvent(
                        gone, event.medium, removed=True, tier=event.tier, metadata_only=True
                    )
            kept.append(event)
        return kept

    def reset(self) -> None:
        """Forget every key (a ``cleared`` removal event lists them) and every request's
        state, and
        start a new generation; the admission counts of ``store_threshold`` stay (vLLM's
        ``reset_cache`` keeps them too)."""
        if self._slot_of:
            self._emit(
                OffloadingEvent(list(self._slot_of), self.medium, removed=True, cleared=True)
            )
        self._slot_of.clear()
        self.policy.clear()
        self._reqs.clear()  # the admission counts stay, as in vLLM
        self._reset_counters()
        self.generation += 1
        self.version += 1
