"""Scenario tests of the ``reuse`` policy (``prefix`` started balanced, faster towards
frequency, a request's last stored key first to go), driven as vLLM 0.33's scheduler drives
the ledger: look up, load the hits, store the rest, finish."""

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
from kvtier_async.ledger.prefix_policy import PrefixPolicy
from kvtier_async.ledger.reuse_policy import ReusePolicy
from ledger_requests import k, ks, policy_ledger, request, snapshot


def reuse_ledger(capacity: int) -> tuple[PrimaryLedger, ReusePolicy]:
    return policy_ledger("reuse", capacity, ReusePolicy)


def test_reuse_by_name_in_the_ledger_and_both_configs() -> None:
    assert isinstance(make_policy("reuse", 4, SlotTable(4)), ReusePolicy)
    api = CacheConfig.from_dict({"block_bytes": 64, "num_slots": 4, "eviction_policy": "reuse"})
    assert api.eviction_policy == "reuse"
    extra = {"cpu_bytes_to_use": 1 << 20, "eviction_policy": "reuse"}
    assert ConnectorConfig.from_extra_config(extra).eviction_policy == "reuse"


def test_target_starts_at_half_the_capacity_and_after_clear() -> None:
    ledger, policy = reuse_ledger(8)
    assert policy.target_private == 4.0
    policy.target_private = 1.0
    ledger.reset()
    assert policy.target_private == 4.0
    assert PrimaryLedger(8, policy="prefix").policy.target_private == 0.0  # type: ignore[attr-defined]


def test_a_requests_last_stored_key_goes_first() -> None:
    ledger, policy = reuse_ledger(8)
    policy.target_private = 0.0  # P gives the victims
    # a prompt of four blocks: its last one is the coldest private key, its head the warmest
    request(ledger, [1, 2, 3, 4], "r1")
    assert policy.private_keys == ks(4, 3, 2, 1)
    # the next turn reads 1-3 and stores 5, 6: 4 (never read again) and then 6 are coldest
    assert request(ledger, [1, 2, 3, 5, 6], "r2") == 3
    assert policy.private_keys[:2] == ks(6, 4)
    # a store that needs one slot takes 6 (this request's 7, 8 are protected)
    request(ledger, [9, 7, 8], "r3")
    assert k(6) not in ledger and k(4) in ledger


def test_a_reused_last_key_is_not_sent_cold() -> None:
    ledger, policy = reuse_ledger(8)
    request(ledger, [1, 2], "r1")
    # r2 reads all of r1's prompt and stores nothing: its last key is a reuse, kept warm
    assert request(ledger, [1, 2], "r2") == 2
    assert policy.private_keys == ks(2, 1)
    request(ledger, [3], "r3")
    assert policy.private_keys[0] == k(3)


@pytest.mark.parametrize(("name", "step"), [("prefix", 3.0), ("reuse", 6.0)])
def test_a_shared_ghost_moves_the_target_twice_as_far_as_prefix(name: str, step: float) -> None:
    ledger = PrimaryLedger(40, policy=name)
    policy = ledger.policy
    assert isinstance(policy, PrefixPolicy)
    policy.target_private = 20.0
    # ghosts: one shared (key 1), three private: ARC's step is max(1, 3 / 1)
    policy._ghost_shared[k(1)] = 1.0
    for i in range(2, 5):
        policy._ghost_private[k(i)] = None
    request(ledger, [1], "r")  # key 1 stored again while its shared ghost is remembered
    assert policy.target_private == 20.0 - step


def test_the_target_stays_below_the_floor_of_s() -> None:
    ledger, policy = reuse_ledger(10)
    for i in range(20):  # P ghosts stored again push the target up, not past 90%
        policy._ghost_private[k(100 + i)] = None
    for i in range(20):
        request(ledger, [100 + i], f"r{i}")
    assert policy.target_private == 9.0


@pytest.mark.anyio
async def test_tiered_kv_cache_with_the_reuse_policy() -> None:
    """Through `TieredKVCache`'s calls: stores, a fork, evictions, and the blocks read back."""
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
        await cache.store(ks(*doc, 11), blocks(*doc, 11), req="q2")
        cache.ledger.request_finished("q2")
        assert set(policy.shared_keys) == set(ks(*doc))  # the two prompts fork after 3
        assert policy.private_keys == ks(11, 10)  # q2's last key, only stored, goes first
        for i in range(3):
            await cache.store(ks(50 + 2 * i, 51 + 2 * i), blocks(50 + 2 * i, 51 + 2 * i))
        held = [i for i in (*doc, 10, 11, 50, 51, 52, 53, 54, 55) if k(i) in cache.ledger.primary]
        assert len(held) == 6 and {54, 55} <= set(held)
        out = blocks(*([0] * len(held)))
        for i, buffer in zip(held, out):
            assert await cache.load(ks(i), [buffer]) == 1
            assert int(buffer[0]) == i


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(["prefix", "reuse"]),
    prompts=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=6), max_size=30),
    n=st.integers(1, 6),
    protected=st.sets(st.integers(0, 11), max_size=4),
)
def test_the_fast_eviction_is_arcs_choice(
    name: str, prompts: list[list[int]], n: int, protected: set[int]
) -> None:
    """After any run of requests, `PrefixPolicy.evict`'s fast path picks and leaves what
    `arc_choose` between P and S would (`_evict_by_choice`), the ghosts after, in both
    presets."""
    ledger = PrimaryLedger(6, policy=name)
    policy = ledger.policy
    assert isinstance(policy, PrefixPolicy)
    guard = set(ks(*protected))
    for index, prompt in enumerate(prompts):
        request(ledger, list(dict.fromkeys(prompt)), index)
        ours, twin = copy.deepcopy(policy), copy.deepcopy(policy)  # the ledger's untouched
        assert ours.evict(n, guard) == twin._evict_by_choice(n, guard)
        assert snapshot(ours) == snapshot(twin)
