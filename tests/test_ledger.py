"""Scenario tests of the primary ledger, one comment per step."""

from __future__ import annotations

import pytest

from kvtier_async.ledger import (
    ARCPolicy,
    CPUSpec,
    GPUSpec,
    LedgerError,
    LookupResult,
    Medium,
    OffloadingEvent,
    PrimaryLedger,
    TierSpec,
    get_group_idx,
    make_offload_key,
    split_offload_key,
)


def k(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), group)


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def store(ledger: PrimaryLedger, ids: list[int], req: object = None) -> list[int]:
    out = ledger.prepare_store(ks(*ids), req)
    assert out is not None
    ledger.complete_store(out.keys_to_store)
    return [int.from_bytes(split_offload_key(key)[0], "big") for key in out.evicted_keys]


def ids_of(keys: list[bytes]) -> list[int]:
    return [int.from_bytes(split_offload_key(key)[0], "big") for key in keys]


def verify_counts(ledger: PrimaryLedger) -> None:
    stats = ledger.statistics()
    assert stats.used + stats.free == stats.capacity
    assert stats.evictable + stats.writing + stats.pinned == stats.used


# --- keys and specs ---------------------------------------------------------------------


def test_key_round_trip() -> None:
    key = make_offload_key(b"\xab" * 16, 7)
    assert key == b"\xab" * 16 + b"\x00\x00\x00\x07"
    assert split_offload_key(key) == (b"\xab" * 16, 7)
    assert get_group_idx(key) == 7


@pytest.mark.parametrize("group", [-1, 1 << 32])
def test_key_rejects_bad_group(group: int) -> None:
    with pytest.raises(ValueError, match="group_idx"):
        make_offload_key(b"h", group)


def test_split_rejects_short_key() -> None:
    with pytest.raises(ValueError, match="longer than 4"):
        split_offload_key(b"\x00\x01")


def test_specs() -> None:
    gpu = GPUSpec.of([4, 5, 6, 9, 10], group_sizes=[3, 2], block_indices=[1, 0])
    assert gpu.block_ids.dtype.name == "int64"
    assert gpu.group_sizes == (3, 2) and gpu.block_indices == (1, 0)
    assert gpu.medium is Medium.GPU and CPUSpec.of([1]).medium is Medium.CPU
    with pytest.raises(ValueError, match="group_sizes"):
        GPUSpec.of([1, 2], group_sizes=[1])
    with pytest.raises(ValueError, match="block_indices"):
        GPUSpec.of([1, 2], group_sizes=[2], block_indices=[0, 0])
    with pytest.raises(ValueError, match="slot_ids"):
        TierSpec.of([k(1)], [1, 2])


# --- lookup, store, load ----------------------------------------------------------------


def test_store_lifecycle_and_lookup() -> None:
    ledger = PrimaryLedger(4)
    # prepare store [1, 2]: being written
    out = ledger.prepare_store(ks(1, 2))
    assert out is not None and out.keys_to_store == ks(1, 2)
    assert list(out.store_spec.slot_ids) == [0, 1]
    assert ledger.lookup(k(1)) is LookupResult.HIT_PENDING
    assert ledger.lookup(k(3)) is LookupResult.MISS
    # complete store: readable
    ledger.complete_store(ks(1, 2))
    assert ledger.lookup(k(1)) is LookupResult.HIT
    assert ledger.take_events() == [OffloadingEvent(ks(1, 2), Medium.CPU, removed=False)]
    verify_counts(ledger)


def test_capacity_four_evicts_oldest() -> None:
    ledger = PrimaryLedger(4)
    # store [1, 2]
    store(ledger, [1, 2])
    # store [2, 3, 4, 5]: 2 is present, 3 new keys, 2 free: evict 1 (2 is in the batch)
    out = ledger.prepare_store(ks(2, 3, 4, 5))
    assert out is not None
    assert out.keys_to_store == ks(3, 4, 5)
    assert out.evicted_keys == ks(1)
    assert sorted(out.store_spec.slot_ids) == [0, 2, 3]
    assert ledger.lookup(k(1)) is LookupResult.MISS
    verify_counts(ledger)


