"""Closing a `TieredKVCache` is bounded: a clean exit drains for at most ``close_timeout_s``,
then cancels what is left and says so; nothing stays pinned. (Over a hung S3 endpoint:
`test_tier_s3`.)"""

from __future__ import annotations

import logging
import os

import anyio
import numpy as np
import pytest

from kvtier_async.api import CacheConfig, TieredKVCache
from kvtier_async.config import ConfigError
from kvtier_async.ledger import make_offload_key
from kvtier_async.tiers.memory import MemoryTier

pytestmark = pytest.mark.anyio
BLOCK = 4096
SLACK_S = 2.0  # over a bound computed from the config: scheduling on a loaded machine


def config(close_timeout_s: float) -> dict[str, object]:
    memory = {"type": "memory", "n_read_workers": 1, "n_write_workers": 1}
    return {"block_bytes": BLOCK, "num_slots": 8, "secondary_tiers": [memory],
            "close_timeout_s": close_timeout_s}  # fmt: skip


async def test_a_clean_exit_waits_at_most_close_timeout_s_then_cancels(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier_async.api")
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(2)]
    cache = TieredKVCache(config(close_timeout_s=0.2))
    async with cache:
        tier = cache.tiers[0]
        assert isinstance(tier, MemoryTier)
        tier.gate = anyio.Event()  # a tier that never answers: the cascade waits for ever
        await cache.store(keys, [np.zeros(BLOCK, np.uint8)] * 2)
        with anyio.fail_after(10):
            await tier.entered.wait()
        start = anyio.current_time()
    elapsed = anyio.current_time() - start
    assert elapsed < 0.2 + SLACK_S, elapsed
    (record,) = caplog.records
    assert record.getMessage() == (
        "cache closed before its jobs ended; cancelling them "
        "close_timeout_s=0.2 jobs=1 lanes={'memory[0]': 1}"
    )
    stats = cache.ledger.primary.statistics()
    assert (stats.pinned, stats.writing) == (0, 0)
    assert cache.ledger.counters[0].cascade_failed == 2


async def test_a_clean_exit_with_nothing_left_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier_async.api")
    async with TieredKVCache(config(close_timeout_s=0.0)) as cache:
        assert not cache.has_pending_work()
    assert caplog.records == []


def test_close_timeout_s_is_validated() -> None:
    assert CacheConfig.from_dict({"block_bytes": BLOCK, "num_slots": 1}).close_timeout_s == 30.0
    with pytest.raises(ConfigError, match="close_timeout_s: must be a number"):
        CacheConfig.from_dict({**config(1.0), "close_timeout_s": "soon"})
    with pytest.raises(ConfigError, match="close_timeout_s: must be in"):
        CacheConfig.from_dict({**config(1.0), "close_timeout_s": -1})


async def test_entering_an_open_cache_again_is_a_clear_error() -> None:
    cache = TieredKVCache(config(1.0))
    async with cache:
        with pytest.raises(RuntimeError, match="open already"):
            await cache.__aenter__()
        assert await cache.lookup([]) == 0  # still open, still working
    async with cache:  # once closed, it may be entered again
        pass


async def test_a_second_cache_with_the_same_instance_id_is_refused() -> None:
    """Two live caches never share a region: the second one with the first one's
    ``instance_id`` is refused (naming the id and the pid) and the first serves its own
    bytes still."""
    from kvtier_async.memory import RegionClaimedError

    shared = {**config(1.0), "instance_id": f"same-{os.getpid()}-{id(object())}"}
    key = make_offload_key(b"h" * 16, 0)
    block = np.full(BLOCK, 7, dtype=np.uint8)
    async with TieredKVCache(shared) as first:
        await first.store([key], [block])
        with pytest.raises(RegionClaimedError) as caught:
            async with TieredKVCache(shared):
                pass
        assert repr(shared["instance_id"]) in str(caught.value)
        assert f"process {os.getpid()}" in str(caught.value)
        out = np.zeros(BLOCK, dtype=np.uint8)
        assert await first.load([key], [out]) == 1
        assert (out == 7).all()
    async with TieredKVCache(shared):  # free again once the first closed
        pass
