"""The connector's stats, Prometheus metrics and KV events inside vLLM 0.33's real Scheduler.

Stats travel as vLLM moves them: the worker connector's ``get_kv_connector_stats`` on the
`KVConnectorOutput`, aggregated by the scheduler's ``update_from_output`` with the scheduler
role's, into ``SchedulerStats.kv_connector_stats``; that payload goes to the Prometheus
object vLLM's own ``KVConnectorProm`` builds through the connector class, registered into a
fresh ``prometheus_client`` registry, and a scrape of it is checked against what the run did.
KV events are what vLLM's Scheduler publishes from the connector's ``take_events``.
"""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path
from typing import Any

import pytest

import vllm_harness as vh
from vllm_harness import OURS, random_tokens

pytestmark = pytest.mark.vllm

BLOCK_BYTES = 4096  # 2 layers x K|V x 16 tokens x 2 heads x 16 x fp16, one worker
LABELS = ["model_name", "engine"]
ENGINE = {0: ["tiny", "0"]}


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("prometheus_client")
    vh.load()


def ours(**extra: Any) -> dict[str, Any]:
    config = {**OURS["extra_config"], **extra}
    if "secondary_tiers" in extra:
        config["spec_name"] = "TieringOffloadingSpec"
    return {**OURS, "extra_config": config}


def record_payloads(h: Any) -> list[dict[str, Any]]:
    """The ``kv_connector_stats`` of every ``SchedulerStats`` the engine core emits."""
    payloads: list[dict[str, Any]] = []
    collect = h._collect

    def tap(engine_outputs: Any) -> None:
        for eco in engine_outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                payloads.append(stats.kv_connector_stats)
        collect(engine_outputs)

    h._collect = tap
    return payloads


