"""Metrics: what the tiers did, as Prometheus series, for `TieredKVCache` and the vLLM connector.

Theory of operation. Nothing here counts anything: every figure is read from counters the
parts keep already. The tiering ledger counts, per secondary tier, the keys looked up and hit,
blocks promoted and cascaded and the keys that failed (`TierCounters`); each engine lane
tallies its jobs by kind, with bytes and seconds of run time (`LaneStatistics.by_kind`) and
its queue; each tier reports its own state (`TierStatistics`: bytes held of ``max_bytes``,
an S3 tier's circuit breaker); the CPU ledger its slots (`LedgerStatistics`).
`tier_metrics` joins the first three into one `TierMetrics` per tier, the one place they
meet: `CacheStats.tiers` holds those, and `samples` (the series `SERIES` lists, as
``{series name: {label values: value}}``, cumulative since the cache opened) and `summary`
read them and nothing else.

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

from collections.abc import Iterator, Sequence
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
    "TierMetrics",
    "deltas",
    "samples",
    "summary",
    "tier_metrics",
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


@dataclass(frozen=True)
class TierMetrics:
    """Every figure of one secondary tier, read once from the three parts that keep them
    (see the module docstring): what `CacheStats.tiers` holds, and what `samples` and
    `summary` read. ``state`` is the tier's own report (`TierStatistics`; a kind's subclass
    adds its fields, such as the obj tier's ``circuit_state``)."""

    name: str
    kind: str
    lookups: int  # keys looked up (the ledger's count)
    hits: int
    promoted: int  # blocks, into the CPU tier
    cascaded: int  # blocks, from the CPU tier
    promote_failed: int  # keys
    cascade_failed: int  # keys
    lookup_failed: int  # keys of lookup jobs that failed whole
    bytes_read: int  # promotions' bytes
    bytes_written: int  # cascades' bytes
    read_seconds: float  # job run time, summed over the tier's workers
    write_seconds: float
    lookup_seconds: float
    queue_depth: int  # jobs queued or running in the tier's lanes
    gbps: float  # bytes moved per second of I/O job run time, both directions, GB/s
    state: TierStatistics

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def failed(self) -> int:
        return self.promote_failed + self.cascade_failed + self.lookup_failed


def tier_metrics(
    tiers: Sequence[tuple[TierCounters, TierStatistics]], lanes: Sequence[LaneStatistics]
) -> list[TierMetrics]:
    """One `TierMetrics` per tier, from the ledger's counters and the tier's statistics
    (in tier order) and the engine's lanes (a tier's are named ``NAME`` for its I/O and
    ``NAME:lookup`` for its lookups): the one place they are joined."""
    by_lane = {lane.name: lane for lane in lanes}
    out = []
    for counters, stats in tiers:
        io, lookup = by_lane.get(stats.name), by_lane.get(f"{stats.name}:lookup")
        read = io.by_kind.get(JobKind.PROMOTE.value) if io is not None else None
        write = io.by_kind.get(JobKind.CASCADE.value) if io is not None else None
        asked = lookup.by_kind.get(JobKind.LOOKUP.value) if lookup is not None else None
        out.append(
            TierMetrics(
                name=stats.name,
                kind=stats.kind,
                lookups=counters.lookups,
                hits=counters.lookup_hits,
                promoted=counters.promoted,
                cascaded=counters.cascaded,
                promote_failed=counters.promote_failed,
                cascade_failed=counters.cascade_failed,
                lookup_failed=asked.keys_failed if asked else 0,
                bytes_read=read.bytes if read else 0,
                bytes_written=write.bytes if write else 0,
                read_seconds=read.seconds if read else 0.0,
                write_seconds=write.seconds if write else 0.0,
                lookup_seconds=asked.seconds if asked else 0.0,
                queue_depth=sum(
                    lane.queued_reads + lane.queued_writes + lane.running
                    for lane in (io, lookup)
                    if lane is not None
                ),
                gbps=io.gbps if io is not None else 0.0,
                state=stats,
            )
        )
    return out


def samples(
    primary: LedgerStatistics | None,
    tiers: Sequence[TierMetrics],
    lanes: Sequence[LaneStatistics],
) -> Samples:
    """Every series' values now, from the CPU ledger's slots (None: not shown), each tier's
    `TierMetrics` and the engine's ``device`` lane (the copies to and from the caller)."""
    out: Samples = {s.name: {} for s in SERIES}
    for tier in tiers:
        _tier_samples(out, tier)
    if primary is not None:
        slots = out["kvtier_cpu_slots"]
        slots[("free",)] = primary.free
        slots[("evictable",)] = primary.evictable
        slots[("writing",)] = primary.writing
        slots[("pinned",)] = primary.pinned
    device = next((lane for lane in lanes if lane.name == "device"), None)
    if device is not None:
        for direction in ("store", "load"):
            tally = device.by_kind.get(direction)
            if tally is not None:
                out["kvtier_device_bytes"][(direction,)] = tally.bytes
                out["kvtier_device_seconds"][(direction,)] = tally.seconds
    return out


def _tier_samples(out: Samples, t: TierMetrics) -> None:
    tier = (t.name,)
    out["kvtier_tier_lookups"][tier] = t.lookups
    out["kvtier_tier_hits"][tier] = t.hits
    out["kvtier_tier_misses"][tier] = t.misses
    out["kvtier_tier_promotions"][tier] = t.promoted
    out["kvtier_tier_cascades"][tier] = t.cascaded
    out["kvtier_tier_bytes"][(t.name, "read")] = t.bytes_read
    out["kvtier_tier_bytes"][(t.name, "write")] = t.bytes_written
    out["kvtier_tier_seconds"][(t.name, "read")] = t.read_seconds
    out["kvtier_tier_seconds"][(t.name, "write")] = t.write_seconds
    out["kvtier_tier_seconds"][(t.name, "lookup")] = t.lookup_seconds
    failures = out["kvtier_tier_failures"]
    failures[(t.name, "promote")] = t.promote_failed
    failures[(t.name, "cascade")] = t.cascade_failed
    failures[(t.name, "lookup")] = t.lookup_failed
    out["kvtier_tier_queue_depth"][tier] = t.queue_depth
    state = getattr(t.state, "circuit_state", None)
    if state is not None:
        for name in _BREAKER_STATES:
            out["kvtier_tier_breaker_state"][(t.name, name)] = float(state == name)
    if t.state.used_bytes is not None:
        out["kvtier_tier_used_bytes"][tier] = t.state.used_bytes
    if t.state.max_bytes is not None:
        out["kvtier_tier_max_bytes"][tier] = t.state.max_bytes


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
    lines += [_tier_line(tier) for tier in stats.tiers]
    if stats.events_dropped:
        lines.append(f"events dropped (slow listeners): {stats.events_dropped}")
    return "\n".join(lines)


def _tier_line(t: TierMetrics) -> str:
    line = (
        f"{t.name} ({t.kind}): hits {t.hits}/{t.lookups}, promoted {t.promoted} "
        f"({_mb(t.bytes_read)}), cascaded {t.cascaded} ({_mb(t.bytes_written)}), "
        f"failed {t.failed}, queued {t.queue_depth}"
    )
    if t.state.max_bytes is not None:
        line += f", holds {_mb(t.state.used_bytes or 0)} of {_mb(t.state.max_bytes)}"
    state = getattr(t.state, "circuit_state", None)
    if state is not None:
        line += f", breaker {state}"
    return line


def _mb(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"
