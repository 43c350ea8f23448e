"""The eviction policies of the caching literature (``sieve``, ``s3fifo``, ``tinylfu``) and
the ``adaptive`` choice among policies, driven as vLLM 0.33's scheduler drives the ledger:
look up, load the hits, store the rest, finish.

The worked examples follow each paper's algorithm step by step on one-key requests (the
papers' caches see one object per request), with the state after each step written out;
the state machines (tests/test_ledger_stateful.py) check them on random operations."""

from __future__ import annotations

import random
from collections import deque

import pytest

from kvtier_async.api import CacheConfig
from kvtier_async.integrations.vllm.config import ConnectorConfig
from kvtier_async.ledger import PrimaryLedger, make_policy
from kvtier_async.ledger.adaptive import LEAD_EPOCHS, AdaptivePolicy, _significant_lead
from kvtier_async.ledger.policies import SlotTable
from kvtier_async.ledger.s3fifo import S3FIFOPolicy
from kvtier_async.ledger.sieve import SievePolicy
from kvtier_async.ledger.tinylfu import FrequencySketch, TinyLFUPolicy
from ledger_requests import k, ks, request

NEW = {"sieve": SievePolicy, "s3fifo": S3FIFOPolicy, "tinylfu": TinyLFUPolicy}


@pytest.mark.parametrize("name", [*NEW, "adaptive"])
def test_each_policy_by_name_in_the_ledger_and_both_configs(name: str) -> None:
    assert isinstance(make_policy(name, 4, SlotTable(4)), {**NEW, "adaptive": AdaptivePolicy}[name])
    api = CacheConfig.from_dict({"block_bytes": 64, "num_slots": 4, "eviction_policy": name})
    assert api.eviction_policy == name
    extra = {"cpu_bytes_to_use": 1 << 20, "eviction_policy": name}
    assert ConnectorConfig.from_extra_config(extra).eviction_policy == name


def test_a_misspelt_policy_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"eviction_policy.*s3fifo.*sieve.*tinylfu"):
        CacheConfig.from_dict({"block_bytes": 64, "num_slots": 4, "eviction_policy": "s3-fifo"})


def one_key_requests(ledger: PrimaryLedger, ids: list[int]) -> list[int]:
    """Each id a request of its own; the ids that hit."""
    return [i for n, i in enumerate(ids) if request(ledger, [i], f"q{n}-{i}")]


# --- SIEVE -----------------------------------------------------------------------------


def test_sieve_worked_example() -> None:
    ledger = PrimaryLedger(4, policy="sieve")
    policy = ledger.policy
    assert isinstance(policy, SievePolicy)
    one_key_requests(ledger, [1, 2, 3, 4])
    assert policy.queue() == ks(1, 2, 3, 4) and policy.hand_key() == k(1)  # tail first
    assert one_key_requests(ledger, [1, 3]) == [1, 3]  # hits set the bit, move nothing
    assert policy.queue() == ks(1, 2, 3, 4) and policy.visited(k(1)) and policy.visited(k(3))
    # 5 misses: the hand passes 1 (visited: its bit cleared, it stays), evicts 2, stops at 3
    one_key_requests(ledger, [5])
    assert policy.queue() == ks(1, 3, 4, 5) and policy.hand_key() == k(3)
    assert not policy.visited(k(1)) and policy.visited(k(3))
    # 6: 3 loses its bit, 4 goes; the hand stops at 5
    one_key_requests(ledger, [6])
    assert policy.queue() == ks(1, 3, 5, 6) and policy.hand_key() == k(5)
    # 3 is read again; 7 and 8 each evict the newest unvisited key under the hand: quick
    # demotion of keys read once, while 1 and 3 keep their places
    assert one_key_requests(ledger, [3, 7]) == [3]
    assert policy.queue() == ks(1, 3, 6, 7) and policy.hand_key() == k(6)
    one_key_requests(ledger, [8])
    assert policy.queue() == ks(1, 3, 7, 8) and policy.hand_key() == k(7)
    # 8 is read; 9 evicts 7. 9 is read; for 10 the hand clears 8's and 9's bits, reaches
    # the head, wraps to the tail and evicts 1, unvisited since its bit was cleared
    assert one_key_requests(ledger, [8, 9]) == [8]
    assert policy.queue() == ks(1, 3, 8, 9) and policy.hand_key() == k(8)
    assert one_key_requests(ledger, [9, 10]) == [9]
    assert policy.queue() == ks(3, 8, 9, 10) and policy.hand_key() == k(3)
    assert policy.visited(k(3)) and not policy.visited(k(8)) and not policy.visited(k(9))
    # 11: 3 keeps its place once more, 8 goes
    one_key_requests(ledger, [11])
    assert policy.queue() == ks(3, 9, 10, 11) and policy.hand_key() == k(9)


