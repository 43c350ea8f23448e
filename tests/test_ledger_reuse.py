"""Scenario tests of the ``reuse`` policy (recency with credit for each request that came
back to a key, a cold list for a prompt's one-time last block), driven as vLLM 0.33's
scheduler drives the ledger: look up, load the hits, store the rest, finish."""

from __future__ import annotations

import copy
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvtier_async.api import CacheConfig, TieredKVCache
from kvtier_async.integrations.vllm.config import ConnectorConfig
from kvtier_async.ledger import PrimaryLedger, make_policy
from kvtier_async.ledger.policies import SlotTable
from kvtier_async.ledger.reuse_policy import ReusePolicy
from ledger_requests import k, ks, live, request


def reuse_ledger(capacity: int) -> tuple[PrimaryLedger, ReusePolicy]:
    ledger = PrimaryLedger(capacity, policy="reuse")
    assert type(ledger.policy) is ReusePolicy
    return ledger, ledger.policy


def test_reuse_by_name_in_the_ledger_and_both_configs() -> None:
    assert isinstance(make_policy("reuse", 4, SlotTable(4)), ReusePolicy)
    api = CacheConfig.from_dict({"block_bytes": 64, "num_slots": 4, "eviction_policy": "reuse"})
    assert api.eviction_policy == "reuse"
    extra = {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "reuse"}
    assert ConnectorConfig.from_extra_config(extra).eviction_policy == "reuse"


def test_a_request_is_evicted_tail_first_and_its_last_stored_key_before_all() -> None:
    ledger, policy = reuse_ledger(8)
    request(ledger, [1, 2, 3, 4], "r1")
    # 4, the prompt's last block, only stored: cold; then the tail before the head
    assert policy.eviction_order() == ks(4, 3, 2, 1)
    assert policy.count(k(4)) == 1 and policy.count(k(9)) == 0


def test_a_reused_last_key_is_not_sent_cold() -> None:
    ledger, policy = reuse_ledger(8)
    request(ledger, [1, 2], "r1")
    assert request(ledger, [1, 2], "r2") == 2  # r2 stores nothing: its last key is a reuse
    assert policy.count(k(2)) == 2
    request(ledger, [3], "r3")
    assert policy.eviction_order()[0] == k(3)  # r3's only key, cold; 1 and 2 are not


def test_a_last_key_another_request_stored_again_and_sent_cold_stays_cold() -> None:
    # found by the state machine: r1 stores 1 and 2, 2's write fails, an anonymous call
    # stores 2 again (its last key: cold), then r1 ends with 2 as its own last stored key
    ledger, policy = reuse_ledger(4)
    ledger.prepare_store(ks(1, 2), "r1")
    assert ledger.complete_store(ks(2), success=False) == ks(2)
    assert ledger.prepare_store(ks(2)) is not None
    assert policy.eviction_order() == ks(2, 1)  # cold, then r1's head
    ledger.request_finished("r1")
    assert policy.eviction_order() == ks(2, 1)
    assert ledger.policy.count(k(2)) == 1


def test_a_key_read_again_outlives_newer_keys_read_once_but_not_forever() -> None:
    ledger, policy = reuse_ledger(6)  # a count of 2 is worth 2 * 6 = 12 placements
    request(ledger, [1, 2, 9], "r1")
    assert request(ledger, [1, 2, 8], "r2") == 2  # 1 and 2 counted twice
    # single-block prompts (each cold) and two-block ones: the once-read keys go first
    request(ledger, [20, 21], "a")
    request(ledger, [22, 23], "b")
    assert k(1) in ledger and k(2) in ledger
    assert k(9) not in ledger and k(8) not in ledger  # cold: went first
    order = policy.eviction_order()
    assert order.index(k(2)) > order.index(k(23)) and order.index(k(1)) > order.index(k(22))
    # keep storing: the credit is bounded, so 1 and 2 go in the end
    for i in range(10):
        request(ledger, [30 + 2 * i, 31 + 2 * i], f"c{i}")
    assert k(1) not in ledger and k(2) not in ledger


