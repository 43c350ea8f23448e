"""Scenario tests of the tiering state machine (sans-I/O): cascades, promotions, lookups."""

from __future__ import annotations

import random

import pytest

from kvtier_async.ledger import (
    ARCPolicy,
    JobKind,
    LedgerError,
    LookupResult,
    Medium,
    PrimaryLedger,
    StorePolicy,
    TieringLedger,
    TierTask,
    make_offload_key,
)

HIT, MISS, PENDING, RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def tiering(capacity: int = 8, tiers: int = 1, **kwargs: object) -> TieringLedger:
    names = [f"t{i}" for i in range(tiers)]
    return TieringLedger(PrimaryLedger(capacity), names, **kwargs)  # type: ignore[arg-type]


def store(led: TieringLedger, ids: list[int], req: str = "w") -> None:
    out = led.prepare_store(ks(*ids), req)
    assert out is not None
    led.complete_store(out.keys_to_store)


def of_kind(tasks: list[TierTask], kind: JobKind) -> list[TierTask]:
    return [t for t in tasks if t.kind is kind]


def apply_all(led: TieringLedger, tasks: list[TierTask], ok: bool = True) -> None:
    for task in tasks:
        led.apply(task.task_id, [ok] * len(task.keys))


def answer_lookups(led: TieringLedger, present: set[bytes]) -> None:
    for task in of_kind(led.take_tasks(), JobKind.LOOKUP):
        led.apply(task.task_id, [key in present for key in task.keys])


def test_store_cascades_to_every_tier_with_pins() -> None:
    led = tiering(tiers=2)
    # store [1, 2]: after the GPU->CPU copy, one cascade per tier, each pinning both slots
    store(led, [1, 2])
    tasks = led.take_tasks()
    assert [(t.kind, t.tier, t.keys) for t in tasks] == [
        (JobKind.CASCADE, 0, tuple(ks(1, 2))),
        (JobKind.CASCADE, 1, tuple(ks(1, 2))),
    ]
    assert led.primary.ref_count(k(1)) == 2
    assert led.has_pending_work()
    # the cascades finish: pins released, the tiers announce the blocks
    apply_all(led, tasks)
    assert led.primary.ref_count(k(1)) == 0
    assert not led.has_pending_work()
    storage = [e for e in led.take_events() if e.medium is Medium.STORAGE]
    assert [(e.tier, e.keys) for e in storage] == [("t0", ks(1, 2)), ("t1", ks(1, 2))]


def test_cascades_can_stay_queued_while_other_work_goes() -> None:
    led = tiering(tiers=1)
    store(led, [1, 2])
    assert led.queued_cascades == 2 and not led.has_urgent_work()
    assert led.take_tasks(cascades=False) == []
    assert led.lookup(k(7), "r") is RETRY
    assert led.has_urgent_work()
    [lookup] = led.take_tasks(cascades=False)  # the lookup goes; the cascade stays, pinned
    assert lookup.kind is JobKind.LOOKUP and led.queued_cascades == 2
    assert led.primary.ref_count(k(1)) == 1 and not led.has_urgent_work()
    [cascade] = led.take_tasks()
    assert cascade.kind is JobKind.CASCADE and cascade.keys == (k(1), k(2))
    assert led.queued_cascades == 0
    apply_all(led, [lookup, cascade])
    assert led.primary.ref_count(k(1)) == 0 and not led.has_pending_work()


def test_cascade_waits_for_the_gpu_to_cpu_copy() -> None:
    led = tiering()
    out = led.prepare_store(ks(1), "r")
    assert out is not None
    # nothing cascades before the copy into the CPU tier is confirmed
    assert led.take_tasks() == []
    led.complete_store(ks(1), success=False)
    assert led.take_tasks() == []


