"""The connector's stats and Prometheus metrics, in vLLM 0.33's shapes and names.

How vLLM moves connector stats: each worker's ``get_kv_connector_stats`` result rides on its
``KVConnectorOutput``; vLLM's ``KVOutputAggregator`` aggregates the workers' (``aggregate``),
the scheduler's ``update_from_output`` aggregates in the scheduler role's
``get_kv_connector_stats``, and the payload (``to_dict``) reaches the frontend, where the
connector class's ``build_prom_metrics`` object turns it into Prometheus series (and
``build_kv_connector_stats`` rebuilds it for the log line).

The payload is vLLM's `OffloadingConnectorStats` (counters summed, gauges last, histogram
samples listed, the config info once), so what both connectors do reads the same:

- the workers (`WorkerMetrics`): ``vllm:kv_offload_load_bytes`` / ``_load_time`` /
  ``_load_size`` and ``vllm:kv_offload_store_*``, per GPU<->CPU copy job, as vLLM's
  OffloadingConnector worker records them;
- the scheduler (`SchedulerMetrics`): ``vllm:kv_offload_lookup_sync_delay_seconds`` (one
  ``get_num_new_matched_tokens``), ``..._lookup_async_delay_seconds`` (from a request's first
  deferred lookup to the one that answered, or to its end), ``vllm:kv_offload_allocation_failure``
  (a store the CPU tier had no room for), the CPU tier's usage gauges
  (``vllm:kv_offload_cpu_cache_usage_perc``, ``_write_usage_perc``, ``_read_usage_perc``) and
  ``vllm:kv_offload_config_info`` with the CPU offloading spec's labels (vLLM 0.33 and later:
  0.32 has no such series, see `._compat`); plus our per-tier
  series (`kvtier_async.metrics.SERIES`), whose counters are sent as increments since the
  last payload.

`KVTierPromMetrics` is vLLM's `OffloadPromMetrics` for the CPU offloading spec (so the shared
series, deprecated ones included, have vLLM's names, help, labels and buckets) with our
series added to its definitions.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadPromMetrics,
    _ConnectorMetricName,
    _MetricType,
    _TransferMetricName,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvtier_async.metrics import ASYNC_API_ONLY, SERIES, Samples, deltas, samples

from ._compat import HAS_CONFIG_INFO, CPUOffloadingInfo, metric_sections
from .layout import OffloadLayout

if TYPE_CHECKING:
    from .scheduler import ConnectorScheduler

__all__ = ["KVTierPromMetrics", "SchedulerMetrics", "WorkerMetrics"]


class WorkerMetrics:
    """A worker's GPU<->CPU copies since the last payload."""

    def __init__(self) -> None:
        self._stats = OffloadingConnectorStats()

    def record(self, is_store: bool, nbytes: int, seconds: float) -> None:
        """One copy job ended well: ``nbytes`` moved in ``seconds``."""
        names = _TransferMetricName
        stats = self._stats
        stats.increase_counter(names.STORE_BYTES if is_store else names.LOAD_BYTES, nbytes)
        stats.increase_counter(names.STORE_TIME if is_store else names.LOAD_TIME, seconds)
        stats.observe_histogram(names.STORE_SIZE if is_store else names.LOAD_SIZE, nbytes)

    def take(self) -> OffloadingConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats


