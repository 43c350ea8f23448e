"""The connector's configuration: vLLM's ``kv_connector_extra_config``, validated.

The shape is vLLM's own OffloadingConnector's, so switching connectors changes two fields
(``kv_connector`` and ``kv_connector_module_path``). Keys of vLLM's that have no meaning here
are accepted and ignored (logged once); any other unknown key is an error naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier_async._log import get_logger
from kvtier_async.config import ConfigError, Section, config_mappings
from kvtier_async.ledger import check_policy

__all__ = ["ConnectorConfig"]

log = get_logger(__name__)

SPECS = ("TieringOffloadingSpec", "CPUOffloadingSpec")
_OURS = (
    "store_policy",
    "instance_id",
    "region_dir",
    "queue_depth",
    "wait_timeout_s",
    "close_timeout_s",
    "worker_copies",
)
_VLLM = (
    "spec_name",
    "cpu_bytes_to_use",
    "block_size",
    "eviction_policy",
    "secondary_tiers",
    "offload_prompt_only",
    "store_threshold",
    "max_tracker_size",
    "cache_policy_module_path",
    "sync_load_budget_bytes",
)
_VLLM_IGNORED = (
    "spec_module_path",
    "blocks_per_chunk",
    "canonical_layout",
    "tier_poll_interval_s",
    "backpressure",
)


@dataclass(frozen=True)
class ConnectorConfig:
    spec_name: str
    cpu_bytes_to_use: int
    block_size: int | None
    eviction_policy: str
    secondary_tiers: tuple[Mapping[str, Any], ...]
    offload_prompt_only: bool
    store_threshold: int
    max_tracker_size: int
    sync_load_budget_bytes: int
    store_policy: str
    instance_id: str | None
    region_dir: str
    queue_depth: int
    wait_timeout_s: float
    close_timeout_s: float
    worker_copies: str

    def __post_init__(self) -> None:  # a read-only copy whose repr hides credentials
        object.__setattr__(self, "secondary_tiers", config_mappings(self.secondary_tiers))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        s = Section(extra or {}, "kv_connector_extra_config")
        s.allow_only((*_VLLM, *_VLLM_IGNORED, *_OURS))
        ignored = sorted(set(s.data) & set(_VLLM_IGNORED))
        if ignored:
            log.info("ignoring vLLM offloading keys that have no meaning here", keys=ignored)
        spec = s.get_str("spec_name", "TieringOffloadingSpec", choices=SPECS)
        tiers = tuple(s.get_list("secondary_tiers", []))
        if spec == "CPUOffloadingSpec" and tiers:
            raise ConfigError(
                s.name("secondary_tiers"),
                "CPUOffloadingSpec has no secondary tiers; use TieringOffloadingSpec",
            )
        policy = s.get_str("eviction_policy", "lru")
        module = s.get_str("cache_policy_module_path", None)
        chosen = module if module and policy not in ("lru", "arc", "prefix") else policy
        try:
            check_policy(chosen)
        except ValueError as exc:
            field = "cache_policy_module_path" if chosen is module else "eviction_policy"
            raise ConfigError(s.name(field), str(exc)) from exc
        return cls(
            spec_name=spec,
            cpu_bytes_to_use=s.get_int("cpu_bytes_to_use", low=1),
            block_size=s.get_int("block_size", None, low=1),
            eviction_policy=chosen,
            secondary_tiers=tiers,
            offload_prompt_only=s.get_bool("offload_prompt_only", True),
            store_threshold=max(1, s.get_int("store_threshold", 1)),
            max_tracker_size=s.get_int("max_tracker_size", 64_000, low=1),
            sync_load_budget_bytes=s.get_int("sync_load_budget_bytes", 0, low=0),
            store_policy=s.get_str(
                "store_policy", "block_level", choices=("block_level", "request_level")
            ),
            instance_id=s.get_str("instance_id", None),
            region_dir=s.get_str("region_dir", "/dev/shm"),
            queue_depth=s.get_int("queue_depth", 1024, low=1),
            wait_timeout_s=s.get_float("wait_timeout_s", 60.0, low=0.001),
            close_timeout_s=s.get_float("close_timeout_s", 30.0, low=0.0, high=86400.0),
            worker_copies=s.get_str("worker_copies", "auto", choices=("auto", "engine", "inline")),
        )