def test_lookup_retry_then_promotion_then_hit() -> None:
    led = tiering()
    # first lookup of a primary miss: the tier has not answered: RETRY
    assert led.lookup(k(1), "r") is RETRY
    # the batched lookup finds it: the next lookup reserves a slot and promotes
    answer_lookups(led, {k(1)})
    assert led.lookup(k(1), "r") is PENDING
    assert led.primary.ref_count(k(1)) == -1
    assert led.lookup(k(1), "r") is PENDING  # not promoted twice
    [task] = led.take_tasks()
    assert task.kind is JobKind.PROMOTE and task.keys == (k(1),)
    # the promotion lands: readable
    apply_all(led, [task])
    assert led.lookup(k(1), "r") is HIT


def test_absent_everywhere_is_a_miss() -> None:
    led = tiering(tiers=2)
    assert led.lookup(k(1), "r") is RETRY
    answer_lookups(led, set())
    assert led.lookup(k(1), "r") is MISS


def test_tiers_are_asked_in_order() -> None:
    led = tiering(tiers=2)
    led.lookup(k(1), "r")
    tasks = led.take_tasks()
    assert sorted(t.tier for t in tasks) == [0, 1]
    led.apply(tasks[0].task_id, [tasks[0].tier == 1])
    led.apply(tasks[1].task_id, [tasks[1].tier == 1])
    assert led.lookup(k(1), "r") is PENDING
    [promote] = led.take_tasks()
    assert promote.tier == 1


def test_walk_prefix_counts_leading_hits_and_says_what_is_on_its_way() -> None:
    led = tiering()
    store(led, [1, 2, 4])
    apply_all(led, led.take_tasks())  # cascades: [1, 2, 4] are in the tier too
    # [1, 2] hit; 3 has no answer yet; 4 hits but follows a pending key: not counted
    assert led.walk_prefix("r", [ks(1, 2, 3, 4)]) == (2, True)
    answer_lookups(led, set())  # 3 is nowhere
    assert led.walk_prefix("r", [ks(1, 2, 3, 4)]) == (2, False)  # the walk stops at 3
    # two KV-cache groups: a position is a hit when both of its keys are
    assert led.walk_prefix("r", [ks(1, 2), ks(4, 1)]) == (2, False)
    assert led.walk_prefix("r", [ks(1, 2), ks(4, 3)]) == (1, False)  # 3 misses
    # a pending key in one group makes the position pending; every group's key is asked
    assert led.walk_prefix("r", [ks(1, 5, 2), ks(4, 1, 6)]) == (1, True)
    assert {t.keys for t in led.take_tasks()} == {(k(5), k(6))}  # one lookup batch, both


def test_a_tier_has_one_lookup_out_and_the_keys_asked_meanwhile_go_together() -> None:
    led = tiering(tiers=2)
    assert led.lookup(k(1), "a") is RETRY
    first = of_kind(led.take_tasks(), JobKind.LOOKUP)
    assert sorted((t.tier, t.keys) for t in first) == [(0, (k(1),)), (1, (k(1),))]
    for i in (2, 3):  # asked while both lookups are out: no new lookup
        assert led.lookup(k(i), "b") is RETRY
        assert of_kind(led.take_tasks(), JobKind.LOOKUP) == []
    assert led.has_pending_work()
    tier0 = next(t for t in first if t.tier == 0)
    led.apply(tier0.task_id, [False])  # tier 0 answered: its waiting keys go, tier 1's wait
    [second] = of_kind(led.take_tasks(), JobKind.LOOKUP)
    assert (second.tier, second.keys) == (0, (k(2), k(3)))
    tier1 = next(t for t in first if t.tier == 1)
    led.apply(tier1.task_id, [False])
    [third] = of_kind(led.take_tasks(), JobKind.LOOKUP)
    assert (third.tier, third.keys) == (1, (k(2), k(3)))
    led.apply(second.task_id, [False, True])
    led.apply(third.task_id, [False, False])
    assert led.walk_prefix("b", [ks(2)]) == (0, False)  # nowhere: a miss
    assert led.lookup(k(3), "b") is PENDING  # tier 0 has it: promoted
    assert led.walk_prefix("a", [ks(1)]) == (0, False)