POLICIES = ["lru", "arc", "prefix", "reuse"]


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_fails_atomically(policy: str) -> None:
    ledger = PrimaryLedger(4, policy=policy)
    # store [1, 2, 3] and pin 1, 2
    store(ledger, [1, 2, 3])
    ledger.prepare_load(ks(1, 2))
    ledger.take_events()
    before = (ledger.statistics(), sorted(ledger.keys()))
    # prepare store [4, 5, 6]: needs 2 evictions, only 3 is evictable
    assert ledger.prepare_store(ks(4, 5, 6)) is None
    assert (ledger.statistics(), sorted(ledger.keys())) == before
    assert ledger.take_events() == []


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_never_evicts_its_own_batch(policy: str) -> None:
    ledger = PrimaryLedger(2, policy=policy)
    store(ledger, [1, 2])
    # [1, 3]: one deficit, but 1 is in the batch and 2 is the only candidate
    out = ledger.prepare_store(ks(1, 3))
    assert out is not None and out.evicted_keys == ks(2)
    # [1, 4] while 3 is being written and 1 is in the batch: nothing can go
    out2 = ledger.prepare_store(ks(1, 4))
    assert out2 is None  # 1 is protected, 3 is being written


@pytest.mark.parametrize("policy", POLICIES)
def test_writing_and_pinned_are_not_evicted(policy: str) -> None:
    ledger = PrimaryLedger(2, policy=policy)
    ledger.prepare_store(ks(1))  # 1 writing
    store(ledger, [2])
    ledger.prepare_load(ks(2))  # 2 pinned
    assert ledger.prepare_store(ks(3)) is None
    ledger.complete_load(ks(2))
    assert store(ledger, [3]) == [2]


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_frees_only_unreadable_slots(policy: str) -> None:
    ledger = PrimaryLedger(4, policy=policy)
    store(ledger, [1])
    out = ledger.prepare_store(ks(1, 2, 3))
    assert out is not None
    # complete_store failure for [1, 2, 3]: 1 was already readable and stays
    ledger.complete_store(ks(1, 2, 3), success=False)
    assert ledger.lookup(k(1)) is LookupResult.HIT
    assert ledger.lookup(k(2)) is LookupResult.MISS
    assert ledger.statistics().free == 3
    events = ledger.take_events()
    assert events[-1] == OffloadingEvent(ks(2, 3), Medium.CPU, removed=True, metadata_only=True)
    # freed slots are reused from the free list once fresh ones run out
    out = ledger.prepare_store(ks(4, 5, 6))
    assert out is not None and sorted(out.store_spec.slot_ids) == [1, 2, 3]
    verify_counts(ledger)


def test_slots_fresh_first_then_free_list() -> None:
    ledger = PrimaryLedger(3)
    store(ledger, [1])
    out = ledger.prepare_store(ks(2))
    assert out is not None
    ledger.complete_store(ks(2), success=False)  # slot 1 back on the free list
    out = ledger.prepare_store(ks(3))
    assert out is not None and list(out.store_spec.slot_ids) == [2]  # fresh first
    out = ledger.prepare_store(ks(4))
    assert out is not None and list(out.store_spec.slot_ids) == [1]  # then the free list


def test_prepare_load_pins_in_key_order_and_validates() -> None:
    ledger = PrimaryLedger(4)
    store(ledger, [1, 2, 3])
    spec = ledger.prepare_load(ks(3, 1))
    assert list(spec.slot_ids) == [2, 0]
    assert ledger.ref_count(k(3)) == 1
    # loading an absent key raises and pins nothing
    with pytest.raises(LedgerError, match="absent"):
        ledger.prepare_load(ks(2, 9))
    assert ledger.ref_count(k(2)) == 0
    # loading a key being written raises
    ledger.prepare_store(ks(4))
    with pytest.raises(LedgerError, match="being written"):
        ledger.prepare_load(ks(4))
    # double pin, then unpin twice
    ledger.prepare_load(ks(3))
    ledger.complete_load(ks(3, 3, 1))
    assert ledger.ref_count(k(3)) == 0
    with pytest.raises(LedgerError, match="not pinned"):
        ledger.complete_load(ks(3))
    verify_counts(ledger)