def test_sieve_passes_over_pinned_keys_and_refuses_all_or_nothing() -> None:
    ledger = PrimaryLedger(3, policy="sieve")
    policy = ledger.policy
    assert isinstance(policy, SievePolicy)
    one_key_requests(ledger, [1, 2, 3])
    ledger.prepare_load(ks(1, 2))  # pinned: the hand passes them
    out = ledger.prepare_store(ks(4))
    assert out is not None and out.evicted_keys == ks(3)
    ledger.complete_store(out.keys_to_store)
    before = (policy.queue(), policy.hand_key())
    assert ledger.prepare_store(ks(5, 6)) is None  # only 4 could go: nothing goes
    assert (policy.queue(), policy.hand_key()) == before


# --- S3-FIFO ---------------------------------------------------------------------------


def test_s3fifo_worked_example() -> None:
    ledger = PrimaryLedger(10, policy="s3fifo")
    policy = ledger.policy
    assert isinstance(policy, S3FIFOPolicy)
    assert (policy.small_capacity, policy.main_capacity, policy.ghost_capacity) == (1, 9, 9)
    # Before the first eviction, a full S sends new keys to M.
    one_key_requests(ledger, list(range(1, 11)))
    assert list(policy.small) == ks(1) and list(policy.main) == ks(*range(2, 11))
    assert one_key_requests(ledger, [1, 1, 2]) == [1, 1, 2]
    assert policy.freq[k(1)] == 2 and policy.freq[k(2)] == 1
    # 11: S's 1 was read twice: to M, count reset; M is over its share: its oldest, 2, was
    # read once: back to M's head, count 0; 3 was never read: evicted (M's victims leave no
    # ghost). 11 joins S.
    one_key_requests(ledger, [11])
    assert list(policy.small) == ks(11)
    assert list(policy.main) == ks(*range(4, 11), 1, 2)
    assert k(3) not in policy and not policy.ghost
    # 12: S's 11, never read, leaves at once, remembered by the ghost (quick demotion)
    one_key_requests(ledger, [12])
    assert list(policy.small) == ks(12) and list(policy.ghost) == ks(11)
    # 11 comes back: 12 leaves S for the ghost, 11 (remembered) joins M directly
    one_key_requests(ledger, [11])
    assert list(policy.small) == [] and list(policy.ghost) == ks(12)
    assert list(policy.main) == ks(*range(4, 11), 1, 2, 11)
    # 13: M over its share again: its oldest, 4, goes
    one_key_requests(ledger, [13])
    assert k(4) not in policy and list(policy.small) == ks(13)


def test_s3fifo_refused_eviction_changes_nothing() -> None:
    ledger = PrimaryLedger(10, policy="s3fifo")
    policy = ledger.policy
    assert isinstance(policy, S3FIFOPolicy)
    one_key_requests(ledger, [*range(1, 12), 1, 1, 5])
    ledger.prepare_load(ks(*range(2, 11)))  # all but two pinned
    state = (list(policy.small), list(policy.main), list(policy.ghost), dict(policy.freq))
    assert ledger.prepare_store(ks(20, 21, 22)) is None
    assert (list(policy.small), list(policy.main), list(policy.ghost), dict(policy.freq)) == state


# --- W-TinyLFU -------------------------------------------------------------------------


def test_the_sketch_never_undercounts_saturates_and_halves() -> None:
    sketch = FrequencySketch(64)
    assert sketch.width == 64 and sketch.sample_size == 640
    rng = random.Random(7)
    truth: dict[bytes, int] = {}
    for _ in range(500):
        key = k(rng.randrange(100))
        truth[key] = truth.get(key, 0) + 1
        sketch.add(key)
    assert all(sketch.estimate(key) >= min(count, 15) for key, count in truth.items())
    hot = k(1000)
    for _ in range(30):
        sketch.add(hot)
    assert sketch.estimate(hot) == 15  # 4-bit counters
    # The sample's last addition: it is counted, then every counter halves (a reset).
    while sketch.additions < sketch.sample_size - 1:
        sketch.add(k(5000))
    expected = bytearray(sketch.table)
    for i in sketch._indices(k(6000)):
        expected[i] = min(15, expected[i] + 1)
    sketch.add(k(6000))
    assert sketch.table == bytes(v >> 1 for v in expected)
    assert sketch.additions == 320
    assert sketch.estimate(hot) == 7