def prometheus(vllm_config: Any, registry: Any) -> Any:
    """vLLM's `KVConnectorProm` (which builds the connector class's metrics through
    ``build_prom_metrics``), registering into ``registry`` instead of the global one."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)  # type: ignore[assignment]
        _counter_cls = functools.partial(Counter, registry=registry)  # type: ignore[assignment]
        _histogram_cls = functools.partial(Histogram, registry=registry)  # type: ignore[assignment]

    return Prom(vllm_config, LABELS, ENGINE)


def scrape(registry: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The text exposition, parsed: (sample name, labels) -> value."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    want = {"model_name": "tiny", "engine": "0", **labels}
    return samples[(name, frozenset(want.items()))]


def evict_gpu_prefix_cache(h: Any, seed: int = 1) -> int:
    """Run unrelated requests (8 offloaded blocks each) until every GPU block was reused;
    how many ran."""
    rng = random.Random(seed)
    count = -(-h.num_gpu_blocks // 8) + 1
    for i in range(count):
        h.add_request(f"filler-{seed}-{i}", random_tokens(rng, 8 * 16 + 3), max_tokens=2)
        h.run_until_done()
    return count


def block_files(root: Path) -> int:
    return sum(name.endswith(".bin") for _, _, names in os.walk(root) for name in names)


# --- stats and Prometheus ----------------------------------------------------------------------


def test_a_run_is_counted_on_the_scrape(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    root = tmp_path / "kv"
    prefix = random_tokens(random.Random(5), 100)
    fs = {"type": "fs", "root_dir": str(root)}
    config = ours(secondary_tiers=[fs], cpu_bytes_to_use=8 * 4096)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        payloads = record_payloads(h)
        h.connector.metrics.series_interval_s = 0.0  # our series every step, not every 1 s
        h.add_request("first", [*prefix, 5], max_tokens=2)  # 6 full blocks
        h.run_until_done()
        fillers = evict_gpu_prefix_cache(h)  # pushes the prefix out of the CPU tier too
        h.add_request("second", [*prefix, 6], max_tokens=2)  # its 6 blocks come from fs
        h.run_until_done()
        assert h.stats.external_hit_tokens == 96
        scheduler = h.connector.scheduler
        while scheduler.has_pending_work():  # the last cascades: counters final
            h.step()
        files = block_files(root)
        failures = scheduler.store_allocation_failures

    registry = CollectorRegistry()
    prom = prometheus(h.vllm_config, registry)
    logged = KVConnectorLogging(h.vllm_config.kv_transfer_config)
    for payload in payloads:
        prom.observe(payload, 0)
        logged.observe(payload)
    got = scrape(registry)

    stored_blocks = 6 + fillers * 8  # every prompt's full blocks, each once
    # the workers' copies, as vLLM's series
    assert value(got, "vllm:kv_offload_store_bytes_total") == stored_blocks * BLOCK_BYTES
    assert value(got, "vllm:kv_offload_load_bytes_total") == 6 * BLOCK_BYTES
    assert value(got, "vllm:kv_offload_load_size_count") == 1  # one load job
    assert value(got, "vllm:kv_offload_load_size_sum") == 6 * BLOCK_BYTES
    assert value(got, "vllm:kv_offload_store_time_total") > 0
    assert value(got, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == (
        stored_blocks * BLOCK_BYTES
    )  # the deprecated series too, as vLLM's CPU offloading keeps them
    # the scheduler's observations
    assert value(got, "vllm:kv_offload_lookup_sync_delay_seconds_count") >= 2 + fillers
    assert value(got, "vllm:kv_offload_lookup_async_delay_seconds_count") >= 1  # fs lookups
    if failures:
        assert value(got, "vllm:kv_offload_allocation_failure_total") == failures
    info = {
        "cpu_num_chunks": "8",
        "cpu_blocks_per_chunk": "1",
        "cpu_kv_cache_size_bytes": str(8 * BLOCK_BYTES),
        "cpu_kv_cache_size_tokens": "128",
    }
    assert value(got, "vllm:kv_offload_config_info", **info) == 1
    assert 0 <= value(got, "vllm:kv_offload_cpu_cache_usage_perc") <= 1
    # our per-tier series
    tier = {"tier": "fs[0]"}
    assert value(got, "kvtier_tier_cascades_total", **tier) == files == stored_blocks
    assert value(got, "kvtier_tier_bytes_total", direction="write", **tier) == files * BLOCK_BYTES
    assert value(got, "kvtier_tier_promotions_total", **tier) == 6
    assert value(got, "kvtier_tier_bytes_total", direction="read", **tier) == 6 * BLOCK_BYTES
    assert value(got, "kvtier_tier_hits_total", **tier) == 6
    lookups = value(got, "kvtier_tier_lookups_total", **tier)
    assert lookups > 6 and value(got, "kvtier_tier_misses_total", **tier) == lookups - 6
    assert value(got, "kvtier_tier_seconds_total", direction="write", **tier) > 0
    assert value(got, "kvtier_tier_failures_total", kind="cascade", **tier) == 0
    assert value(got, "kvtier_tier_queue_depth", **tier) == 0
    assert (
        value(got, "kvtier_cpu_slots", state="evictable")
        + value(got, "kvtier_cpu_slots", state="free")
        == 8
    )
    # vLLM's log line rebuilds the payload through build_kv_connector_stats
    lines: list[str] = []
    logged.log(lambda fmt, *args: lines.append(fmt % args))
    assert f"vllm:kv_offload_load_bytes={6 * BLOCK_BYTES}" in lines[0]


def test_shared_series_match_vllms_offloading_connector() -> None:
    """vLLM's own OffloadPromMetrics and ours, fed the same payload of the series both
    have: the same exposition (names, help, types, labels, buckets, values)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    from kvtier_async.integrations.vllm.connector import KVTierConnector

    with vh.VllmHarness(num_gpu_blocks=40, **OURS) as h:
        payloads = record_payloads(h)
        prefix = random_tokens(random.Random(2), 100)
        for i in range(3):
            h.add_request(f"r{i}", [*prefix, i], max_tokens=2)
            h.run_until_done()
        evict_gpu_prefix_cache(h)
        h.add_request("again", [*prefix, 9], max_tokens=2)
        h.run_until_done()

    def types(registry: Any) -> dict[type, Any]:
        return {
            cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
        }

    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = OffloadPromMetrics(h.vllm_config, types(theirs_registry), LABELS, ENGINE)
    mine = KVTierConnector.build_prom_metrics(h.vllm_config, types(ours_registry), LABELS, ENGINE)
    shared = 0
    for payload in payloads:
        data = payload["data"]
        common = {k: v for k, v in data.items() if k.startswith("vllm:")}
        shared += len(common)
        payload = {**payload, "data": common}
        theirs.observe(payload, 0)
        mine.observe(payload, 0)
    assert shared > 0
    from prometheus_client import generate_latest

    def vllm_lines(registry: Any) -> list[str]:
        text = generate_latest(registry).decode().splitlines()
        # the _created samples are each metric's creation time: not comparable
        return [line for line in text if "vllm:" in line and "_created{" not in line]

    assert vllm_lines(ours_registry) == vllm_lines(theirs_registry)
    assert any("kv_offload_load_bytes_total{" in line for line in vllm_lines(ours_registry))