def test_complete_store_ignores_unknown_keys() -> None:
    ledger = PrimaryLedger(2)
    ledger.complete_store(ks(7))
    ledger.complete_store(ks(7), success=False)
    assert ledger.take_events() == []


def test_duplicate_keys_in_a_store_batch() -> None:
    ledger = PrimaryLedger(4)
    out = ledger.prepare_store(ks(1, 1, 2))
    assert out is not None and out.keys_to_store == ks(1, 2)


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_clears_and_reports(policy: str) -> None:
    ledger = PrimaryLedger(4, policy=policy)
    store(ledger, [1, 2])
    ledger.prepare_load(ks(1))
    ledger.take_events()
    ledger.reset()
    assert ledger.lookup(k(1)) is LookupResult.MISS
    assert ledger.statistics() == (4, 0, 4, 0, 0, 0, 1)
    assert ledger.take_events() == [
        OffloadingEvent(ks(1, 2), Medium.CPU, removed=True, cleared=True)
    ]
    out = ledger.prepare_store(ks(3))
    assert out is not None and list(out.store_spec.slot_ids) == [0]


# --- LRU order --------------------------------------------------------------------------


def test_lru_touch_refreshes() -> None:
    ledger = PrimaryLedger(3)
    store(ledger, [1])
    store(ledger, [2])
    store(ledger, [3])
    # touch 1: 2 is now the least recent
    ledger.touch(ks(1))
    assert store(ledger, [4]) == [2]


def test_lru_evicts_a_prefix_tail_before_its_head() -> None:
    ledger = PrimaryLedger(6)
    # request A stores the prefix [1, 2, 3] in two steps, request B stores [4, 5, 6] later
    store(ledger, [1, 2], req="A")
    store(ledger, [3], req="A")
    ledger.request_finished("A")
    store(ledger, [4, 5, 6], req="B")
    # two evictions take A's tail first: 3, then 2; the head 1 survives
    assert store(ledger, [7, 8]) == [3, 2]
    assert ledger.lookup(k(1)) is LookupResult.HIT


def test_lru_request_group_moves_on_use() -> None:
    ledger = PrimaryLedger(4)
    store(ledger, [1, 2], req="A")
    store(ledger, [3, 4], req="B")
    # A uses its prefix again: B's blocks become the oldest, tail first
    ledger.touch(ks(1, 2), req="A")
    assert store(ledger, [5]) == [4]


def test_lru_shared_prefix_moves_to_the_latest_user() -> None:
    ledger = PrimaryLedger(4)
    store(ledger, [1, 2, 3], req="A")
    store(ledger, [9], req="C")
    # B hits the head [1, 2] of A's prefix: 3 is left alone in A's (older) group
    ledger.touch(ks(1, 2), req="B")
    assert store(ledger, [10, 11]) == [3, 9]


def test_lru_evict_skips_pinned() -> None:
    ledger = PrimaryLedger(3)
    store(ledger, [1, 2, 3])
    ledger.prepare_load(ks(3, 2))
    assert store(ledger, [4]) == [1]
    ledger.prepare_load(ks(4))
    assert ledger.prepare_store(ks(5)) is None


# --- ARC --------------------------------------------------------------------------------


def arc(capacity: int) -> tuple[PrimaryLedger, ARCPolicy]:
    ledger = PrimaryLedger(capacity, policy="arc")
    assert isinstance(ledger.policy, ARCPolicy)
    return ledger, ledger.policy


