"""The prefix and reuse policies behind KVTierConnector inside vLLM 0.33's real Scheduler:
vLLM's calls alone (no touch) carry the prefix structure they need, and the run is as correct
as with LRU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import vllm_harness as vh
from kvtier_async.ledger.prefix_policy import PrefixPolicy
from kvtier_async.ledger.reuse_policy import ReusePolicy
from vllm_harness import OURS, shared_prefix_requests

pytestmark = pytest.mark.vllm

# 40 requests over 4 shared documents on 48 GPU blocks: the GPU prefix cache evicts, the
# scheduler preempts; the CPU tier (64 offloaded blocks) fills up and evicts too.
TRACE = shared_prefix_requests(seed=7, num_requests=40)
SMALL_GPU: dict[str, Any] = {"num_gpu_blocks": 48, "max_num_batched_tokens": 256}


def with_policy(name: str) -> dict[str, Any]:
    return {**OURS, "extra_config": {**OURS["extra_config"], "eviction_policy": name}}


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    pytest.importorskip("vllm")
    vh.load()


@pytest.fixture(scope="module")
def baseline() -> dict[Any, Any]:
    """The trace's outputs with no connector (one run for both policies)."""
    with vh.VllmHarness(**SMALL_GPU) as h:
        h.drive(TRACE, per_step=2)
        return dict(h.stats.outputs)


def check_prefix(policy: Any) -> None:
    assert isinstance(policy, PrefixPolicy)
    assert policy._ghost_private or policy._ghost_shared  # it evicted
    assert policy.shared_keys  # the documents' heads were seen forking into requests


def check_reuse(policy: Any) -> None:
    assert isinstance(policy, ReusePolicy)
    assert policy._ghost  # it evicted
    # the documents' heads were seen forking into requests: shared, and credited
    assert policy._shared
    assert any(policy.count(key) > 1 for key in policy._shared)
    assert sorted(policy.eviction_order()) == sorted(policy.table.slot_of)


@pytest.mark.parametrize(("name", "check"), [("prefix", check_prefix), ("reuse", check_reuse)])
def test_the_policy_behind_the_connector(
    name: str, check: Callable[[Any], None], baseline: dict[Any, Any]
) -> None:
    with vh.VllmHarness(**SMALL_GPU, **with_policy(name)) as h:
        h.drive(TRACE, per_step=2)
        assert h.stats.outputs == baseline
        assert h.stats.preemptions > 0
        assert h.stats.external_hit_tokens > 0
        h.assert_no_leaks()
        primary = h.connector.scheduler.ledger.primary
        stats = primary.statistics()
        assert stats.pinned == 0 and stats.writing == 0
        assert stats.used == stats.capacity
        check(primary.policy)
        assert primary.num_requests == 0  # every request's state was dropped at its finish
