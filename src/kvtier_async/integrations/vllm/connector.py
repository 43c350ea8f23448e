"""`KVTierConnector`: vLLM's KV-connector interface (0.32 and 0.33) over the kvtier engine.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier_async.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv"}]}}'

The scheduler role (`ConnectorScheduler`) and the worker role (`ConnectorWorker`) live in
different processes and talk only through `KVTierMetadata` / `KVTierWorkerMetadata`.

Stats and metrics follow vLLM's OffloadingConnector (`.metrics`): each role's
``get_kv_connector_stats`` returns vLLM's `OffloadingConnectorStats`, and
``build_prom_metrics`` registers vLLM's offloading series plus ours. KV events (``take_events``,
when vLLM publishes them) go through vLLM's own translation (`.events`).
"""

from __future__ import annotations

from collections.abc import Iterable
from time import monotonic
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

from ._compat import log_missing_features
from .config import ConnectorConfig
from .events import VllmEvents
from .metadata import KVTierMetadata, KVTierWorkerMetadata
from .metrics import KVTierPromMetrics, SchedulerMetrics
from .scheduler import ConnectorScheduler
from .worker import ConnectorWorker

__all__ = ["KVTierConnector"]


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_missing_features()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        config = ConnectorConfig.from_extra_config(extra)
        events = getattr(vllm_config, "kv_events_config", None)
        self._publish_events = bool(getattr(events, "enable_kv_cache_events", False))
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._pending_flush: set[int] = set()
        self._events = VllmEvents()
        self.metrics: SchedulerMetrics | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(vllm_config, kv_cache_config, config)
            # As vLLM's manager: with KV events off, none is recorded (nobody takes them).
            self._scheduler.ledger.events_enabled = self._publish_events
            max_model_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
            self.metrics = SchedulerMetrics(self._scheduler, max_model_len)
        else:
            self._worker = ConnectorWorker(vllm_config, kv_cache_config, config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    @property
    def scheduler(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "called on the worker role"
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        assert self._worker is not None, "called on the scheduler role"
        return self._worker

    # --- worker role ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVTierMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        return self._worker.build_connector_worker_meta() if self._worker is not None else None

    # --- scheduler role ---------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        metrics = self.metrics
        assert metrics is not None, "called on the worker role"
        started = monotonic()
        answer = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        metrics.lookup_done(request.request_id, started, answer[0])
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = self.scheduler.build_connector_meta(scheduler_output)
        if self._pending_flush:
            meta.jobs_to_flush |= self._pending_flush
            self._pending_flush = set()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.metrics is not None:
            self.metrics.request_finished(request.request_id)
        return self.scheduler.request_finished(request)

    def take_events(self) -> Iterable[Any]:
        if not self._publish_events:
            return ()  # KV events are off in vLLM: the ledger records none
        return self._events.translate(self.scheduler.take_events())

    # --- stats and metrics ------------------------------------------------------------

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """Worker role: this worker's copies since the last call; scheduler role: its
        observations and our series (see `.metrics`). vLLM aggregates them."""
        if self.metrics is not None:
            return self.metrics.take()
        return self.worker.metrics.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> OffloadingConnectorStats | None:
        return OffloadingConnectorStats() if data is None else OffloadingConnectorStats(data=data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def reset_cache(self) -> bool | None:
        flush = self.scheduler.reset_cache()
        if flush is None:
            return False  # a tier job would not end in time: nothing was reset
        self._pending_flush |= flush
        return True

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
