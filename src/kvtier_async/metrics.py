"""Metrics: what the tiers did, as Prometheus series, for `TieredKVCache` and the vLLM connector.

Theory of operation. Nothing here counts anything: every figure is read from what the parts
keep already. Each secondary tier has one counter set (`kvtier_async.ledger.TierCounters`,
the tier's ``counters``) that the tiering ledger, the tier's lanes and the tier feed, each
event once; each tier reports its own state (`TierStatistics`: bytes held of
``max_bytes``, an S3 tier's circuit breaker); the engine its lanes' queues
(`Engine.queue_depths`) and its device lane's copies (`DeviceCounters`); the CPU ledger its
slots (`LedgerStatistics`). `tier_metrics` takes one `TierMetrics` per tier from them, in
tier order: `CacheStats.tiers` holds those. Each series of `SERIES` carries the function
that reads its values from those `Figures`, so a series' name is written once, and
`samples` (``{series name: {label values: value}}``, cumulative since the cache opened) and
`summary` read them and nothing else.

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

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from kvtier_async.ledger import DeviceCounters, LedgerStatistics, TierCounters
    from kvtier_async.tiers.base import SecondaryTier, TierStatistics

__all__ = [
    "ASYNC_API_ONLY",
    "SERIES",
    "CacheCollector",
    "Figures",
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


class Figures(NamedTuple):
    """What the series are read from: the CPU ledger's slots (None: not shown), each tier's
    `TierMetrics`, the device lane's copies (None: the connector, whose copies are vLLM's
    series)."""

    primary: LedgerStatistics | None
    tiers: Sequence[TierMetrics]
    device: DeviceCounters | None


Values = Mapping[tuple[str, ...], float]
"""Label values (in the series' label order) -> value."""


@dataclass(frozen=True)
class Series:
    """One Prometheus series: its name (a counter's exposition adds ``_total``), type, help
    text, label names, and how its values are read from the `Figures`."""

    name: str
    type: Literal["counter", "gauge"]
    documentation: str
    labels: tuple[str, ...]
    read: Callable[[Figures], Values]
    async_api_only: bool = False  # the connector's copies are vLLM's own series


def _tier(
    read: Callable[[TierMetrics], Mapping[tuple[str, ...], float | None]],
) -> Callable[[Figures], Values]:
    """A per-tier series' reader: ``read`` gives one tier's values by the labels after
    ``tier`` (a None value: the tier has no such figure)."""

    def values(figures: Figures) -> Values:
        out: dict[tuple[str, ...], float] = {}
        for t in figures.tiers:
            for labels, value in read(t).items():
                if value is not None:
                    out[(t.name, *labels)] = value
        return out

    return values


def _breaker(t: TierMetrics) -> dict[tuple[str, ...], float | None]:
    state = getattr(t.state, "circuit_state", None)
    return {(name,): None if state is None else float(state == name) for name in _BREAKER}


def _slots(figures: Figures) -> Values:
    p = figures.primary
    if p is None:
        return {}
    return {("free",): p.free, ("evictable",): p.evictable, ("writing",): p.writing,
            ("pinned",): p.pinned}  # fmt: skip


def _device(bytes_: bool) -> Callable[[Figures], Values]:
    def values(figures: Figures) -> Values:
        d = figures.device
        if d is None:
            return {}
        if bytes_:
            return {("store",): d.store_bytes, ("load",): d.load_bytes}
        return {("store",): d.store_seconds, ("load",): d.load_seconds}

    return values


_BREAKER = ("closed", "open", "probing")
_T = ("tier",)
SERIES: tuple[Series, ...] = (
    Series("kvtier_tier_lookups", "counter", "Keys looked up in a secondary tier.", _T,
           _tier(lambda t: {(): t.counts.lookups})),
    Series("kvtier_tier_hits", "counter", "Keys a secondary tier's lookups found.", _T,
           _tier(lambda t: {(): t.counts.hits})),
    Series("kvtier_tier_misses", "counter", "Keys a secondary tier's lookups missed.", _T,
           _tier(lambda t: {(): t.counts.misses})),
    Series("kvtier_tier_promotions", "counter",
           "Blocks promoted from a secondary tier into the CPU tier.", _T,
           _tier(lambda t: {(): t.counts.promoted})),
    Series("kvtier_tier_cascades", "counter",
           "Blocks cascaded from the CPU tier into a secondary tier.", _T,
           _tier(lambda t: {(): t.counts.cascaded})),
    Series("kvtier_tier_bytes", "counter",
           "Bytes a secondary tier moved: direction read (promotions) or write (cascades).",
           ("tier", "direction"),
           _tier(lambda t: {("read",): t.counts.bytes_read, ("write",): t.counts.bytes_written})),
    Series("kvtier_tier_seconds", "counter",
           "Seconds of job run time in a secondary tier, summed over its workers: direction "
           "read (promotions), write (cascades) or lookup.",
           ("tier", "direction"),
           _tier(lambda t: {("read",): t.counts.read_seconds,
                            ("write",): t.counts.write_seconds,
                            ("lookup",): t.counts.lookup_seconds})),
    Series("kvtier_tier_failures", "counter",
           "Keys a secondary tier failed, by kind: promote, cascade, or lookup (a lookup job "
           "that failed whole; a key not found is a miss).",
           ("tier", "kind"),
           _tier(lambda t: {("promote",): t.counts.promote_failed,
                            ("cascade",): t.counts.cascade_failed,
                            ("lookup",): t.counts.lookup_failed})),
    Series("kvtier_tier_queue_depth", "gauge",
           "Jobs queued or running in a secondary tier's lanes.", _T,
           _tier(lambda t: {(): t.queue_depth})),
    Series("kvtier_tier_breaker_state", "gauge",
           "1 for the state a tier's circuit breaker is in (closed, open, probing), 0 for the "
           "others; tiers with a breaker only (obj).",
           ("tier", "state"), _tier(_breaker)),
    Series("kvtier_tier_used_bytes", "gauge",
           "Bytes a secondary tier holds, where it keeps count (fs with max_bytes, memory).",
           _T, _tier(lambda t: {(): t.state.used_bytes})),
    Series("kvtier_tier_max_bytes", "gauge", "A secondary tier's capacity, where it has one.",
           _T, _tier(lambda t: {(): t.state.max_bytes})),
    Series("kvtier_cpu_slots", "gauge",
           "CPU tier slots by state: free, evictable (readable), writing, pinned (being read).",
           ("state",), _slots),
    Series("kvtier_device_bytes", "counter",
           "Bytes copied between the caller's blocks and the CPU tier: direction store or load "
           "(async API; the vLLM connector reports vllm:kv_offload_store_bytes / _load_bytes).",
           ("direction",), _device(bytes_=True), async_api_only=True),
    Series("kvtier_device_seconds", "counter",
           "Seconds of copy time between the caller's blocks and the CPU tier, by direction "
           "(async API).",
           ("direction",), _device(bytes_=False), async_api_only=True),
)  # fmt: skip
_BY_NAME = {s.name: s for s in SERIES}
ASYNC_API_ONLY = frozenset(s.name for s in SERIES if s.async_api_only)
"""Series only `TieredKVCache` has (the connector's copies are vLLM's own series)."""


@dataclass(frozen=True)
class TierMetrics:
    """One secondary tier's figures, read once: what `CacheStats.tiers` holds, and what
    `samples` and `summary` read. ``counts`` is a snapshot of the tier's one counter set;
    ``state`` is the tier's own report (`TierStatistics`; a kind's subclass adds its fields,
    such as the obj tier's ``circuit_state``)."""

    name: str
    kind: str
    counts: TierCounters
    queue_depth: int  # jobs queued or running in the tier's lanes
    state: TierStatistics


def tier_metrics(tiers: Sequence[SecondaryTier], queue_depths: Sequence[int]) -> list[TierMetrics]:
    """One `TierMetrics` per tier: its counters (a snapshot), the jobs in its lanes (the
    engine's `queue_depths`, in tier order; none when the engine is not running) and its
    own statistics."""
    depths = list(queue_depths) or [0] * len(tiers)
    return [
        TierMetrics(tier.name, tier.kind, tier.counters.copy(), depth, tier.statistics())
        for tier, depth in zip(tiers, depths, strict=True)
    ]


def samples(
    primary: LedgerStatistics | None,
    tiers: Sequence[TierMetrics],
    device: DeviceCounters | None,
) -> Samples:
    """Every series' values now (see `Figures`)."""
    figures = Figures(primary, tiers, device)
    return {s.name: dict(s.read(figures)) for s in SERIES}


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
    c = t.counts
    line = (
        f"{t.name} ({t.kind}): hits {c.hits}/{c.lookups}, promoted {c.promoted} "
        f"({_mb(c.bytes_read)}), cascaded {c.cascaded} ({_mb(c.bytes_written)}), "
        f"failed {c.failed}, queued {t.queue_depth}"
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