class SchedulerMetrics:
    """The scheduler role's observations, and its series read from the ledger and tiers.

    vLLM asks for stats every step; reading every tier's figures costs tens of
    microseconds, so the series are read at most every ``series_interval_s`` (counters are
    sent as increments: nothing is lost, a scrape sees them that much later)."""

    series_interval_s = 1.0

    def __init__(self, scheduler: ConnectorScheduler, max_model_len: int) -> None:
        self._scheduler = scheduler
        self._info = config_info(scheduler.layout, max_model_len)
        self._stats = OffloadingConnectorStats()
        self._sync_delays: list[float] = []  # lookup sync delays since the last payload
        self._deferred: dict[str, float] = {}  # request -> when its first lookup deferred
        self._sent: Samples = {}
        self._allocation_failures = 0
        self._info_sent = self._info is None  # nothing to send on a vLLM without it
        self._series_due = 0.0  # time.monotonic() from which the series are read again

    def lookup_done(self, req_id: str, started: float, hit_tokens: int | None) -> None:
        """A ``get_num_new_matched_tokens`` call that began at ``started`` (its
        ``time.monotonic()``) answered ``hit_tokens`` (None: ask again). Called per lookup:
        the sample joins the payload at `take`."""
        now = time.monotonic()
        self._sync_delays.append(now - started)
        if hit_tokens is None:
            self._deferred.setdefault(req_id, started)
        elif self._deferred:
            self._async_done(req_id, now)

    def request_finished(self, req_id: str) -> None:
        if self._deferred:
            self._async_done(req_id, time.monotonic())

    def _async_done(self, req_id: str, now: float) -> None:
        started = self._deferred.pop(req_id, None)
        if started is not None:
            self._stats.observe_histogram(_ConnectorMetricName.LOOKUP_ASYNC_DELAY, now - started)

    def take(self) -> OffloadingConnectorStats | None:
        """The payload for this step: what was observed since the last one, the config info
        the first time, and (every ``series_interval_s``) our series' increments and gauges
        and the CPU tier's usage; None when there is none of it."""
        failures = self._scheduler.store_allocation_failures
        clock = time.monotonic()
        series = clock >= self._series_due
        delays = self._sync_delays
        due = delays or series or failures > self._allocation_failures or not self._info_sent
        if not due and self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OffloadingConnectorStats()
        if delays:  # observe_histogram's effect, for all of them at once
            self._sync_delays = []
            types, values = metric_sections(stats)
            name = _ConnectorMetricName.LOOKUP_SYNC_DELAY
            types.setdefault(name, _MetricType.HISTOGRAM)
            values.setdefault(name, {}).setdefault((), []).extend(delays)
        if failures > self._allocation_failures:
            stats.increase_counter(
                _ConnectorMetricName.ALLOCATION_FAILURE, failures - self._allocation_failures
            )
            self._allocation_failures = failures
        if not self._info_sent:
            assert self._info is not None
            stats.set_info([self._info])
            self._info_sent = True
        if series:
            self._series_due = clock + self.series_interval_s
            self._add_series(stats)
        return stats

    def _add_series(self, stats: OffloadingConnectorStats) -> None:
        primary, tiers = self._scheduler.statistics()
        now = samples(primary, tiers, None)
        for name, values in deltas(self._sent, now).items():
            gauge = _TYPES[name] == "gauge"
            for labels, value in values.items():
                if gauge:
                    stats.set_gauge(name, value, labels)
                else:
                    stats.increase_counter(name, value, labels)
        self._sent = now
        capacity = primary.capacity or 1
        stats.set_gauge(
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, (primary.writing + primary.pinned) / capacity
        )
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, primary.writing / capacity)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, primary.pinned / capacity)


_TYPES = {s.name: s.type for s in SERIES}


def config_info(layout: OffloadLayout, max_model_len: int) -> dict[str, Any] | None:
    """The CPU offloading spec's config info labels (`CPUOffloadingInfo`), for our CPU
    tier: slots, GPU blocks per slot, bytes (every worker's rows), and the tokens it holds
    for requests of ``max_model_len`` tokens (None when that is unknown), as vLLM computes
    them. None on a vLLM without the config-info series (0.32)."""
    if not HAS_CONFIG_INFO:
        return None
    groups = len(layout.groups)
    tokens: int | None = None
    if max_model_len > 0 and groups:
        per_request = groups * -(-max_model_len // layout.chunk_tokens)
        tokens = layout.num_slots * max_model_len // per_request
    info = CPUOffloadingInfo(
        cpu_num_chunks=layout.num_slots,
        cpu_blocks_per_chunk=layout.factor,
        cpu_kv_cache_size_bytes=layout.num_slots * layout.block_span_bytes,
        cpu_kv_cache_size_tokens=tokens,
    )
    return dict(info.as_config_info())


class KVTierPromMetrics(OffloadPromMetrics):
    """vLLM's offloading Prometheus metrics (CPU offloading spec) plus our series."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        # vLLM's class picks the spec whose series it defines from the extra config: ours
        # are the CPU offloading spec's (what our CPU tier is), whatever spec_name says.
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        extra["spec_name"] = "CPUOffloadingSpec"
        view: Any = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)
        )
        super().__init__(view, metric_types, labelnames, per_engine_labelvalues)
        self._kv_transfer_config = transfer
        for series in SERIES:
            if series.name in ASYNC_API_ONLY:
                continue
            cls = OffloadingCounterMetadata if series.type == "counter" else OffloadingGaugeMetadata
            metadata = cls(documentation=series.documentation, labelnames=series.labels)
            self._offloading_metric_metadata[series.name] = metadata
            self._offloading_metric_defs[series.name] = self._create_metric(series.name, metadata)
