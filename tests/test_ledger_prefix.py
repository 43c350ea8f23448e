"""Scenario tests of the prefix-aware policy (``eviction_policy: "prefix"``), driven the way
vLLM 0.33's scheduler drives the ledger: look up, load the hits, store the rest, finish."""

from __future__ import annotations

import copy
import math
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvtier_async.api import CacheConfig, TieredKVCache
from kvtier_async.config import ConfigError
from kvtier_async.integrations.vllm.config import ConnectorConfig
from kvtier_async.ledger import LookupResult, PrimaryLedger, make_policy
from kvtier_async.ledger.policies import SlotTable
from kvtier_async.ledger.prefix_policy import PrefixPolicy
from ledger_requests import k, ks, policy_ledger, request, snapshot


def prefix_ledger(capacity: int) -> tuple[PrimaryLedger, PrefixPolicy]:
    return policy_ledger("prefix", capacity, PrefixPolicy)


# --- by name, in both faces' configs -----------------------------------------------------


def test_prefix_by_name_in_the_ledger_and_both_configs() -> None:
    assert isinstance(make_policy("prefix", 4, SlotTable(4)), PrefixPolicy)
    api = CacheConfig.from_dict({"block_bytes": 64, "num_slots": 4, "eviction_policy": "prefix"})
    assert api.eviction_policy == "prefix"
    extra = {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "prefix"}
    assert ConnectorConfig.from_extra_config(extra).eviction_policy == "prefix"
    # a module path given beside a built-in name does not override it (as for lru and arc)
    extra["cache_policy_module_path"] = "somewhere.else"
    assert ConnectorConfig.from_extra_config(extra).eviction_policy == "prefix"


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ({"eviction_policy": "fifo"}, "eviction_policy", "must be one of"),
        ({"eviction_policy": "kvtier_nosuchmod:X"}, "eviction_policy", "cannot be imported"),
        (
            {"eviction_policy": "x", "cache_policy_module_path": "kvtier_nosuchmod:X"},
            "cache_policy_module_path",
            "cannot be imported",
        ),
    ],
)
def test_a_policy_that_cannot_be_had_is_refused_at_validation(
    extra: dict[str, str], field: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        ConnectorConfig.from_extra_config({"cpu_bytes_to_use": 1 << 20, **extra})
    assert info.value.field.endswith(field)


# --- private chains, shared forks ---------------------------------------------------------


def test_a_session_that_extends_its_prompt_stays_private() -> None:
    ledger, policy = prefix_ledger(16)
    # three turns, each the previous prompt and more: every key is reused, none is shared
    assert request(ledger, [1, 2, 3], "t1") == 0
    assert request(ledger, [1, 2, 3, 4, 5], "t2") == 3
    assert request(ledger, [1, 2, 3, 4, 5, 6, 7], "t3") == 5
    assert policy.shared_keys == []
    assert policy.private_keys == ks(7, 6, 5, 4, 3, 2, 1)  # least recent first: tail first


def test_a_fork_shares_the_key_where_it_happens_and_its_ancestors() -> None:
    ledger, policy = prefix_ledger(16)
    request(ledger, [1, 2, 3, 4], "a")
    # b takes the same head, then another way after 3
    assert request(ledger, [1, 2, 3, 9], "b") == 3
    assert policy.shared_keys == ks(3, 2, 1)  # the leaf of the shared head goes first
    assert policy.private_keys == ks(4, 9)
    assert policy._score[k(1)] == 1.0  # log2(2): a stored it, b reused it
    # c walks past 4 (first seen there: no fork yet); d forks after 4: 4 joins the head
    request(ledger, [1, 2, 3, 4, 7], "c")
    assert k(4) in policy.private_keys
    request(ledger, [1, 2, 3, 4, 8], "d")
    assert set(policy.shared_keys) == set(ks(1, 2, 3, 4))
    assert policy._score[k(1)] == pytest.approx(2.0)  # stored by a, reused by b, c and d
    assert policy._score[k(4)] == 1.0  # stored by a, reused by d since it is shared


def test_the_system_prompt_above_private_sessions_is_shared() -> None:
    ledger, policy = prefix_ledger(32)
    system = [1, 2]
    request(ledger, [*system, 10, 11], "s1-t1")
    request(ledger, [*system, 20, 21], "s2-t1")  # a second session forks after the prompt
    request(ledger, [*system, 10, 11, 12], "s1-t2")  # turns extend their session
    request(ledger, [*system, 20, 21, 22], "s2-t2")
    assert set(policy.shared_keys) == set(ks(*system))
    assert set(policy.private_keys) == set(ks(10, 11, 12, 20, 21, 22))


def test_a_shared_head_outlives_a_flood_of_one_off_requests() -> None:
    for name, survives in (("prefix", True), ("lru", False)):
        ledger = PrimaryLedger(6, policy=name)
        request(ledger, [1, 2, 3, 4], "a")
        request(ledger, [1, 2, 3, 5], "b")
        for i in range(4):  # four one-off requests, two new blocks each
            request(ledger, [100 + 2 * i, 101 + 2 * i], f"one-off-{i}")
        held = [ledger.lookup(key) is LookupResult.HIT for key in ks(1, 2, 3)]
        assert held == [survives] * 3, name


def test_shared_keys_go_leaf_first() -> None:
    ledger, policy = prefix_ledger(5)
    request(ledger, [1, 2, 3, 4], "a")
    request(ledger, [1, 2, 3, 9], "b")  # full
    assert policy.shared_keys == ks(3, 2, 1) and policy.private_keys == ks(4, 9)
    ledger.prepare_load(ks(4, 9))  # pin P: the victims must come from S
    out = ledger.prepare_store(ks(20, 21))
    assert out is not None and out.evicted_keys == ks(3, 2)  # the shared head's tail first


def test_an_ancestor_never_ranks_below_its_descendants() -> None:
    ledger, policy = prefix_ledger(6)
    request(ledger, [1, 2, 3, 4], "a")
    request(ledger, [1, 2, 3, 5], "b")  # S: 1, 2, 3 (count 2); P: 4, 5
    ledger.touch(ks(2, 3))
    ledger.touch(ks(2, 3))  # 2 and 3: count 4
    # with everything else pinned (for a copy: no reuse), two new keys evict the head alone
    ledger.prepare_load(ks(2, 3, 4, 5), record=False)
    out = ledger.prepare_store(ks(6, 7))
    assert out is not None and out.evicted_keys == ks(1)
    ledger.complete_store(out.keys_to_store)
    ledger.complete_load(ks(2, 3, 4, 5))
    # the head is stored again (count 2 + 1 from its ghost) under 2 and 3 (count 5): it
    # takes their score, and their tail goes first again
    request(ledger, [1, 2, 3], "c")
    assert policy._score[k(1)] == policy._score[k(2)] == pytest.approx(math.log2(5))
    assert policy.shared_keys == ks(3, 2, 1)


def test_the_lowest_count_goes_first_and_its_ghost_keeps_the_count() -> None:
    ledger, policy = prefix_ledger(8)
    # head A (1, 2): forked, then reused by three more requests; head B (5, 6): forked once
    request(ledger, [1, 2, 3], "a1")
    request(ledger, [1, 2, 4], "a2")
    for i in range(3):
        request(ledger, [1, 2], f"a-more-{i}")
    request(ledger, [5, 6, 7], "b1")
    request(ledger, [5, 6, 8], "b2")
    assert policy.shared_keys == ks(6, 5, 2, 1)  # B (count 2) before A (count 5), leaf first
    # pin P's keys; two new keys evict B's head from S, leaf first, into S's ghost
    ledger.prepare_load(ks(3, 4, 7, 8))
    out = ledger.prepare_store(ks(30, 31))
    assert out is not None and out.evicted_keys == ks(6, 5)
    ledger.complete_store(out.keys_to_store)
    assert policy._ghost_shared == {k(6): 1.0, k(5): 1.0}
    # B's head stored again: its count comes back, plus this store, and P's target shrinks
    policy.target_private = 3.0
    ledger.complete_load(ks(3, 4, 7, 8))
    request(ledger, [5, 6, 9], "b3")  # evicts 3 keys of P first: 3 ghosts in P's list
    assert policy._score[k(5)] == policy._score[k(6)] == pytest.approx(math.log2(3))
    assert policy.target_private == 0.0  # 3 - max(1, 3 / 2) - max(1, 3 / 1), floored


def test_a_private_ghost_grows_the_private_target() -> None:
    ledger, policy = prefix_ledger(2)
    request(ledger, [1, 2], "a")
    request(ledger, [3, 4], "b")  # evicts 2, then 1: P's ghosts
    assert list(policy._ghost_private) == ks(2, 1)
    request(ledger, [1], "c")  # 1 is back
    assert policy.target_private == 1.0
    assert k(1) in policy.private_keys and k(1) not in policy._ghost_private


def test_a_private_ghost_remembers_the_key_after_it() -> None:
    ledger, policy = prefix_ledger(4)
    request(ledger, [1, 2, 3], "a")
    request(ledger, [7, 8, 9], "other")  # evicts 3 and 2 (tail first)
    assert policy._ghost_private == {k(3): None, k(2): k(3)}
    # 2 stored again by a request that goes another way after it: a fork, seen thanks to
    # the ghost (a fresh key would just note 5 as the key after it)
    request(ledger, [1, 2, 5], "b")
    assert set(policy.shared_keys) == set(ks(1, 2))


# --- counts: cap and aging -----------------------------------------------------------------


def test_a_count_stops_at_its_cap() -> None:
    ledger, policy = prefix_ledger(64)
    request(ledger, [1, 2], "a")
    request(ledger, [1, 3], "b")  # 1 is shared
    for i in range(100):
        request(ledger, [1], f"again-{i}")
    assert policy._epoch == 0
    assert policy.max_octaves <= policy._score[k(1)] < policy.max_octaves + 0.1


def test_counts_halve_each_epoch() -> None:
    ledger, policy = prefix_ledger(4)  # an epoch: 16 insertions
    request(ledger, [1, 2], "a")
    request(ledger, [1, 3], "b")
    for i in range(6):  # key 1: counted 8 times in epoch 0
        request(ledger, [1], f"a-more-{i}")
    assert policy._score[k(1)] == pytest.approx(3.0)
    for i in range(45):  # 48 insertions in all: epoch 3
        request(ledger, [100 + i], f"one-off-{i}")
    assert policy._epoch == 3
    # key 200: counted twice in epoch 3, which outweighs 8 counts three halvings ago
    request(ledger, [200, 201], "c")
    request(ledger, [200, 202], "d")
    assert policy._score[k(200)] == 4.0
    assert policy.shared_keys == ks(1, 200)


# --- all or nothing, reset, touch ------------------------------------------------------------


def test_a_refused_eviction_changes_nothing() -> None:
    ledger, policy = prefix_ledger(6)
    request(ledger, [1, 2, 3, 4], "a")
    request(ledger, [1, 2, 3, 5], "b")
    ledger.prepare_load(ks(4))  # pinned
    before = snapshot(policy)
    # 4 is pinned and 1, 2 are protected: only 3 and 5 can go
    assert policy.evict(3, set(ks(1, 2))) is None
    assert snapshot(policy) == before
    assert ledger.prepare_store(ks(1, 2, 6, 7, 8, 9)) is None  # needs 3: only 3 and 5
    assert ledger.statistics().used == 5


def test_reset_forgets_everything() -> None:
    ledger, policy = prefix_ledger(2)
    request(ledger, [1, 2], "a")
    request(ledger, [1, 3], "b")
    request(ledger, [7, 8], "c")
    ledger.reset()
    fresh = PrefixPolicy(2, SlotTable(2))
    assert snapshot(policy) == snapshot(fresh)


def test_touch_counts_a_shared_key_and_refreshes_a_private_one() -> None:
    ledger, policy = prefix_ledger(8)
    request(ledger, [1, 2, 3], "a")
    request(ledger, [1, 2, 4], "b")
    ledger.touch(ks(3))
    assert policy.private_keys == ks(4, 3)
    ledger.touch(ks(1))
    assert policy._score[k(1)] == math.log2(3)


# --- the async face ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_tiered_kv_cache_with_the_prefix_policy() -> None:
    """Through `TieredKVCache`'s calls (stores that walk a prompt from its head): two prompts
    fork after a shared document, and the document outlives one-off prompts."""
    block = 256
    config: dict[str, Any] = {"block_bytes": block, "num_slots": 6, "eviction_policy": "prefix"}

    def blocks(*ids: int) -> list[np.ndarray]:
        return [np.full(block, i % 251, dtype=np.uint8) for i in ids]

    async with TieredKVCache(config) as cache:
        policy = cache.ledger.primary.policy
        assert isinstance(policy, PrefixPolicy)
        doc = [1, 2, 3]
        await cache.store(ks(*doc, 10), blocks(*doc, 10), req="q1")
        cache.ledger.request_finished("q1")
        await cache.store(ks(*doc, 11), blocks(*doc, 11), req="q2")
        cache.ledger.request_finished("q2")
        assert set(policy.shared_keys) == set(ks(*doc))
        for i in range(3):  # one-off prompts of two blocks push out the private keys only
            await cache.store(ks(50 + 2 * i, 51 + 2 * i), blocks(50 + 2 * i, 51 + 2 * i))
        assert await cache.lookup(ks(*doc, 12)) == 3
        out = blocks(0, 0, 0)
        assert await cache.load(ks(*doc), out) == 3
        assert [int(b[0]) for b in out] == doc


@settings(max_examples=200, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=6), max_size=30),
    n=st.integers(1, 6),
    protected=st.sets(st.integers(0, 11), max_size=4),
)
def test_the_fast_eviction_is_arcs_choice(
    prompts: list[list[int]], n: int, protected: set[int]
) -> None:
    """After any run of requests, `PrefixPolicy.evict`'s fast path picks and leaves what
    `arc_choose` between P and S would (`_evict_by_choice`), the ghosts after."""
    ledger = PrimaryLedger(6, policy="prefix")
    policy = ledger.policy
    assert isinstance(policy, PrefixPolicy)
    guard = set(ks(*protected))
    for index, prompt in enumerate(prompts):
        request(ledger, list(dict.fromkeys(prompt)), index)
        ours, twin = copy.deepcopy(policy), copy.deepcopy(policy)  # the ledger's untouched
        assert ours.evict(n, guard) == twin._evict_by_choice(n, guard)
        assert snapshot(ours) == snapshot(twin)
