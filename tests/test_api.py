"""TieredKVCache end to end over the real shared region and the memory tier; cancellation
at each await point leaves the ledger consistent."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from kvtier_async.api import CacheConfig, TieredKVCache
from kvtier_async.config import ConfigError
from kvtier_async.ledger import LedgerError, LookupResult, make_offload_key
from kvtier_async.tiers.memory import MemoryTier
from kvtier_async.transfer.copier import HostPlanCopier
from kvtier_async.transfer.hostcopy import batch_copier
from kvtier_async.transfer.plan import CopyPlan

pytestmark = pytest.mark.anyio
BLOCK = 4096


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


def blocks(*ids: int) -> list[np.ndarray]:
    return [np.full(BLOCK, i % 251, dtype=np.uint8) for i in ids]


def config(slots: int = 8, **tier: Any) -> dict[str, Any]:
    return {
        "block_bytes": BLOCK,
        "num_slots": slots,
        "secondary_tiers": [{"type": "memory", "n_read_workers": 1, "n_write_workers": 1, **tier}],
    }


def tier_of(cache: TieredKVCache) -> MemoryTier:
    tier = cache.tiers[0]
    assert isinstance(tier, MemoryTier)
    return tier


def verify_idle(cache: TieredKVCache) -> None:
    stats = cache.ledger.primary.statistics()
    assert stats.writing == 0 and stats.pinned == 0, stats
    assert not cache.has_pending_work()


async def cancel_when(
    entered: Callable[[], Awaitable[object]], call: Callable[[], Awaitable[object]]
) -> None:
    """Run ``call``, cancel it once ``entered`` returns; it must end cancelled."""
    scope = anyio.CancelScope()
    finished = []

    async def run() -> None:
        with scope:
            await call()
            finished.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await entered()
        scope.cancel()
    assert not finished and scope.cancelled_caught


async def test_store_cascade_reset_promote_load_round_trip() -> None:
    async with TieredKVCache(config()) as cache:
        result = await cache.store(ks(1, 2, 3), blocks(1, 2, 3))
        assert result.stored == ks(1, 2, 3) and not result.no_room
        await cache.drain()
        assert len(tier_of(cache)) == 3  # cascaded
        await cache.reset()  # the CPU tier forgets; the memory tier keeps
        assert cache.ledger.lookup(k(1), "probe") is LookupResult.RETRY
        cache.ledger.request_finished("probe")
        assert await cache.lookup(ks(1, 2, 3, 4)) == 3
        out = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
        assert await cache.load(ks(1, 2, 3), out) == 3
        assert all((o == b).all() for o, b in zip(out, blocks(1, 2, 3)))
        stats = cache.stats()
        assert stats.tiers[0].counts.promoted == 3 and stats.tiers[0].counts.cascaded == 3
        verify_idle(cache)


async def test_torch_tensors_as_device_blocks() -> None:
    async with TieredKVCache(config()) as cache:
        src = torch.arange(2 * BLOCK // 2, dtype=torch.int16).reshape(2, -1)
        await cache.store(ks(1, 2), [src[0], src[1]])
        dst = torch.zeros_like(src)
        assert await cache.lookup(ks(1, 2)) == 2
        assert await cache.load(ks(1, 2), [dst[0], dst[1]]) == 2
        assert torch.equal(src, dst)


async def test_second_store_is_deduplicated() -> None:
    async with TieredKVCache(config()) as cache:
        await cache.store(ks(1), blocks(1))
        again = await cache.store(ks(1, 2), blocks(1, 2))
        assert again.stored == ks(2) and again.already_present == 1


async def test_lookup_waits_for_a_slow_tier() -> None:
    async with TieredKVCache(config()) as cache:
        await cache.store(ks(1), blocks(1))
        await cache.reset()
        tier = tier_of(cache)
        tier.gate = anyio.Event()
        found: list[int] = []
        async with anyio.create_task_group() as tg:

            async def look() -> None:
                found.append(await cache.lookup(ks(1)))

            tg.start_soon(look)
            await tier.entered.wait()
            assert not found  # the lookup awaits the tier instead of answering RETRY
            tier.gate.set()
        assert found == [1]


async def test_a_failed_promotion_is_a_miss_not_wrong_bytes() -> None:
    async with TieredKVCache(config()) as cache:
        await cache.store(ks(1, 2), blocks(1, 2))
        await cache.reset()
        tier_of(cache).fail_keys.add(k(2))
        assert await cache.lookup(ks(1, 2)) == 1
        assert await cache.lookup(ks(2)) == 0
        with pytest.raises(LedgerError, match="absent"):
            await cache.load(ks(2), [np.zeros(BLOCK, np.uint8)])
        verify_idle(cache)


async def test_no_room_in_the_cpu_tier() -> None:
    async with TieredKVCache(config(slots=2)) as cache:
        result = await cache.store(ks(1, 2, 3), blocks(1, 2, 3))
        assert result.no_room and result.stored == []
        verify_idle(cache)


# --- cancellation at each await point ----------------------------------------------------


async def test_cancel_lookup_waiting_for_a_tier_lookup() -> None:
    async with TieredKVCache(config()) as cache:
        await cache.store(ks(1), blocks(1))
        await cache.reset()
        tier = tier_of(cache)
        tier.gate = anyio.Event()
        await cancel_when(tier.entered.wait, lambda: cache.lookup(ks(1)))
        tier.gate.set()
        await cache.drain()
        verify_idle(cache)
        tier.gate = None
        assert await cache.lookup(ks(1)) == 1


async def test_cancel_lookup_waiting_for_a_promotion() -> None:
    async with TieredKVCache(config()) as cache:
        await cache.store(ks(1), blocks(1))
        await cache.reset()
        assert cache.ledger.lookup(k(1), "r") is LookupResult.RETRY
        await cache.drain()  # the tier answered: the next lookup promotes
        tier = tier_of(cache)
        tier.gate = anyio.Event()
        await cancel_when(tier.entered.wait, lambda: cache.lookup(ks(1), req="r"))
        tier.gate.set()
        await cache.drain()
        cache.ledger.request_finished("r")
        verify_idle(cache)
        assert cache.ledger.lookup(k(1), "s") is LookupResult.HIT  # the promotion landed


def hold_device_copies(cache: TieredKVCache) -> Callable[[], Awaitable[None]]:
    """Make the device lane's copies wait; the returned coroutine function waits until one
    has started, then lets it finish (the job still ends cancelled if it was cancelled)."""
    started, release = threading.Event(), threading.Event()
    copy = batch_copier()
    blocks = cache._blocks
    assert blocks is not None
    blocks.inline_bytes = 0  # every copy in a worker thread, where it can wait

    def slow_copy(plan: CopyPlan) -> None:
        started.set()
        release.wait()
        copy(plan)

    blocks.host = HostPlanCopier(slow_copy)

    async def copying() -> None:
        await anyio.to_thread.run_sync(started.wait)
        release.set()

    return copying


async def test_cancel_store_during_the_device_copy_frees_its_slots() -> None:
    async with TieredKVCache(config()) as cache:
        copying = hold_device_copies(cache)
        await cancel_when(copying, lambda: cache.store(ks(1, 2), blocks(1, 2)))
        await cache.drain()
        verify_idle(cache)
        assert cache.ledger.primary.statistics().used == 0


async def test_cancel_load_during_the_device_copy_releases_pins() -> None:
    async with TieredKVCache(config()) as cache:
        await cache.store(ks(1), blocks(1))
        await cache.drain()
        copying = hold_device_copies(cache)
        out = [np.zeros(BLOCK, np.uint8)]
        await cancel_when(copying, lambda: cache.load(ks(1), out))
        await cache.drain()
        verify_idle(cache)


async def test_cancel_store_waiting_to_submit_its_cascade() -> None:
    cfg = {**config(), "queue_depth": 1}
    async with TieredKVCache(cfg) as cache:
        tier = tier_of(cache)
        tier.gate = anyio.Event()
        # two cascades occupy the tier's two workers, a third fills its queue
        for i in (1, 2, 3):
            await cache.store(ks(i), blocks(i))
        await tier.entered.wait()

        async def submit_blocked() -> None:
            while cache.ledger.primary.lookup(k(4)) is not LookupResult.HIT:
                await anyio.wait_all_tasks_blocked()

        await cancel_when(submit_blocked, lambda: cache.store(ks(4), blocks(4)))
        assert cache.ledger.primary.ref_count(k(4)) == 0  # its cascade never ran: unpinned
        tier.gate.set()
        await cache.drain()
        verify_idle(cache)


async def test_exit_with_an_error_cancels_in_flight_work_and_releases_it() -> None:
    cache = TieredKVCache(config())
    with pytest.raises(RuntimeError, match="boom"):
        async with cache:
            tier = tier_of(cache)
            tier.gate = anyio.Event()
            await cache.store(ks(1, 2), blocks(1, 2))
            await tier.entered.wait()
            raise RuntimeError("boom")
    stats = cache.ledger.primary.statistics()
    assert stats.pinned == 0 and stats.writing == 0
    assert cache.ledger.counters[0].cascade_failed == 2


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"block_bytes": 0}, "block_bytes"),
        ({"colour": "red"}, "colour"),
        ({"eviction_policy": 3}, "eviction_policy"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"eviction_policy": "kvtier_nosuchmod:X"}, "eviction_policy"),  # not importable
        ({"eviction_policy": "kvtier_async.ledger:LedgerError"}, "eviction_policy"),
        ({"close_timeout_s": float("nan")}, "close_timeout_s"),
        ({"close_timeout_s": float("inf")}, "close_timeout_s"),
        ({"store_policy": "sometimes"}, "store_policy"),
        ({"cpu_bytes_to_use": 1 << 20}, "cpu_bytes_to_use"),  # with num_slots too
    ],
)
def test_config_errors_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({**config(), **change})
    assert info.value.field == field


async def test_a_bad_tier_config_names_the_field() -> None:
    cfg = {**config(), "secondary_tiers": [{"type": "memory"}, {"type": "tape"}]}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\]\.type"):
        async with TieredKVCache(cfg):
            pass


async def test_wrong_block_sizes_are_refused_before_anything_is_reserved() -> None:
    async with TieredKVCache(config()) as cache:
        with pytest.raises(ValueError, match=r"blocks\[1\] has 10 bytes"):
            await cache.store(ks(1, 2), [np.zeros(BLOCK, np.uint8), np.zeros(10, np.uint8)])
        with pytest.raises(ValueError, match="2 keys but 1 blocks"):
            await cache.store(ks(1, 2), blocks(1))
        verify_idle(cache)
        assert cache.ledger.primary.statistics().used == 0


async def test_blocks_on_a_device_without_a_copy_path_are_refused() -> None:
    """Blocks are host memory or CUDA tensors (the transfer path's two copiers)."""
    async with TieredKVCache(config()) as cache:
        meta = torch.empty(BLOCK, dtype=torch.uint8, device="meta")
        with pytest.raises(ValueError, match=r"blocks\[1\] is on meta: blocks must be in CPU"):
            await cache.store(ks(1, 2), [np.zeros(BLOCK, np.uint8), meta])
        verify_idle(cache)
        assert cache.ledger.primary.statistics().used == 0


async def test_cancelled_while_draining_at_exit_still_closes_everything() -> None:
    cache = TieredKVCache(config())
    entered: list[MemoryTier] = []
    opened = anyio.Event()

    async def body() -> None:
        async with cache:
            tier = tier_of(cache)
            tier.gate = anyio.Event()  # the cascade waits: the exit's drain waits for it
            entered.append(tier)
            opened.set()
            await cache.store(ks(1), blocks(1))

    async def draining() -> None:
        await opened.wait()
        await entered[0].entered.wait()

    await cancel_when(draining, body)
    assert cache._region is None and cache._engine is None
    stats = cache.ledger.primary.statistics()
    assert stats.pinned == 0 and stats.writing == 0


# --- the caller's memory after a cancelled call -----------------------------------------------

BIG = 4 << 20  # 32 blocks of 4 MiB: a 128 MiB copy, long enough to be cancelled midway


async def test_a_cancelled_load_never_writes_the_callers_blocks_afterwards() -> None:
    cfg = {"block_bytes": BIG, "num_slots": 32}
    keys = ks(*range(32))
    async with TieredKVCache(cfg) as cache:
        await cache.store(keys, [np.full(BIG, 7, np.uint8) for _ in keys])
        out = [np.zeros(BIG, np.uint8) for _ in keys]
        with anyio.move_on_after(0.002) as scope:
            await cache.load(keys, out)
        assert scope.cancelled_caught, "the load finished before it could be cancelled"
        for block in out:  # the caller reuses its buffers at once
            block.fill(0xEE)
        await cache.drain()  # a copy still running would end before this returns
        overwritten = sum(int(np.count_nonzero(block != 0xEE)) for block in out)
        assert overwritten == 0, f"{overwritten} bytes written after load() returned"
        verify_idle(cache)


async def test_a_cancelled_store_never_reads_the_callers_blocks_afterwards() -> None:
    cfg = {"block_bytes": BIG, "num_slots": 32}
    keys = ks(*range(32))
    async with TieredKVCache(cfg) as cache:
        src = [np.full(BIG, 7, np.uint8) for _ in keys]
        with anyio.move_on_after(0.002) as scope:
            await cache.store(keys, src)
        assert scope.cancelled_caught, "the store finished before it could be cancelled"
        for block in src:
            block.fill(0xEE)  # bytes the store must never see
        await cache.drain()
        verify_idle(cache)
        assert cache._region is not None
        region = cache._region.numpy()
        stored = [k for k in keys if cache.ledger.primary.lookup(k) is LookupResult.HIT]
        assert not stored  # a cancelled store publishes nothing
        assert not np.any(region == 0xEE), "the store read the caller's blocks after returning"
        del region  # the cache's region closes at the end of the block


# --- keys are checked at the call ----------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (b"x" * 20, "keys: must be a list of offload keys"),
        ("abcdef", "keys: must be a list of offload keys"),
        ([k(1), "abcdef"], r"keys\[1\]: must be bytes"),
        ([k(1), 5], r"keys\[1\]: must be bytes"),
        ([b""], r"keys\[0\]: must be 5-68 bytes"),
        ([b"abc"], r"keys\[0\]: must be 5-68 bytes"),
        ([b"x" * 69], r"keys\[0\]: must be 5-68 bytes"),
    ],
)
async def test_bad_keys_are_refused_at_the_call(keys: Any, message: str) -> None:
    async with TieredKVCache(config()) as cache:
        n = len(keys) if not isinstance(keys, (bytes, str)) else 1
        for call in (
            lambda: cache.lookup(keys),
            lambda: cache.store(keys, blocks(*range(n))),
            lambda: cache.load(keys, blocks(*range(n))),
        ):
            with pytest.raises((TypeError, ValueError), match=message):
                await call()
        verify_idle(cache)
        assert cache.ledger.primary.statistics().used == 0


async def test_every_call_after_close_raises() -> None:
    async with TieredKVCache(config()) as cache:
        await cache.store(ks(1), blocks(1))
    for call in (
        lambda: cache.lookup(ks(1)),
        lambda: cache.store(ks(2), blocks(2)),
        lambda: cache.load(ks(1), blocks(1)),
    ):
        with pytest.raises(RuntimeError, match="not open"):
            await call()
