"""Metrics: what the tiers did, as Prometheus series, for `TieredKVCache` and the vLLM connector.

Theory of operation. Nothing here counts anything: every figure is read from counters the
parts keep already. The tiering ledger counts, per secondary tier, the keys looked up and hit,
blocks promoted and cascaded and the keys that failed (`TierCounters`); each engine lane
tallies its jobs by kind, with bytes and seconds of run time (`LaneStatistics.by_kind`) and
its queue; each tier reports its own state (`TierStatistics`: bytes held of ``max_bytes``,
an S3 tier's circuit breaker); the CPU ledger its slots (`LedgerStatistics`). `samples`
reads them once into ``{series name: {label values: value}}``, cumulative since the cache
opened, for the series `SERIES` lists.

Two consumers:

- `CacheCollector`, a ``prometheus_client`` collector for the registry a `TieredKVCache`'s
  user passes (`TieredKVCache.register_metrics`): each scrape reads the cache's figures
  (the final ones once it is closed). It reads plain counters, so a scrape from another
  thread (``prometheus_client.start_http_server``) is safe: each figure is exact, a scrape is
  not one atomic snapshot of all of them.
- the vLLM connector (`kvtier_async.integrations.vllm.metrics`), whose counters travel as
  increments in vLLM's stats payload: `deltas` turns two `samples` into them.

Counters are final once `TieredKVCache.drain` returned (every cascade and promotion ended)
or the cache closed. ``prometheus_client`` is imported only by `CacheCollector` (the
``metrics`` extra); the rest needs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvtier_async.ledger import JobKind

if TYPE_CHECKING:
    from kvtier_async.engine import LaneStatistics
    from kvtier_async.ledger import LedgerStatistics, TierCounters
    from kvtier_async.tiers.base import TierStatistics

__all__ = [
    "ASYNC_API_ONLY",
    "SERIES",
    "CacheCollector",
    "Samples",
    "Series",
    "deltas",
    "samples",
    "summary",
]

Samples = dict[str, dict[tuple[str, ...], float]]
"""Series name -> label values (in the series' label order) -> value."""


@dataclass(frozen=True)
class Series:
    """One Prometheus series: its name (a counter's exposition adds ``_total``), type, help
    text and label names."""

    name: str
    type: Literal["counter", "gauge"]
    documentation: str
    labels: tuple[str, ...] = ()


_TIER = ("tier",)
SERIES: tuple[Series, ...] = (
    Series("kvtier_tier_lookups", "counter", "Keys looked up in a secondary tier.", _TIER),
    Series("kvtier_tier_hits", "counter", "Keys a secondary tier's lookups found.", _TIER),
    Series("kvtier_tier_misses", "counter", "Keys a secondary tier's lookups missed.", _TIER),
    Series(
        "kvtier_tier_promotions",
        "counter",
        "Blocks promoted from a secondary tier into the CPU tier.",
        _TIER,
    ),
    Series(
        "kvtier_tier_cascades",
        "counter",
        "Blocks cascaded from the CPU tier into a secondary tier.",
        _TIER,
    ),
    Series(
        "kvtier_tier_bytes",
        "counter",
        "Bytes a secondary tier moved: direction read (promotions) or write (cascades).",
        ("tier", "direction"),
    ),
    Series(
        "kvtier_tier_seconds",
        "counter",
        "Seconds of job run time in a secondary tier, summed over its workers: direction "
        "read (promotions), write (cascades) or lookup.",
        ("tier", "direction"),
    ),
    Series(
        "kvtier_tier_failures",
        "counter",
        "Keys a secondary tier failed, by kind: promote, cascade, or lookup (a lookup job "
        "that failed whole; a key not found is a miss).",
        ("tier", "kind"),
    ),
    Series(
        "kvtier_tier_queue_depth",
        "gauge",
        "Jobs queued or running in a secondary tier's lanes.",
        _TIER,
    ),
    Series(
        "kvtier_tier_breaker_state",
        "gauge",
        "1 for the state a tier's circuit breaker is in (closed, open, probing), 0 for the "
        "others; tiers with a breaker only (obj).",
        ("tier", "state"),
    ),
    Series(
        "kvtier_tier_used_bytes",
        "gauge",
        "Bytes a secondary tier holds, where it keeps count (fs with max_bytes, memory).",
        _TIER,
    ),
    Series(
        "kvtier_tier_max_bytes", "gauge", "A secondary tier's capacity, where it has one.", _TIER
    ),
    Series(
        "kvtier_cpu_slots",
        "gauge",
        "CPU tier slots by state: free, evictable (readable), writing, pinned (being read).",
        ("state",),
    ),
    Series(
        "kvtier_device_bytes",
        "counter",
        "Bytes copied between the caller's blocks and the CPU tier: direction store or load "
        "(async API; the vLLM connector reports vllm:kv_offload_store_bytes / _load_bytes).",
        ("direction",),
    ),
    Series(
        "kvtier_device_seconds",
        "counter",
        "Seconds of copy time between the caller's blocks and the CPU tier, by direction "
        "(async API).",
        ("direction",),
    ),
)
_BY_NAME = {s.name: s for s in SERIES}
ASYNC_API_ONLY = frozenset({"kvtier_device_bytes", "kvtier_device_seconds"})
"""Series only `TieredKVCache` has (the connector's copies are vLLM's own series)."""
_BREAKER_STATES = ("closed", "open", "probing")
_DIRECTIONS = (("read", JobKind.PROMOTE), ("write", JobKind.CASCADE), ("lookup", JobKind.LOOKUP))


def samples(
    primary: LedgerStatistics | None,
    tiers: Sequence[tuple[TierCounters, TierStatistics]],
    lanes: Sequence[LaneStatistics],
) -> Samples:
    """Every series' values now, from the CPU ledger's slots (None: not shown), each tier's
    ledger counters and statistics, and the engine's lanes (a tier's lanes are named after
    it: ``NAME`` for its I/O, ``NAME:lookup`` for its lookups; ``device`` for copies)."""
    out: Samples = {s.name: {} for s in SERIES}
    by_lane = {lane.name: lane for lane in lanes}
    for counters, stats in tiers:
        _tier_samples(out, counters, stats, by_lane)
    if primary is not None:
        slots = out["kvtier_cpu_slots"]
        slots[("free",)] = primary.free
        slots[("evictable",)] = primary.evictable
        slots[("writing",)] = primary.writing
        slots[("pinned",)] = primary.pinned
    device = by_lane.get("device")
    if device is not None:
        for direction in ("store", "load"):
            tally = device.by_kind.get(direction)
            if tally is not None:
                out["kvtier_device_bytes"][(direction,)] = tally.bytes
                out["kvtier_device_seconds"][(direction,)] = tally.seconds
    return out


def _tier_samples(
    out: Samples,
    counters: TierCounters,
    stats: TierStatistics,
    lanes: Mapping[str, LaneStatistics],
) -> None:
    tier = (stats.name,)
    out["kvtier_tier_lookups"][tier] = counters.lookups
    out["kvtier_tier_hits"][tier] = counters.lookup_hits
    out["kvtier_tier_misses"][tier] = counters.lookups - counters.lookup_hits
    out["kvtier_tier_promotions"][tier] = counters.promoted
    out["kvtier_tier_cascades"][tier] = counters.cascaded
    io, lookup = lanes.get(stats.name), lanes.get(f"{stats.name}:lookup")
    for direction, kind in _DIRECTIONS:
        lane = lookup if kind is JobKind.LOOKUP else io
        tally = lane.by_kind.get(kind.value) if lane is not None else None
        if kind is not JobKind.LOOKUP:
            out["kvtier_tier_bytes"][(stats.name, direction)] = tally.bytes if tally else 0
        out["kvtier_tier_seconds"][(stats.name, direction)] = tally.seconds if tally else 0.0
    failures = out["kvtier_tier_failures"]
    failures[(stats.name, "promote")] = counters.promote_failed
    failures[(stats.name, "cascade")] = counters.cascade_failed
    tally = lookup.by_kind.get(JobKind.LOOKUP.value) if lookup is not None else None
    failures[(stats.name, "lookup")] = tally.keys_failed if tally else 0
    out["kvtier_tier_queue_depth"][tier] = sum(
        lane.queued_reads + lane.queued_writes + lane.running
        for lane in (io, lookup)
        if lane is not None
    )
    state = getattr(stats, "circuit_state", None)
    if state is not None:
        for name in _BREAKER_STATES:
            out["kvtier_tier_breaker_state"][(stats.name, name)] = float(state == name)
    if stats.used_bytes is not None:
        out["kvtier_tier_used_bytes"][tier] = stats.used_bytes
    if stats.max_bytes is not None:
        out["kvtier_tier_max_bytes"][tier] = stats.max_bytes


def deltas(before: Samples, now: Samples) -> Samples:
    """What changed from ``before`` to ``now``: counters' increments (a series new since
    ``before`` is sent even at 0, so it exists from the first payload; then none where
    nothing changed; a counter that went down, after a restart, counts from zero), gauges'
    values."""
    out: Samples = {}
    for name, values in now.items():
        if _BY_NAME[name].type == "gauge":
            if values:
                out[name] = dict(values)
            continue
        old = before.get(name, {})
        changed = {}
        for labels, value in values.items():
            last = old.get(labels)
            if last is None:
                changed[labels] = value
            elif value != last:
                changed[labels] = value - last if value > last else value
        if changed:
            out[name] = changed
    return out


class CacheCollector:
    """A ``prometheus_client`` collector of a cache's series (see the module docstring).

    ``read`` returns the current `samples`, or None when there is nothing to show (the cache
    was never opened)."""

    def __init__(self, read: Any) -> None:
        self._read = read

    def describe(self) -> Iterator[Any]:
        """The families without samples: registering does not read the cache."""
        return self._families(None)

    def collect(self) -> Iterator[Any]:
        return self._families(self._read())

    def _families(self, values: Samples | None) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for series in SERIES:
            cls = CounterMetricFamily if series.type == "counter" else GaugeMetricFamily
            family = cls(series.name, series.documentation, labels=list(series.labels))
            for labels, value in (values or {}).get(series.name, {}).items():
                family.add_metric(list(labels), value)
            yield family


def summary(stats: Any) -> str:
    """A few lines for a person: ``str(cache.stats())`` (a `kvtier_async.api.CacheStats`)."""
    ledger = stats.ledger
    hit_rate = stats.lookup_hits / stats.lookups if stats.lookups else 0.0
    lines = [
        f"CPU tier: {ledger.used}/{ledger.capacity} slots used ({ledger.evictable} readable, "
        f"{ledger.writing} writing, {ledger.pinned} pinned); lookups {stats.lookups}, "
        f"hits {stats.lookup_hits} ({hit_rate:.0%})"
    ]
    values = samples(None, stats.tiers, stats.lanes)
    for _, tier in stats.tiers:
        lines.append(_tier_line(tier, values))
    if stats.events_dropped:
        lines.append(f"events dropped (slow listeners): {stats.events_dropped}")
    return "\n".join(lines)


def _tier_line(tier: TierStatistics, values: Samples) -> str:
    def get(name: str, *labels: str) -> float:
        return values[name].get((tier.name, *labels), 0)

    failed = sum(get("kvtier_tier_failures", kind) for kind in ("promote", "cascade", "lookup"))
    line = (
        f"{tier.name} ({tier.kind}): hits {get('kvtier_tier_hits'):.0f}/"
        f"{get('kvtier_tier_lookups'):.0f}, promoted {get('kvtier_tier_promotions'):.0f} "
        f"({_mb(get('kvtier_tier_bytes', 'read'))}), cascaded "
        f"{get('kvtier_tier_cascades'):.0f} ({_mb(get('kvtier_tier_bytes', 'write'))}), "
        f"failed {failed:.0f}, queued {get('kvtier_tier_queue_depth'):.0f}"
    )
    if tier.max_bytes is not None:
        line += f", holds {_mb(tier.used_bytes or 0)} of {_mb(tier.max_bytes)}"
    state = getattr(tier, "circuit_state", None)
    if state is not None:
        line += f", breaker {state}"
    return line


def _mb(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"