def test_an_evicted_key_stored_again_keeps_its_count() -> None:
    ledger, policy = reuse_ledger(4)
    request(ledger, [1, 5], "r1")
    request(ledger, [1, 5], "r2")  # 1 and 5 read twice
    request(ledger, [10, 11, 12, 13], "r3")  # evicts both: their counts go to the ghosts
    assert k(1) not in ledger and policy.ghost_count(k(1)) == 2
    request(ledger, [1, 4], "r4")
    assert policy.count(k(1)) == 3 and policy.ghost_count(k(1)) == 0  # its history, this store
    for i in range(8):
        request(ledger, [20 + 2 * i, 21 + 2 * i], f"s{i}")
        assert 0 < policy.num_ghosts() <= 8  # here at most ``2 * capacity`` ghosts
    assert policy.num_ghosts() >= 4  # and at least ``capacity`` once that many went


def test_a_request_does_not_evict_the_chain_it_just_loaded() -> None:
    ledger, policy = reuse_ledger(6)
    request(ledger, [1, 2, 3], "r1")
    request(ledger, [4, 5, 6], "r2")  # 1-3 are now the oldest keys without credit
    ledger.prepare_load(ks(1, 2), "r3")  # r3 reads 1, 2 (3 was cold: evicted first)
    ledger.complete_load(ks(1, 2))
    assert policy.eviction_order()[-2:] == ks(2, 1)  # reached: refreshed, head most recent
    out = ledger.prepare_store(ks(7, 8, 9), "r3")
    assert out is not None and set(out.evicted_keys) == set(ks(3, 5, 6))
    ledger.complete_store(out.keys_to_store)
    ledger.request_finished("r3")
    assert k(1) in ledger and k(2) in ledger and policy.count(k(1)) == 2


def test_a_credited_key_not_yet_due_keeps_its_due_when_reached() -> None:
    ledger, policy = reuse_ledger(8)
    request(ledger, [1, 2, 3], "r1")
    request(ledger, [1, 2, 9], "r2")  # 1 and 2 read twice: credited
    due = dict(policy._due)
    ledger.prepare_load(ks(1, 2), "r3")  # not due for a long time: left where they are
    assert policy._due == due and live(policy) == sorted((d, key) for key, d in due.items())
    ledger.complete_load(ks(1, 2))
    ledger.request_finished("r3")  # counted and placed when the request ends
    assert policy.count(k(1)) == 3 and policy._due[k(1)] > due[k(1)]
    # once its credit is spent, a reached key is due again from now
    while policy._clock <= policy._due[k(2)]:
        ledger.touch([k(9)])
    spent = policy._due[k(2)]
    ledger.prepare_load([k(2)], "r4")
    assert policy._due[k(2)] == policy._clock + policy._chain_credit[3] > spent
    assert policy.eviction_order().index(k(2)) > policy.eviction_order().index(k(1))


def test_touch_counts_and_refreshes_a_held_key() -> None:
    ledger, policy = reuse_ledger(8)
    request(ledger, [1, 2, 3], "r1")
    ledger.touch(ks(1, 7, 1))  # 7 is not held: ignored; 1 counts once
    assert policy.count(k(1)) == 2 and policy.count(k(2)) == 1
    assert policy.eviction_order()[-1] == k(1)
    ledger.reset()
    assert policy.eviction_order() == [] and policy.count(k(1)) == 0


def test_the_credit_grows_with_the_count_more_for_a_shared_key() -> None:
    policy = ReusePolicy(10, SlotTable(10))
    chain, shared = policy._chain_credit, policy._shared_credit
    assert chain[1] == shared[1] == 0  # read once: recency alone
    assert chain[2] == 20 and chain[5] == 40 and len(chain) == policy.max_chain_count + 1
    assert shared[2] == 40 and shared[5] == 160 and len(shared) == policy.max_count + 1


