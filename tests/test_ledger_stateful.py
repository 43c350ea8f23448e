"""Random operation sequences against the primary ledger, with its invariants after each step."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier_async.ledger import (
    LedgerError,
    LookupResult,
    LRUPolicy,
    PrimaryLedger,
    make_offload_key,
)
from kvtier_async.ledger.adaptive import CANDIDATES, AdaptivePolicy
from kvtier_async.ledger.keyed_policy import KeyedPolicy
from kvtier_async.ledger.prefix_policy import PrefixPolicy
from kvtier_async.ledger.reuse_policy import ReusePolicy
from kvtier_async.ledger.s3fifo import S3FIFOPolicy
from kvtier_async.ledger.sieve import SievePolicy
from kvtier_async.ledger.tinylfu import TinyLFUPolicy
from ledger_requests import live

KEYS = [make_offload_key(i.to_bytes(4, "big"), i % 2) for i in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
NAMED = ["a", "b", "c"]
reqs = st.sampled_from([None, *NAMED])


class LedgerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.ledger = PrimaryLedger(5, policy=self.policy, store_threshold=1)
        self.pins: Counter[bytes] = Counter()  # what the test pinned and has not unpinned
        self.writing: set[bytes] = set()
        self.announced: set[bytes] = set()  # readable keys according to the events

    # --- helpers ------------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        led = self.ledger
        return (led.statistics(), dict(led._slot_of), list(led._ref), list(led._free))

    def apply_events(self) -> None:
        for event in self.ledger.take_events():
            if event.removed:
                self.announced.difference_update(event.keys)
            else:
                self.announced.update(event.keys)

    def readable(self) -> list[bytes]:
        return [key for key in KEYS if self.ledger.lookup(key) is LookupResult.HIT]

    # --- rules --------------------------------------------------------------------------

    @rule(keys=key_lists, req=reqs)
    def prepare_store(self, keys: list[bytes], req: str | None) -> None:
        before = self.snapshot()
        present = {key for key in keys if key in self.ledger}
        out = self.ledger.prepare_store(keys, req)
        if out is None:
            assert self.snapshot() == before
            return
        assert not set(out.keys_to_store) & present
        assert not set(out.evicted_keys) & set(keys)
        assert not set(out.evicted_keys) & (set(self.pins) | self.writing)
        assert len(out.store_spec) == len(out.keys_to_store)
        self.writing.update(out.keys_to_store)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.writing)), min_size=1))
        self.ledger.complete_store(keys, success)
        self.writing.difference_update(keys)
        for key in set(keys):
            expected = LookupResult.HIT if success else LookupResult.MISS
            assert self.ledger.lookup(key) is expected

    @rule(data=st.data(), req=reqs, record=st.booleans())
    def prepare_load(self, data: st.DataObject, req: str | None, record: bool) -> None:
        readable = self.readable()
        keys = data.draw(st.lists(st.sampled_from(readable), max_size=4)) if readable else []
        spec = self.ledger.prepare_load(keys, req, record=record)
        assert [self.ledger.slot_of(key) for key in keys] == list(spec.slot_ids)
        self.pins.update(keys)

    @rule(req=st.sampled_from(NAMED), keys=key_lists, first=st.integers(0, 8))
    def note_positions(self, req: str, keys: list[bytes], first: int) -> None:
        before = self.snapshot()
        self.ledger.note_positions(req, keys, first)
        assert self.snapshot() == before

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = sorted(self.pins.elements())
        keys = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=3, unique=True))
        self.ledger.complete_load(keys)
        self.pins.subtract(keys)
        self.pins = +self.pins

    @rule(keys=key_lists)
    def load_of_missing_key_changes_nothing(self, keys: list[bytes]) -> None:
        missing = [key for key in KEYS if self.ledger.lookup(key) is not LookupResult.HIT]
        if not missing:
            return
        before = self.snapshot()
        try:
            self.ledger.prepare_load([*keys, missing[0]])
        except LedgerError:
            pass
        else:
            raise AssertionError("prepare_load of an unreadable key did not raise")
        assert self.snapshot() == before

    @rule(keys=key_lists, req=reqs)
    def touch(self, keys: list[bytes], req: str | None) -> None:
        before = self.ledger.statistics()
        self.ledger.touch(keys, req)
        assert self.ledger.statistics() == before

    @rule(req=st.sampled_from(NAMED))
    def request_finished(self, req: str) -> None:
        before = self.snapshot()
        self.ledger.request_finished(req)
        assert self.snapshot() == before
        assert req not in self.ledger._reqs

    @rule()
    def reset(self) -> None:
        self.ledger.reset()
        self.pins.clear()
        self.writing.clear()

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def slots_are_owned_once(self) -> None:
        led = self.ledger
        owned = list(led._slot_of.values())
        free = led._free + list(range(led._fresh, led.num_slots))
        assert len(set(owned)) == len(owned)  # no slot has two owners
        assert sorted(owned + free) == list(range(led.num_slots))  # nor is owned and free
        for slot in owned:
            assert led._ref[slot] >= -1

    @invariant()
    def counters_match_a_scan(self) -> None:
        led = self.ledger
        refs = [led._ref[slot] for slot in led._slot_of.values()]
        stats = led.statistics()
        assert stats.used + stats.free == stats.capacity
        assert stats.writing == refs.count(-1)
        assert stats.evictable == refs.count(0)
        assert stats.pinned == sum(r > 0 for r in refs)

    @invariant()
    def pinned_and_writing_keys_stay(self) -> None:
        for key, count in self.pins.items():
            assert self.ledger.ref_count(key) == count
        for key in self.writing:
            assert self.ledger.ref_count(key) == -1

    @invariant()
    def only_running_named_requests_have_state(self) -> None:
        assert set(self.ledger._reqs) <= set(NAMED)  # anonymous calls leave nothing

    @invariant()
    def lru_buckets_hold_each_key_once(self) -> None:
        policy, led = self.ledger.policy, self.ledger
        if not isinstance(policy, LRUPolicy):
            return
        buckets = policy._buckets
        assert set(policy._where) == set(led.keys())
        for key, bucket in policy._where.items():
            assert key in bucket.keys and buckets[bucket.rank] is bucket
        assert sum(len(bucket.keys) for bucket in buckets.values()) == len(led.keys())
        assert list(buckets) == sorted(buckets)  # rank order
        for bucket in buckets.values():
            assert bucket.keys or bucket.live  # only a running request keeps an empty one
        running = [s.policy_state for s in led._reqs.values() if s.policy_state is not None]
        assert sorted(id(b) for b in running) == sorted(id(b) for b in buckets.values() if b.live)
        if policy._open is not None:
            assert policy._open is list(buckets.values())[-1]

    @invariant()
    def events_agree_with_state(self) -> None:
        self.apply_events()
        assert self.announced == set(self.readable())


class ARCLedgerMachine(LedgerMachine):
    policy = "arc"

    @invariant()
    def arc_lists_partition_the_cache(self) -> None:
        policy = self.ledger.policy
        held = set(self.ledger.keys())
        t1 = {key for key in KEYS if key in policy.t1}  # type: ignore[attr-defined]
        t2 = {key for key in KEYS if key in policy.t2}  # type: ignore[attr-defined]
        assert t1 | t2 == held and not t1 & t2
        assert len(policy.b1) <= 5 and len(policy.b2) <= 5  # type: ignore[attr-defined]
        assert not (set(policy.b1) | set(policy.b2)) & held  # type: ignore[attr-defined]


class PolicyStateMachine(LedgerMachine):
    """A machine whose policy's whole state can be compared (`policy_state`): an eviction
    it refuses must leave it as it was."""

    def policy_state(self) -> tuple[object, ...]:
        raise NotImplementedError

    @rule(n=st.integers(1, 6), protected=key_lists)
    def refused_eviction_changes_nothing(self, n: int, protected: list[bytes]) -> None:
        led = self.ledger
        held = led.keys()
        candidates = [key for key in held if led.ref_count(key) == 0 and key not in protected]
        if n <= len(candidates):
            return
        before = (self.snapshot(), self.policy_state())
        assert led.policy.evict(n, set(protected)) is None
        assert (self.snapshot(), self.policy_state()) == before


class PrefixLedgerMachine(PolicyStateMachine):
    policy = "prefix"

    def policy_state(self) -> tuple[object, ...]:
        policy = self.ledger.policy
        assert isinstance(policy, PrefixPolicy)
        return (
            policy.private_keys,
            policy.shared_keys,
            dict(policy._score),
            dict(policy._next),
            list(policy._ghost_private.items()),
            list(policy._ghost_shared.items()),
            policy.target_private,
        )

    @invariant()
    def prefix_lists_partition_the_cache(self) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, PrefixPolicy)
        held = set(self.ledger.keys())
        private, shared = policy.private_keys, policy.shared_keys
        assert set(private) | set(shared) == held and not set(private) & set(shared)
        assert len(private) + len(shared) == len(held)  # each key once
        assert set(policy._score) == set(shared)
        for level, bucket in policy._buckets.items():
            assert bucket  # no empty level
            for key in bucket:
                assert policy._score[key] * policy.levels_per_octave // 1.0 == level
        assert set(policy._next) <= set(private)
        ghosts = (set(policy._ghost_private), set(policy._ghost_shared))
        assert not ghosts[0] & ghosts[1] and not (ghosts[0] | ghosts[1]) & held
        assert len(ghosts[0]) <= 5 and len(ghosts[1]) <= 5
        assert 0.0 <= policy.target_private <= 5.0


class ReuseLedgerMachine(PolicyStateMachine):
    """The ``reuse`` policy: the ledger's invariants, and its own: every held key counted
    and ordered once (cold, recent or credited, with a live heap entry), bounded ghosts."""

    policy = "reuse"

    def policy_state(self) -> tuple[object, ...]:
        policy = self.ledger.policy
        assert isinstance(policy, ReusePolicy)
        return (
            dict(policy._count),
            dict(policy._due),
            live(policy),
            list(policy._recent.items()),
            list(policy._cold),
            dict(policy._next),
            set(policy._shared),
            list(policy._ghost.items()),
            policy._clock,
        )

    @invariant()
    def every_held_key_is_ordered_once(self) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, ReusePolicy)
        held = set(self.ledger.keys())
        cold, recent, due = set(policy._cold), set(policy._recent), set(policy._due)
        assert cold | recent | due == held
        assert len(cold) + len(recent) + len(due) == len(held)  # each key once
        assert set(policy._count) == held
        assert all(policy._count[key] == 1 for key in cold | recent)
        assert all(policy._count[key] >= 2 for key in due)
        assert {(d, key) for key, d in policy._due.items()} <= set(policy._heap)
        stamps = list(policy._recent.values())
        assert stamps == sorted(stamps) and all(s <= policy._clock for s in stamps)
        assert policy.eviction_order()[: len(cold)] == list(policy._cold)
        assert sorted(policy.eviction_order()) == sorted(held)
        assert set(policy._next) <= held and policy._shared <= held
        assert not set(policy._ghost) & held and len(policy._ghost) <= 5


TestLRULedger = LedgerMachine.TestCase
TestLRULedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestARCLedger = ARCLedgerMachine.TestCase
TestARCLedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixLedger = PrefixLedgerMachine.TestCase
TestPrefixLedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestReuseLedger = ReuseLedgerMachine.TestCase
TestReuseLedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class KeyedLedgerMachine(PolicyStateMachine):
    """A policy of the caching literature (`KeyedPolicy`): the ledger's invariants, every
    held key held once by the policy, and a refused eviction that changes nothing."""

    def policy_state(self) -> tuple[object, ...]:
        policy = self.ledger.policy
        assert isinstance(policy, KeyedPolicy)
        return _keyed_state(policy)

    @invariant()
    def the_policy_holds_the_ledger_keys(self) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, KeyedPolicy)
        held = set(self.ledger.keys())
        assert len(policy) == len(held) and all(key in policy for key in held)
        order = policy.eviction_order()
        assert sorted(order) == sorted(held)  # each key once


def _keyed_state(policy: KeyedPolicy) -> tuple[object, ...]:
    if isinstance(policy, SievePolicy):
        return (policy.queue(), policy.hand_key(), sorted(policy._visited))
    if isinstance(policy, S3FIFOPolicy):
        return (
            list(policy.small),
            list(policy.main),
            list(policy.ghost),
            dict(policy.freq),
            policy.has_evicted,
        )
    assert isinstance(policy, TinyLFUPolicy)
    return (
        list(policy.window),
        list(policy.probation),
        list(policy.protected),
        bytes(policy.sketch.table),
        policy.sketch.additions,
    )


class SieveLedgerMachine(KeyedLedgerMachine):
    policy = "sieve"

    @invariant()
    def visited_keys_are_held(self) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, SievePolicy)
        assert policy._visited <= set(self.ledger.keys())


class S3FIFOLedgerMachine(KeyedLedgerMachine):
    policy = "s3fifo"

    @invariant()
    def queues_partition_the_cache(self) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, S3FIFOPolicy)
        held = set(self.ledger.keys())
        assert set(policy.small) | set(policy.main) == held
        assert not set(policy.small) & set(policy.main)
        assert not set(policy.ghost) & held and len(policy.ghost) <= policy.ghost_capacity
        assert set(policy.freq) == held and min(policy.freq.values(), default=0) >= 0


class TinyLFULedgerMachine(KeyedLedgerMachine):
    policy = "tinylfu"

    @invariant()
    def segments_partition_the_cache(self) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, TinyLFUPolicy)
        parts = [set(policy.window), set(policy.probation), set(policy.protected)]
        assert sum(map(len, parts)) == len(set.union(*parts)) == len(self.ledger.keys())
        assert len(policy.window) <= policy.window_capacity
        assert len(policy.protected) <= policy.protected_capacity


class AdaptiveLedgerMachine(PolicyStateMachine):
    """``adaptive`` with shadows on every key (a small cache samples all): its live policy
    holds the ledger's keys whichever it is; a refused eviction changes nothing."""

    policy = "adaptive"

    def policy_state(self) -> tuple[object, ...]:
        policy = self.ledger.policy
        assert isinstance(policy, AdaptivePolicy)
        return (policy.live, policy._policy.eviction_order())  # type: ignore[attr-defined]

    @rule(name=st.sampled_from(sorted(CANDIDATES)))
    def switch(self, name: str) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, AdaptivePolicy)
        policy._switch(name)
        assert policy.live == name

    @invariant()
    def the_live_policy_holds_the_ledger_keys(self) -> None:
        policy = self.ledger.policy
        assert isinstance(policy, AdaptivePolicy)
        order = policy._policy.eviction_order()  # type: ignore[attr-defined]
        assert sorted(order) == sorted(self.ledger.keys())


TestSieveLedger = SieveLedgerMachine.TestCase
TestSieveLedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestS3FIFOLedger = S3FIFOLedgerMachine.TestCase
TestS3FIFOLedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTinyLFULedger = TinyLFULedgerMachine.TestCase
TestTinyLFULedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAdaptiveLedger = AdaptiveLedgerMachine.TestCase
TestAdaptiveLedger.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