# --- KV events --------------------------------------------------------------------------------


class Recorder:
    """Stands for vLLM's event publisher: keeps every batch the Scheduler publishes."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def publish_events(h: Any) -> Recorder:
    """KV events on, as ``--kv-events-config '{"enable_kv_cache_events": true}'`` turns
    them on for the connector, and vLLM's publisher swapped for a `Recorder`."""
    recorder = Recorder()
    h.connector._publish_events = True
    h.connector.scheduler.ledger.events_enabled = True  # recorded, as with the config
    h.scheduler.kv_event_publisher = recorder
    return recorder


def hashes_of(h: Any, req_id: str, count: int) -> list[Any]:
    """A request's first block hashes as KV events carry them (vLLM's conversion: 64-bit
    integers by default)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(x) for x in h.requests[req_id].block_hashes[:count]]


def stored_in(events: list[Any], medium: str) -> set[Any]:
    return {
        x
        for e in events
        if type(e).__name__ == "BlockStored" and e.medium == medium
        for x in e.block_hashes
    }


def removed_from(events: list[Any], medium: str) -> set[Any]:
    return {
        x
        for e in events
        if type(e).__name__ == "BlockRemoved" and e.medium == medium
        for x in e.block_hashes
    }


def test_events_of_a_store_cascade_eviction_promotion_and_reset(tmp_path: Path) -> None:
    fs = {"type": "fs", "name": "disk", "root_dir": str(tmp_path / "kv")}
    prefix = random_tokens(random.Random(5), 100)
    config = ours(secondary_tiers=[fs], cpu_bytes_to_use=8 * 4096)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        recorder = publish_events(h)
        scheduler = h.connector.scheduler

        def settle() -> list[Any]:
            h.run_until_done()
            while scheduler.has_pending_work():
                h.step()
            got, recorder.events = recorder.events, []
            return got

        h.add_request("first", [*prefix, 5], max_tokens=2)
        first = hashes_of(h, "first", 6)
        got = settle()
        # store: a BlockStored per block in the CPU tier, group 0, vLLM's medium string;
        # cascade: the same blocks in the fs tier (medium STORAGE, ownership its name)
        assert stored_in(got, "CPU") == set(first)
        assert stored_in(got, "STORAGE") == set(first)
        assert all(e.group_idx == 0 for e in got)
        assert {e.ownership for e in got if e.medium == "STORAGE"} == {"disk"}
        cpu_first = next(i for i, e in enumerate(got) if e.medium == "CPU")
        fs_first = next(i for i, e in enumerate(got) if e.medium == "STORAGE")
        assert cpu_first < fs_first
        # eviction: the fillers push the prefix out of the CPU tier (not out of fs)
        evict_gpu_prefix_cache(h)
        got = settle()
        assert set(first) <= removed_from(got, "CPU")
        assert not removed_from(got, "STORAGE")
        # promotion: the prefix comes back into the CPU tier from fs
        h.add_request("second", [*prefix, 6], max_tokens=2)
        got = settle()
        assert h.stats.external_hit_tokens == 96
        assert set(first) <= stored_in(got, "CPU")
        assert not stored_in(got, "STORAGE") & set(first)  # fs had them: not written again
        # reset: one AllBlocksCleared, no BlockRemoved per key; published at the next step
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        h.add_request("third", random_tokens(random.Random(6), 3 * 16 + 1), max_tokens=2)
        got = settle()
        names = [type(e).__name__ for e in got]
        assert names[0] == "AllBlocksCleared" and "BlockRemoved" not in names
        assert len(stored_in(got, "CPU")) == 3  # then the new request's blocks


def test_a_block_the_fs_gc_deletes_is_announced(tmp_path: Path) -> None:
    # max_bytes for 10 block files (header + payload each): the fillers' cascades make the
    # fs tier delete the oldest files, the prefix's among them
    fs = {"type": "fs", "name": "disk", "root_dir": str(tmp_path / "kv"), "max_bytes": 10 * 8192}
    prefix = random_tokens(random.Random(5), 100)
    config = ours(secondary_tiers=[fs], cpu_bytes_to_use=8 * 4096)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        recorder = publish_events(h)
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        while h.connector.scheduler.has_pending_work():
            h.step()
        first = set(hashes_of(h, "first", 6))
        assert first <= removed_from(recorder.events, "STORAGE")
        removed = [e for e in recorder.events if type(e).__name__ == "BlockRemoved"]
        assert {e.ownership for e in removed if e.medium == "STORAGE"} == {"disk"}


def test_no_event_is_recorded_with_kv_events_off() -> None:
    """As vLLM's manager: without ``enable_kv_cache_events`` nobody takes the events, so
    the ledger records none (and a run costs no event objects)."""
    with vh.VllmHarness(num_gpu_blocks=40, **OURS) as h:
        assert h.connector._publish_events is False
        ledger = h.connector.scheduler.ledger
        assert ledger.events_enabled is False
        h.add_request("a", random_tokens(random.Random(3), 100), max_tokens=2)
        h.run_until_done()
        assert ledger.primary.statistics().used > 0  # stored: events would have been due
        assert ledger.take_events() == [] and h.connector.take_events() == ()
        h.assert_no_leaks()


def test_events_are_vllms_translation() -> None:
    """Ours and vLLM's OffloadingEventsTracker give the same KV events for the same ledger
    events (vLLM's connector translates its manager's events with that tracker)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import Medium as VllmMedium
    from vllm.v1.kv_offload.base import OffloadingEvent as VllmEvent
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    from kvtier_async.integrations.vllm.events import events_to_vllm
    from kvtier_async.ledger import Medium, OffloadingEvent, make_offload_key

    a, b = make_offload_key(b"\x01" * 8, 0), make_offload_key(b"\x02" * 8, 1)
    ours_events = [
        OffloadingEvent([a, b], Medium.CPU, removed=False),
        OffloadingEvent([a], Medium.STORAGE, removed=False, tier="disk"),
        OffloadingEvent([a, b], Medium.CPU, removed=True),
        OffloadingEvent([b], Medium.CPU, removed=True, metadata_only=True),
        OffloadingEvent([a], Medium.STORAGE, removed=True, tier="disk"),
    ]
    theirs_events = [
        VllmEvent(
            list(e.keys),
            VllmMedium[e.medium.name],
            e.removed,
            ownership=e.tier,
            metadata_only=e.metadata_only,
        )
        for e in ours_events
    ]
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    theirs = list(tracker.take_events(theirs_events))
    got = events_to_vllm(ours_events)
    assert got == theirs
    assert [e.group_idx for e in got] == [0, 1, 0, 0, 1, 0]
    assert got[2].medium == "STORAGE" and got[2].ownership == "disk"
    # a reset: one AllBlocksCleared in its place
    cleared = events_to_vllm(
        [*ours_events[:1], OffloadingEvent([a, b], Medium.CPU, removed=True, cleared=True)]
    )
    assert [type(e).__name__ for e in cleared] == ["BlockStored", "BlockStored", "AllBlocksCleared"]