def test_arc_reuse_moves_to_t2_and_survives_a_scan() -> None:
    ledger, policy = arc(3)
    store(ledger, [1, 2])
    # 1 is reused: T2
    ledger.touch(ks(1))
    assert k(1) in policy.t2 and k(2) in policy.t1
    # a scan of new keys evicts from T1 (2, then 3), never the reused 1
    assert store(ledger, [3]) == []
    assert store(ledger, [4]) == [2]
    assert store(ledger, [5]) == [3]
    assert ledger.lookup(k(1)) is LookupResult.HIT
    assert list(policy.b1) == ks(2, 3)


def test_arc_touch_of_a_key_being_written_keeps_it_in_t1() -> None:
    ledger, policy = arc(2)
    ledger.prepare_store(ks(1))
    ledger.touch(ks(1))
    assert k(1) in policy.t1


def test_arc_ghost_hit_in_b1_grows_t1_target() -> None:
    ledger, policy = arc(2)
    store(ledger, [1])
    store(ledger, [2])
    assert store(ledger, [3]) == [1]  # 1 -> B1
    assert policy.target_t1 == 0
    # storing 1 again is a B1 ghost hit: target grows by max(1, |B2|/|B1|) = 1
    store(ledger, [1])
    assert policy.target_t1 == 1
    assert k(1) not in policy.b1


def test_arc_ghost_hit_in_b2_shrinks_t1_target() -> None:
    ledger, policy = arc(2)
    store(ledger, [1])
    ledger.touch(ks(1))  # 1 -> T2
    store(ledger, [2])
    policy.target_t1 = 2.0  # favour T1: the next eviction comes from T2
    assert store(ledger, [3]) == [1]  # 1 -> B2
    store(ledger, [1])  # B2 ghost hit
    assert policy.target_t1 == 1.0


def test_arc_ghost_lists_are_capped() -> None:
    ledger, policy = arc(2)
    for i in range(10):
        store(ledger, [i])
    assert len(policy.b1) <= 2 and len(policy.b2) <= 2


def test_arc_refused_store_still_learns_from_its_ghost() -> None:
    ledger, policy = arc(2)
    store(ledger, [1])
    store(ledger, [2])
    assert store(ledger, [3]) == [1]  # B1 = [1]
    ledger.prepare_load(ks(2, 3))
    before = (ledger.statistics(), sorted(ledger.keys()))
    # storing the ghost 1 needs an eviction that cannot happen: nothing is reserved or
    # evicted, but the store miss is seen first (as vLLM does): the target grows
    assert ledger.prepare_store(ks(1)) is None
    assert (ledger.statistics(), sorted(ledger.keys())) == before
    assert policy.target_t1 == 1 and list(policy.b1) == ks(1)


def test_arc_store_miss_adapts_once_per_request() -> None:
    ledger, policy = arc(2)
    store(ledger, [1])
    store(ledger, [2])
    assert store(ledger, [3]) == [1]  # B1 = [1]
    ledger.prepare_load(ks(2, 3))
    # request r misses the ghost 1 twice (refused, then offered again): one adaptation
    assert ledger.prepare_store(ks(1), "r") is None
    assert ledger.prepare_store(ks(1), "r") is None
    assert policy.target_t1 == 1
    # another request's miss is another observation
    assert ledger.prepare_store(ks(1), "s") is None
    assert policy.target_t1 == 2


def test_arc_ready_keys_of_a_store_offer_are_reuses() -> None:
    ledger, policy = arc(4)
    store(ledger, [1, 2])  # inserted only: T1
    assert ledger.prepare_store(ks(3)) is not None  # 3 is being written
    # request r offers [1, 2, 3, 4]: 1 and 2 are ready (reuses), 3 is neither, 4 is new
    out = ledger.prepare_store(ks(1, 2, 3, 4), "r")
    assert out is not None and out.keys_to_store == ks(4)
    assert k(1) in policy.t1  # the frequency counts when the request finishes
    ledger.request_finished("r")
    # tail first: 4 (inserted) to T1's end, 2 and 1 (reused) to T2, head last
    assert list(policy.t1) == ks(3, 4) and list(policy.t2) == ks(2, 1)