def test_version_changes_with_whatever_could_change_a_walk() -> None:
    """A walk answers as the last one did while `version` stays (the vLLM connector's memo
    relies on it); each change that could change a walk moves it, and the walk with it."""
    led = tiering(tiers=1)
    store(led, [1])
    apply_all(led, led.take_tasks())  # the cascade: the tier has 1
    assert led.walk_prefix("r", [ks(1, 2, 3)]) == (1, True)  # 2 and 3 asked
    version = led.version
    # asked again, handed out, positions noted, touched: nothing a walk reads changed
    assert led.walk_prefix("r", [ks(1, 2, 3)]) == (1, True)
    [lookup] = led.take_tasks()
    led.note_positions("r", ks(1, 2, 3))
    led.touch(ks(1))
    assert led.version == version
    assert led.walk_prefix("r", [ks(1, 2, 3)]) == (1, True)
    # the answer: nowhere. The RETRY turns into a MISS
    led.apply(lookup.task_id, [False, False])
    assert led.version > version
    assert led.walk_prefix("r", [ks(1, 2, 3)]) == (1, False)
    # a key the walk hit is evicted (the primary is full of other keys)
    version = led.version
    small = tiering(capacity=2, tiers=0)
    store(small, [1, 2])
    assert small.walk_prefix("r", [ks(1, 2)]) == (2, False)
    version = small.version
    store(small, [3, 4])  # evicts 1 and 2
    assert small.version > version and small.walk_prefix("r", [ks(1, 2)]) == (0, False)
    # a key being written becomes readable; a pin and an unpin count too (the room for a
    # promotion)
    out = small.prepare_store(ks(5), "w")
    assert out is not None and small.walk_prefix("r", [ks(5)]) == (0, True)
    version = small.version
    small.complete_store(ks(5))
    assert small.version > version and small.walk_prefix("r", [ks(5)]) == (1, False)
    for change in (lambda: small.prepare_load(ks(5)), lambda: small.complete_load(ks(5))):
        version = small.version
        change()
        assert small.version > version
    # a tier's answers: found (then promoted), removed by the tier, a reset
    version = led.version
    assert led.walk_prefix("s", [ks(4)]) == (0, True)
    assert led.version == version  # asked: nothing changed yet
    [lookup] = led.take_tasks()
    led.apply(lookup.task_id, [True])
    assert led.version > version
    version = led.version
    assert led.walk_prefix("s", [ks(4)]) == (0, True)  # its promotion started
    assert led.version > version  # a slot reserved
    version = led.version
    [promote] = led.take_tasks()
    apply_all(led, [promote])
    assert led.version > version and led.walk_prefix("s", [ks(4)]) == (1, False)
    version = led.version
    led.tier_removed(0, ks(9))
    assert led.version > version
    version = led.version
    led.reset()
    assert led.version > version


@pytest.mark.parametrize("seed", range(6))
def test_a_walk_at_the_same_version_answers_as_the_last_one(seed: int) -> None:
    """Random stores, loads, evictions, tier answers, promotions, removals and resets: each
    time a request walks a prefix it walked before, at the version that walk left, it gets
    the same answer and changes nothing (the version stays); a memo keyed on the version is
    never stale."""
    rng = random.Random(seed)
    for tiers in (0, 1, 2):
        led = tiering(capacity=6, tiers=tiers)
        prefixes = [ks(*rng.sample(range(12), rng.randint(1, 6))) for _ in range(4)]
        memo: dict[tuple[str, int], tuple[int, tuple[int, bool]]] = {}
        pinned: list[list[bytes]] = []
        writing: list[list[bytes]] = []
        tasks: list[TierTask] = []
        recalled = 0
        for _ in range(300):
            op = rng.randrange(8)
            if op <= 2:  # a walk
                req, which = rng.choice("ab"), rng.randrange(len(prefixes))
                before = memo.pop((req, which), None)
                answer = led.walk_prefix(req, [prefixes[which]])
                if before is not None and before[0] == led.version:
                    assert answer == before[1], (seed, tiers)
                    recalled += 1
                if led.walk_stable:
                    memo[req, which] = (led.version, answer)
            elif op == 3:  # a store begins, or one ends
                if writing and rng.random() < 0.5:
                    led.complete_store(writing.pop(0), success=rng.random() < 0.9)
                else:
                    out = led.prepare_store(ks(*rng.sample(range(12), 2)), "w")
                    if out is not None and out.keys_to_store:
                        writing.append(out.keys_to_store)
            elif op == 4:
                keys = [key for key in ks(*range(12)) if led.primary.lookup(key) is HIT][:2]
                if keys and rng.random() < 0.5:
                    led.prepare_load(keys, "p")
                    pinned.append(keys)
                elif pinned:
                    led.complete_load(pinned.pop())
            elif op == 5:
                tasks += led.take_tasks()
            elif op == 6 and tasks:
                task = tasks.pop(rng.randrange(len(tasks)))
                led.apply(task.task_id, [rng.random() < 0.5 for _ in task.keys])
            elif op == 7:
                if tiers and rng.random() < 0.3:
                    led.tier_removed(rng.randrange(tiers), ks(rng.randrange(12)))
                elif rng.random() < 0.1:  # its lookup answers go: its next walk asks again
                    done = rng.choice("ab")
                    led.request_finished(done)
                    memo = {key: value for key, value in memo.items() if key[0] != done}
        assert recalled > 3, (seed, tiers)  # the check ran