def test_tinylfu_worked_example() -> None:
    ledger = PrimaryLedger(10, policy="tinylfu")
    policy = ledger.policy
    assert isinstance(policy, TinyLFUPolicy)
    assert (policy.window_capacity, policy.protected_capacity) == (1, 7)
    one_key_requests(ledger, list(range(1, 11)))  # room: the window's overflow to probation
    assert list(policy.window) == ks(10) and list(policy.probation) == ks(*range(1, 10))
    assert one_key_requests(ledger, [5, 5, 5]) == [5, 5, 5]
    assert list(policy.protected) == ks(5)  # a probation hit is promoted
    freq = policy.sketch.estimate
    # 11: the window's 10 (read once: its store) duels probation's 1 (read once): a tie
    # keeps the incumbent, the candidate is evicted
    assert freq(k(10)) == freq(k(1)) == 1
    out = ledger.prepare_store(ks(11))
    assert out is not None and out.evicted_keys == ks(10)
    ledger.complete_store(out.keys_to_store)
    # 11 is read twice more: read thrice, it wins its duel with 1 and joins probation
    assert one_key_requests(ledger, [11, 11]) == [11, 11]
    out = ledger.prepare_store(ks(12))
    assert out is not None and out.evicted_keys == ks(1)
    ledger.complete_store(out.keys_to_store)
    assert list(policy.probation)[-1] == k(11) and list(policy.window) == ks(12)


def test_tinylfu_protected_overflow_goes_back_to_probation() -> None:
    ledger = PrimaryLedger(10, policy="tinylfu")
    policy = ledger.policy
    assert isinstance(policy, TinyLFUPolicy)
    one_key_requests(ledger, list(range(1, 11)))
    one_key_requests(ledger, list(range(1, 9)))  # 8 promotions into 7 protected places
    assert list(policy.protected) == ks(*range(2, 9))
    assert list(policy.probation) == ks(9, 1)  # 1, least recent in protected, demoted


# --- adaptive --------------------------------------------------------------------------


def _hit_rate(policy: str, trace: list[list[int]], capacity: int) -> tuple[float, PrimaryLedger]:
    ledger = PrimaryLedger(capacity, policy=policy)
    hits = total = 0
    for n, ids in enumerate(trace):
        hits += request(ledger, ids, f"r{n}")
        total += len(ids)
    return hits / total, ledger


def _hot_set_and_scans(seed: int) -> list[list[int]]:
    """A hot set read over and over, and one-time scans between: LRU's worst case."""
    rng = random.Random(seed)
    trace: list[list[int]] = []
    fresh = 10_000
    for _ in range(3000):
        if rng.random() < 0.5:
            trace.append([rng.randrange(150)])
        else:
            trace.append(list(range(fresh, fresh + 4)))
            fresh += 4
    return trace


def test_adaptive_where_scans_flush_lru() -> None:
    trace = _hot_set_and_scans(3)
    lru, _ = _hit_rate("lru", trace, 200)
    adaptive, ledger = _hit_rate("adaptive", trace, 200)
    policy = ledger.policy
    assert isinstance(policy, AdaptivePolicy)
    assert policy.live != "lru"
    assert adaptive > 1.2 * lru  # the scans no longer flush the hot set
    scores = policy.scores()
    assert scores[policy.live] >= scores["lru"]


def test_adaptive_leaves_reuse_where_recency_is_all() -> None:
    # A working set that slides, one key a request: what was read last is read next. Every
    # key is its request's last, only stored: ``reuse`` sends each to its cold list first.
    rng = random.Random(5)
    trace = [[i + rng.randrange(40)] for i in range(0, 4000)]
    lru, _ = _hit_rate("lru", trace, 64)
    reuse, _ = _hit_rate("reuse", trace, 64)
    adaptive, ledger = _hit_rate("adaptive", trace, 64)
    policy = ledger.policy
    assert isinstance(policy, AdaptivePolicy)
    assert policy.switches and policy.switches[0][1] in ("lru", "arc")
    assert reuse < 0.5 * lru and adaptive > 0.9 * lru


def test_a_switch_needs_a_lead_that_is_large_and_no_accident() -> None:
    live = deque([500, 520, 480, 510, 490])
    # 10% ahead in every epoch, give or take a little: a lead worth a switch
    steady = deque([552, 570, 530, 563, 538])
    assert _significant_lead(steady, live) == pytest.approx(50.6)
    # 4.4% ahead on average, but the epochs disagree: noise, not a better policy
    noisy = deque([560, 480, 550, 480, 540])
    assert sum(noisy) > 1.03 * sum(live)
    assert _significant_lead(noisy, live) == 0.0
    # steady, but within the margin: not worth the hits a switch costs
    close = deque([h + 10 for h in live])
    assert _significant_lead(close, live) == 0.0
    # too few epochs to judge, however far ahead
    assert _significant_lead(deque([900] * (LEAD_EPOCHS - 1)), deque([500] * 4)) == 0.0
    # the same lead in every epoch (no spread at all) is significant
    assert _significant_lead(deque([600] * 5), deque([500] * 5)) == 100.0