def test_arc_a_key_a_request_stored_is_not_its_reuse() -> None:
    ledger, policy = arc(4)
    # r stores 1, then loads it (a cascade or a re-read): not a second access
    store(ledger, [1], req="r")
    ledger.prepare_load(ks(1), "r")
    ledger.complete_load(ks(1))
    ledger.request_finished("r")
    assert list(policy.t1) == ks(1)
    # a load by another request is
    ledger.prepare_load(ks(1), "s")
    ledger.request_finished("s")
    assert list(policy.t2) == ks(1)


# --- requests: positions, finish, anonymous calls -----------------------------------------


def test_lru_running_requests_rank_by_their_start() -> None:
    ledger = PrimaryLedger(4)
    # A starts with 1, then B stores [2, 3], then A stores 4: A's keys share A's rank
    store(ledger, [1], req="A")
    store(ledger, [2, 3], req="B")
    store(ledger, [4], req="A")
    # anonymous stores need room: A's keys go first (tail first), then B's
    assert store(ledger, [5]) == [4]
    assert store(ledger, [6]) == [1]
    assert store(ledger, [7]) == [3]


def test_lru_a_later_request_pulls_shared_keys_into_its_rank() -> None:
    ledger = PrimaryLedger(4)
    # A stores [1, 2] and finishes: fresh ranks, tail first (1 is the most recent)
    store(ledger, [1, 2], req="A")
    ledger.request_finished("A")
    # B starts later, stores 3 and loads 2: 2 joins B's rank, behind 3
    store(ledger, [3], req="B")
    ledger.prepare_load(ks(2), "B")
    ledger.complete_load(ks(2))
    assert store(ledger, [4, 5]) == [1]
    assert store(ledger, [6]) == [2]


def test_lru_an_earlier_request_does_not_pull_keys_back() -> None:
    ledger = PrimaryLedger(3)
    # C starts first (stores 9); A stores [1, 2] and finishes after it: fresh ranks
    store(ledger, [9], req="C")
    store(ledger, [1, 2], req="A")
    ledger.request_finished("A")
    # C loads 1: C's rank is older than 1's, which keeps its place
    ledger.prepare_load(ks(1), "C")
    ledger.complete_load(ks(1))
    assert store(ledger, [5]) == [9]
    assert store(ledger, [6]) == [2]
    assert store(ledger, [7]) == [1]


def test_noted_positions_order_a_request_tail_first() -> None:
    ledger = PrimaryLedger(3)
    ledger.note_positions("r", ks(1, 2, 3))  # 1 is the head, 3 the tail
    # r stores its tail first, then the head
    store(ledger, [3], req="r")
    store(ledger, [1, 2], req="r")
    # while r runs, its keys go tail first by position, not in the order they came
    assert store(ledger, [4]) == [3]
    ledger.request_finished("r")
    # finished: fresh ranks, tail first, so the head is the most recent (and 4, stored
    # before r finished, is older than both)
    assert store(ledger, [5]) == [4]
    assert store(ledger, [6]) == [2]
    assert store(ledger, [7]) == [1]


def test_derived_positions_follow_the_order_keys_are_recorded() -> None:
    ledger = PrimaryLedger(3)
    # without noted positions, the first recorded key is the head
    store(ledger, [3], req="r")
    store(ledger, [1, 2], req="r")
    assert store(ledger, [4]) == [2]
    assert store(ledger, [5]) == [1]


def test_note_positions_needs_a_request_and_a_position() -> None:
    ledger = PrimaryLedger(2)
    with pytest.raises(ValueError, match="req"):
        ledger.note_positions(None, ks(1))
    with pytest.raises(ValueError, match="first"):
        ledger.note_positions("r", ks(1), first=-1)