def test_walk_prefix_answers_as_lookup_does() -> None:
    """The walk reads the primary and a lone tier's answers itself: every walk's answer is
    that of `lookup` key by key, with the same effects (probes asked, promotions)."""
    for tiers in (0, 1, 2):
        walked, looked = tiering(capacity=4, tiers=tiers), tiering(capacity=4, tiers=tiers)
        for led in (walked, looked):
            store(led, [1, 2])
            out = led.prepare_store(ks(3), "w")  # 3 is being written
            assert out is not None
            apply_all(led, led.take_tasks())
        keys = ks(1, 3, 2, 4, 5)
        for step in range(3):
            hits, pending = walked.walk_prefix("r", [keys])
            results = []
            for key in keys:
                result = looked.lookup(key, "r")
                results.append(result)
                if result is MISS:
                    break
            lead = next((i for i, r in enumerate(results) if r is not HIT), len(results))
            assert hits == lead, (tiers, step)
            assert pending == any(r in (PENDING, RETRY) for r in results), (tiers, step)
            for led in (walked, looked):
                tasks = led.take_tasks()
                for task in tasks:  # the tiers hold 4, not 5
                    led.apply(task.task_id, [key == k(4) for key in task.keys])
            assert walked.primary.statistics() == looked.primary.statistics()
            assert walked.num_probes == looked.num_probes


def test_promotions_batch_per_tier_and_request_and_share_keys() -> None:
    led = tiering()
    for key in ks(1, 2, 3):
        led.lookup(key, "a")
    led.lookup(k(3), "b")
    answer_lookups(led, set(ks(1, 2, 3)))
    # a promotes 1, 2, 3; b's lookup of 3 sees a's promotion in flight
    assert [led.lookup(key, "a") for key in ks(1, 2, 3)] == [PENDING] * 3
    assert led.lookup(k(3), "b") is PENDING
    [task] = led.take_tasks()
    assert task.keys == tuple(ks(1, 2, 3))


def test_partial_promotion_failure_keeps_what_arrived() -> None:
    led = tiering()
    for key in ks(1, 2):
        led.lookup(key, "r")
    answer_lookups(led, set(ks(1, 2)))
    for key in ks(1, 2):
        led.lookup(key, "r")
    [task] = led.take_tasks()
    led.apply(task.task_id, [True, False])
    assert led.lookup(k(1), "r") is HIT
    # the failed load turned the cached hit into a miss: no second promotion
    assert led.lookup(k(2), "r") is MISS
    assert led.primary.statistics().writing == 0
    assert led.counters[0].promoted == 1 and led.counters[0].promote_failed == 1