def test_a_fork_shares_the_key_and_its_head_and_a_next_turn_is_no_fork() -> None:
    ledger, policy = reuse_ledger(16)
    request(ledger, [1, 2, 3, 4], "turn1")  # 4: the partial last block, cold
    # the next turn reads 1-3 and goes on with 5, 6 where turn 1 had 4: a chain, not a fork
    assert request(ledger, [1, 2, 3, 5, 6], "turn2") == 3
    assert policy._shared == set()
    assert policy.count(k(3)) == 2 and policy.eviction_order()[:2] == ks(4, 6)  # cold
    # another request reads 1-2 and goes on with 7 where the chain had 3: 1 and 2 shared
    assert request(ledger, [1, 2, 7, 8], "other") == 2
    assert policy._shared == set(ks(1, 2))
    assert policy._due[k(1)] - policy._due[k(3)] > 2 * 16  # twice the credit per count


@pytest.mark.anyio
async def test_tiered_kv_cache_with_the_reuse_policy() -> None:
    """Through `TieredKVCache`'s calls: stores, reads, evictions, and the bytes read back."""
    block = 256
    config: dict[str, Any] = {"block_bytes": block, "num_slots": 6, "eviction_policy": "reuse"}

    def blocks(*ids: int) -> list[np.ndarray]:
        return [np.full(block, i % 251, dtype=np.uint8) for i in ids]

    async with TieredKVCache(config) as cache:
        policy = cache.ledger.primary.policy
        assert isinstance(policy, ReusePolicy)
        doc = [1, 2, 3]
        await cache.store(ks(*doc, 10), blocks(*doc, 10), req="q1")
        cache.ledger.request_finished("q1")
        out = blocks(0, 0, 0)
        assert await cache.load(ks(*doc), out, req="q2") == 3
        assert [int(b[0]) for b in out] == doc
        cache.ledger.request_finished("q2")
        assert all(policy.count(key) == 2 for key in ks(*doc))
        for i in range(3):
            await cache.store(ks(50 + 2 * i, 51 + 2 * i), blocks(50 + 2 * i, 51 + 2 * i))
        held = [i for i in (*doc, 10, 50, 51, 52, 53, 54, 55) if k(i) in cache.ledger.primary]
        assert len(held) == 6 and set(doc) <= set(held)  # the document read twice stays
        got = blocks(*([0] * len(held)))
        for i, buffer in zip(held, got):
            assert await cache.load(ks(i), [buffer]) == 1
            assert int(buffer[0]) == i


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=6), max_size=30),
    n=st.integers(1, 6),
    protected=st.sets(st.integers(0, 11), max_size=4),
    pinned=st.sets(st.integers(0, 11), max_size=3),
)
def test_evict_takes_the_first_evictable_keys_of_the_eviction_order(
    prompts: list[list[int]], n: int, protected: set[int], pinned: set[int]
) -> None:
    """After any run of requests, with some keys pinned, `evict` (the heap: stale entries,
    skipped keys pushed back) picks what a plain walk of the sorted order picks, or refuses
    and changes nothing."""
    ledger, policy = reuse_ledger(6)
    for index, prompt in enumerate(prompts):
        request(ledger, list(dict.fromkeys(prompt)), index)
    pins = [key for key in ks(*pinned) if key in ledger]
    if pins:
        ledger.prepare_load(pins, "pin")
    guard = set(ks(*protected))
    slot_of, ref = policy.table.slot_of, policy.table.ref
    expected = [key for key in policy.eviction_order() if ref[slot_of[key]] == 0]
    expected = [key for key in expected if key not in guard][:n]
    before = copy.deepcopy(policy)
    victims = policy.evict(n, guard)
    if len(expected) < n:
        assert victims is None
        assert (policy._count, policy._due, live(policy), policy._recent, policy._cold) == (
            before._count,
            before._due,
            live(before),
            before._recent,
            before._cold,
        )
    else:
        assert victims == expected
        gone = set(policy._count) | set(policy._due) | set(policy._recent) | set(policy._cold)
        assert not set(victims) & gone
        assert all(policy.ghost_count(key) == before._count[key] for key in victims)