def test_anonymous_calls_leave_no_state() -> None:
    ledger = PrimaryLedger(4)
    store(ledger, [1, 2, 3])
    ledger.prepare_load(ks(1, 2))
    ledger.complete_load(ks(1, 2))
    assert ledger.prepare_store(ks(4, 5)) is not None
    assert ledger.num_requests == 0
    # a named request keeps its state until it finishes, or until a reset
    ledger.prepare_load(ks(1), "r")
    ledger.note_positions("s", ks(3))
    assert ledger.num_requests == 2
    ledger.request_finished("r")
    ledger.request_finished("r")  # again: nothing left, ignored
    assert ledger.num_requests == 1
    ledger.reset()
    assert ledger.num_requests == 0


def test_touch_is_vllm_touch_outside_any_request() -> None:
    ledger = PrimaryLedger(3)
    store(ledger, [1, 2, 3], req="r")
    ledger.request_finished("r")
    # touch [2, 3]: fresh ranks tail first, so 1 is now the oldest, then 3
    ledger.touch(ks(2, 3), "s")
    assert ledger.num_requests == 0
    assert store(ledger, [4]) == [1]
    assert store(ledger, [5]) == [3]


def test_failed_write_event_drops_keys_written_again() -> None:
    ledger = PrimaryLedger(4)
    ledger.prepare_store(ks(1, 2))
    ledger.complete_store(ks(1, 2), success=False)
    # 1 is offered again before the events are taken: its failure is old news
    ledger.prepare_store(ks(1))
    assert ledger.take_events() == [
        OffloadingEvent(ks(2), Medium.CPU, removed=True, metadata_only=True)
    ]


# --- policy by name / module path, admission threshold -----------------------------------


def test_policy_by_module_path() -> None:
    ledger = PrimaryLedger(2, policy="kvtier_async.ledger.policies:ARCPolicy")
    assert isinstance(ledger.policy, ARCPolicy)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("fifo", "eviction_policy must be one of"),
        ("kvtier_async.ledger:LedgerError", "CachePolicy"),
    ],
)
def test_bad_policy_names(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PrimaryLedger(2, policy=name)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [("num_slots", {"num_slots": 0}), ("store_threshold", {"num_slots": 1, "store_threshold": 0})],
)
def test_bad_arguments_name_the_field(field: str, kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=field):
        PrimaryLedger(**kwargs)


def test_store_threshold_admits_on_the_nth_offer() -> None:
    ledger = PrimaryLedger(4, store_threshold=2)
    # first offer of [1, 2]: nothing stored
    out = ledger.prepare_store(ks(1, 2))
    assert out is not None and out.keys_to_store == []
    # second offer of [1], first of [3]: only 1 is admitted
    out = ledger.prepare_store(ks(1, 3))
    assert out is not None and out.keys_to_store == ks(1)


def test_store_threshold_counts_a_refused_offer() -> None:
    ledger = PrimaryLedger(1, store_threshold=2)
    store(ledger, [1])
    store(ledger, [1])
    ledger.prepare_load(ks(1))
    # first offer of 2 is counted (nothing admitted)
    assert ledger.prepare_store(ks(2)) is not None
    # [2, 3]: 2 is admitted but there is no room: refused, after counting the offer
    assert ledger.prepare_store(ks(2, 3)) is None
    ledger.complete_load(ks(1))
    # so 3 is admitted at its next offer
    out = ledger.prepare_store(ks(3))
    assert out is not None and out.keys_to_store == ks(3)


def test_store_threshold_counts_resident_keys_too() -> None:
    ledger = PrimaryLedger(4, store_threshold=2, max_tracker_size=2)
    # the tracker holds 2 counts; an offer's own keys are never pushed out by it
    assert ledger.prepare_store(ks(1, 2, 3)) is not None  # 1 and 2 counted, 3 not
    out = ledger.prepare_store(ks(3, 1))  # 3 pushes out 2 (the oldest not offered)
    assert out is not None and out.keys_to_store == ks(1)
    out = ledger.prepare_store(ks(2, 3))
    assert out is not None and out.keys_to_store == ks(3)