def test_promotion_is_a_miss_when_the_primary_has_no_room() -> None:
    led = tiering(capacity=1)
    store(led, [9])
    apply_all(led, led.take_tasks())
    led.prepare_load(ks(9))  # the only slot is pinned
    led.lookup(k(1), "r")
    answer_lookups(led, {k(1)})
    assert led.lookup(k(1), "r") is MISS


def test_lookup_answers_live_as_long_as_a_request_holds_them() -> None:
    led = tiering()
    led.lookup(k(1), "r")
    answer_lookups(led, set())
    assert led.lookup(k(1), "r") is MISS
    # the tier gains the key meanwhile; r keeps its answer, a new request asks again
    assert led.lookup(k(1), "s") is MISS  # shares r's answer
    led.request_finished("r")
    led.request_finished("s")
    assert led.lookup(k(1), "t") is RETRY


def test_answers_of_finished_requests_are_dropped_on_arrival() -> None:
    led = tiering()
    led.lookup(k(1), "r")
    [task] = led.take_tasks()
    led.request_finished("r")
    led.apply(task.task_id, [True])
    assert led.lookup(k(1), "s") is RETRY


def test_cascade_skips_keys_a_tier_is_known_to_hold() -> None:
    led = tiering()
    led.lookup(k(1), "r")
    answer_lookups(led, {k(1)})
    led.lookup(k(1), "r")
    apply_all(led, led.take_tasks())  # promoted: the tier has it
    store(led, [1, 2], req="r")
    [cascade] = led.take_tasks()
    assert cascade.keys == (k(2),)


def test_request_level_cascades_hit_blocks_too() -> None:
    led = tiering(store_policy=StorePolicy.REQUEST_LEVEL)
    store(led, [1])
    led.take_tasks()  # cascade of 1, not applied: the tier may not have it yet
    out = led.prepare_store(ks(1, 2), "r")
    assert out is not None and out.keys_to_store == ks(2)
    [cascade] = led.take_tasks()
    assert cascade.keys == (k(1),)  # the hit block, cascaded again for this request


def test_reset_needs_a_drain_and_drops_queued_work() -> None:
    led = tiering()
    store(led, [1])
    led.lookup(k(5), "r")
    tasks = led.take_tasks()
    with pytest.raises(LedgerError, match="outstanding"):
        led.reset()
    apply_all(led, tasks)
    led.lookup(k(6), "r")  # a queued lookup, dropped by the reset
    led.reset()
    assert not led.has_pending_work()
    assert led.lookup(k(1), "r") is RETRY  # gone from the primary; the tier is asked


def test_apply_of_an_unknown_task_is_an_error() -> None:
    with pytest.raises(LedgerError, match="not outstanding"):
        tiering().apply(42, [])


def test_a_promotion_is_an_insertion_by_the_request_that_looked_up() -> None:
    led = TieringLedger(PrimaryLedger(4, policy="arc"), ["t0"])
    policy = led.primary.policy
    assert isinstance(policy, ARCPolicy)
    # r misses 1 in the primary, the tier has it: promoted for r
    assert led.lookup(k(1), "r") is RETRY
    answer_lookups(led, {k(1)})
    assert led.lookup(k(1), "r") is PENDING
    apply_all(led, led.take_tasks())
    # r loads it: not a reuse (r inserted it), so it stays in T1 when r finishes
    led.prepare_load(ks(1), "r")
    led.complete_load(ks(1))
    led.request_finished("r")
    assert list(policy.t1) == ks(1) and not policy.t2
    # s loads it: a reuse
    led.prepare_load(ks(1), "s")
    led.complete_load(ks(1))
    led.request_finished("s")
    assert list(policy.t2) == ks(1)


def test_a_cascade_pin_is_not_a_use() -> None:
    led = TieringLedger(PrimaryLedger(4, policy="arc"), ["t0"])
    store(led, [1], req="r")
    led.request_finished("r")
    [cascade] = led.take_tasks()  # pins 1 for the copy to the tier
    assert led.primary.ref_count(k(1)) == 1
    assert led.primary.num_requests == 0
    apply_all(led, [cascade])
    assert list(led.primary.policy.t1) == ks(1)  # type: ignore[attr-defined]
