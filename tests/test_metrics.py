"""The async API's metrics (a caller's Prometheus registry, `str(stats)`, final figures after
the close) and its KV events for a store, a cascade, an eviction, a promotion, the fs tier's
GC and a reset."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from kvtier_async.api import TieredKVCache
from kvtier_async.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvtier_async.ledger import prefix_keys, split_offload_key
from kvtier_async.tiers import base
from kvtier_async.tiers.memory import MemoryTier

prometheus_client = pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.anyio
pytest_plugins = ["conftest_s3"]
BLOCK = 4096
FILE = 8192  # a block file: its header page and the payload


def fs_config(root: Path, slots: int = 4, **tier: Any) -> dict[str, Any]:
    return {
        "block_bytes": BLOCK,
        "num_slots": slots,
        "secondary_tiers": [{"type": "fs", "name": "disk", "root_dir": str(root), **tier}],
    }


def blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    return [np.full(BLOCK, (seed + i) % 256, np.uint8) for i in range(n)]


def scrape(registry: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: dict[Any, float], name: str, **labels: str) -> float:
    return got[(name, frozenset(labels.items()))]


async def test_the_registry_a_caller_passes_counts_what_the_cache_did(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    cache = TieredKVCache(fs_config(tmp_path))
    collector = cache.register_metrics(registry)
    assert not [k for k in scrape(registry) if k[0].startswith("kvtier")]  # not open: none
    async with cache:
        keys = prefix_keys(range(64))  # 4 blocks
        await cache.store(keys, blocks(4))
        await cache.drain()  # cascaded: counters final
        await cache.reset()  # the CPU tier forgets them
        assert await cache.lookup(keys) == 4  # promoted from disk
        out = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert await cache.load(keys, out) == 4
        await cache.drain()
        got = scrape(registry)
    disk = {"tier": "disk"}
    assert value(got, "kvtier_tier_cascades_total", **disk) == 4
    assert value(got, "kvtier_tier_bytes_total", direction="write", **disk) == 4 * BLOCK
    assert value(got, "kvtier_tier_promotions_total", **disk) == 4
    assert value(got, "kvtier_tier_bytes_total", direction="read", **disk) == 4 * BLOCK
    assert value(got, "kvtier_tier_lookups_total", **disk) == 4
    assert value(got, "kvtier_tier_hits_total", **disk) == 4
    assert value(got, "kvtier_tier_misses_total", **disk) == 0
    assert value(got, "kvtier_tier_seconds_total", direction="read", **disk) > 0
    assert value(got, "kvtier_tier_failures_total", kind="promote", **disk) == 0
    assert value(got, "kvtier_tier_queue_depth", **disk) == 0
    assert value(got, "kvtier_cpu_slots", state="evictable") == 4
    assert value(got, "kvtier_device_bytes_total", direction="store") == 4 * BLOCK
    assert value(got, "kvtier_device_bytes_total", direction="load") == 4 * BLOCK
    # closed: the same final figures, and the global registry never saw any of it
    assert scrape(registry) == got
    assert not [m for m in prometheus_client.REGISTRY.collect() if m.name.startswith("kvtier")]
    registry.unregister(collector)


async def test_capacity_failures_and_queue_depth_per_tier(tmp_path: Path) -> None:
    config = fs_config(tmp_path, slots=8, max_bytes=3 * FILE)
    config["secondary_tiers"].append(
        {"type": "memory", "name": "broken", "fail_rate": 1.0, "latency_s": 0.5}
    )
    registry = prometheus_client.CollectorRegistry()
    async with TieredKVCache(config) as cache:
        cache.register_metrics(registry)
        await cache.store(prefix_keys(range(64)), blocks(4))
        got = scrape(registry)  # the cascades to "broken" take 0.5 s: still in flight
        assert value(got, "kvtier_tier_queue_depth", tier="broken") >= 1
        await cache.drain()
        got = scrape(registry)
    assert value(got, "kvtier_tier_failures_total", kind="cascade", tier="broken") == 4
    assert value(got, "kvtier_tier_cascades_total", tier="broken") == 0
    assert value(got, "kvtier_tier_queue_depth", tier="broken") == 0
    assert value(got, "kvtier_tier_max_bytes", tier="disk") == 3 * FILE
    assert value(got, "kvtier_tier_used_bytes", tier="disk") == 3 * FILE  # one was deleted


class BlindTier(MemoryTier):
    """Stores and loads like the memory tier; every lookup fails whole."""

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        raise OSError("lookups are down")


async def test_a_failed_lookup_is_a_failure_a_key_not_found_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def blind(section: Any, name: str, ctx: Any) -> BlindTier:
        return BlindTier(name, ctx, read_workers=1, write_workers=1)

    monkeypatch.setitem(base._FACTORIES, "blind", (base.OpenTierConfig, blind))
    config = fs_config(tmp_path)
    config["secondary_tiers"].append({"type": "blind", "name": "blind"})
    registry = prometheus_client.CollectorRegistry()
    async with TieredKVCache(config) as cache:
        cache.register_metrics(registry)
        keys = prefix_keys(range(64))
        assert await cache.lookup(keys) == 0  # nothing anywhere: both tiers asked
        got = scrape(registry)
    asked = value(got, "kvtier_tier_lookups_total", tier="blind")
    assert asked > 0 and value(got, "kvtier_tier_lookups_total", tier="disk") == asked
    assert value(got, "kvtier_tier_failures_total", kind="lookup", tier="blind") == asked
    assert value(got, "kvtier_tier_failures_total", kind="lookup", tier="disk") == 0
    assert value(got, "kvtier_tier_misses_total", tier="disk") == asked


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the obj tier is asyncio-only
async def test_an_s3_tier_shows_its_breaker(moto_s3: Any, s3_bucket: str) -> None:
    config = {
        "block_bytes": BLOCK,
        "num_slots": 4,
        "secondary_tiers": [{**moto_s3.tier_config(s3_bucket), "name": "bucket"}],
    }
    registry = prometheus_client.CollectorRegistry()
    async with TieredKVCache(config) as cache:
        cache.register_metrics(registry)
        await cache.store(prefix_keys(range(32)), blocks(2))
        await cache.drain()
        got = scrape(registry)
    assert value(got, "kvtier_tier_breaker_state", tier="bucket", state="closed") == 1
    assert value(got, "kvtier_tier_breaker_state", tier="bucket", state="open") == 0
    assert value(got, "kvtier_tier_cascades_total", tier="bucket") == 2
    assert ("kvtier_tier_used_bytes", frozenset({("tier", "bucket")})) not in got


async def test_stats_read_for_a_person_and_stay_after_the_close(tmp_path: Path) -> None:
    cache = TieredKVCache(fs_config(tmp_path, max_bytes=8 * FILE))
    with pytest.raises(RuntimeError, match="not open"):
        cache.stats()
    async with cache:
        keys = prefix_keys(range(64))
        await cache.store(keys, blocks(4))
        await cache.drain()
        await cache.reset()
        assert await cache.lookup(keys) == 4
        live = cache.stats()
    final = cache.stats()
    assert final.lookups == live.lookups == 4 and final.lookup_hits == 4
    assert final.tiers[0].counts.cascaded == 4 and final.tiers[0].counts.promoted == 4
    text = str(final)
    assert text.splitlines() == [
        "CPU tier: 4/4 slots used (4 readable, 0 writing, 0 pinned); lookups 4, hits 4 (100%)",
        "disk (fs): hits 4/4, promoted 4 (16.4 kB), cascaded 4 (16.4 kB), failed 0, queued 0, "
        "holds 32.8 kB of 65.5 kB",
    ]


async def test_stats_and_the_registry_read_one_set_of_figures_per_tier(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    async with TieredKVCache(fs_config(tmp_path, max_bytes=8 * FILE)) as cache:
        cache.register_metrics(registry)
        keys = prefix_keys(range(96))  # 6 blocks, 4 of them stored and cascaded
        await cache.store(keys[:4], blocks(4))
        await cache.drain()
        await cache.reset()
        assert await cache.lookup(keys) == 4
        await cache.drain()
        got, stats = scrape(registry), cache.stats()
    (tier,) = stats.tiers
    disk = tier.counts
    assert (tier.name, tier.kind, tier.state.name) == ("disk", "fs", "disk")
    assert disk.promoted == disk.cascaded == 4 and disk.lookups == 6 and disk.hits == 4
    series = {
        "kvtier_tier_lookups_total": disk.lookups,
        "kvtier_tier_hits_total": disk.hits,
        "kvtier_tier_misses_total": disk.misses,
        "kvtier_tier_promotions_total": disk.promoted,
        "kvtier_tier_cascades_total": disk.cascaded,
        "kvtier_tier_queue_depth": tier.queue_depth,
        "kvtier_tier_used_bytes": tier.state.used_bytes,
        "kvtier_tier_max_bytes": tier.state.max_bytes,
    }
    for name, figure in series.items():
        assert value(got, name, tier="disk") == figure, name
    for direction, figure in (("read", disk.bytes_read), ("write", disk.bytes_written)):
        assert value(got, "kvtier_tier_bytes_total", tier="disk", direction=direction) == figure
    assert disk.bytes_read == disk.bytes_written == 4 * BLOCK
    for kind in ("promote", "cascade", "lookup"):
        assert value(got, "kvtier_tier_failures_total", tier="disk", kind=kind) == 0
    assert f"hits {disk.hits}/{disk.lookups}, promoted {disk.promoted}" in str(stats)


async def test_the_ledger_the_lanes_and_the_tier_feed_one_counter_set(tmp_path: Path) -> None:
    """Each tier's one `TierCounters` is the object the tiering ledger and the tier's lanes
    are handed: the ledger counts the cascades, the lanes their bytes and seconds, the tier
    which blocks it wrote and which it found stored already (a second cache on the root)."""
    keys = prefix_keys(range(64))  # 4 blocks
    for written, present in ((4, 0), (0, 4)):
        async with TieredKVCache(fs_config(tmp_path)) as cache:
            (tier,) = cache.tiers
            assert cache.ledger.counters == [tier.counters]
            assert cache.ledger.counters[0] is tier.counters
            await cache.store(keys, blocks(4))
            await cache.drain()
            counts = cache.stats().tiers[0].counts
        assert counts is not tier.counters  # a snapshot: not updated afterwards
        assert (counts.cascaded, counts.written, counts.present) == (4, written, present)
        assert counts.bytes_written == 4 * BLOCK and counts.write_seconds > 0
        assert (counts.lookups, counts.promoted, counts.bytes_read, counts.failed) == (0, 0, 0, 0)
        assert cache.stats().device.store_bytes == 4 * BLOCK


def test_each_series_name_is_written_once_in_the_package() -> None:
    """A series' name lives in its `Series`, which carries its reader: no other module of
    the package spells it (the vLLM face reads `SERIES`)."""
    from kvtier_async.metrics import SERIES

    package = Path(base.__file__).resolve().parents[1]
    sources = {p: p.read_text() for p in package.rglob("*.py")}
    for series in SERIES:
        spelled = [
            p.name for p, text in sources.items() for _ in range(text.count(f'"{series.name}"'))
        ]
        assert spelled == ["metrics.py"], (series.name, spelled)


# --- KV events ---------------------------------------------------------------------------------


def take(stream: Any) -> list[KVEvent]:
    got: list[KVEvent] = []
    while True:
        try:
            got.append(stream.receive_nowait())
        except anyio.WouldBlock:
            return got


async def test_events_of_a_store_cascade_eviction_promotion_gc_and_reset(tmp_path: Path) -> None:
    # 4 CPU slots; the fs tier holds 6 block files and deletes the least recently used
    cache = TieredKVCache(fs_config(tmp_path, max_bytes=6 * FILE))
    async with cache, cache.events() as stream:
        a = prefix_keys(range(64))  # 4 blocks
        a_hashes = tuple(split_offload_key(k)[0] for k in a)
        await cache.store(a, blocks(4))
        await cache.drain()
        # store into the CPU tier, then the cascade into the fs tier
        assert take(stream) == [
            BlockStored(a_hashes, 0, "CPU"),
            BlockStored(a_hashes, 0, "STORAGE", "disk"),
        ]
        b = prefix_keys(range(1000, 1032))  # 2 blocks: 2 of a's are evicted
        b_hashes = tuple(split_offload_key(k)[0] for k in b)
        await cache.store(b, blocks(2, seed=9))
        await cache.drain()
        got = take(stream)
        # eviction from the CPU tier (a's tail blocks first, as vLLM orders a prefix),
        # b stored and cascaded; the fs tier now holds 6 files: nothing deleted yet
        assert isinstance(got[0], BlockRemoved) and got[0].medium == "CPU"
        assert sorted(got[0].block_hashes) == sorted(a_hashes[2:])
        assert got[1:] == [
            BlockStored(b_hashes, 0, "CPU"),
            BlockStored(b_hashes, 0, "STORAGE", "disk"),
        ]
        # promotion: a's evicted blocks come back from the fs tier, into slots the
        # CPU tier frees by eviction (as vLLM's, an anonymous lookup touches nothing,
        # so a0 and a1 go first, and are promoted back in their turn)
        assert await cache.lookup(a) == 4
        got = take(stream)
        assert BlockStored(a_hashes[2:], 0, "CPU") in got
        back = {h for e in got if isinstance(e, BlockStored) for h in e.block_hashes}
        assert back == set(a_hashes)
        assert not [e for e in got if getattr(e, "medium", "") == "STORAGE"]
        # GC: 2 more blocks cascade; over max_bytes, the fs tier deletes the 2 least
        # recently used files (b's; a's were read by the promotion) and says so
        c = prefix_keys(range(2000, 2032))
        c_hashes = tuple(split_offload_key(k)[0] for k in c)
        await cache.store(c, blocks(2, seed=20))
        await cache.drain()
        got = take(stream)
        assert BlockStored(c_hashes, 0, "STORAGE", "disk") in got
        gone = [e for e in got if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
        assert gone and all(e.tier == "disk" and e.group_idx == 0 for e in gone)
        assert {h for e in gone for h in e.block_hashes} == set(b_hashes)
        # reset: one AllBlocksCleared for the CPU tier, no removal per block
        await cache.reset()
        assert take(stream) == [AllBlocksCleared("CPU")]
