"""The connector's configuration: vLLM's ``kv_connector_extra_config``, validated.

The shape is vLLM's own OffloadingConnector's, so switching connectors changes two fields
(``kv_connector`` and ``kv_connector_module_path``). Keys of vLLM's that have no meaning here
are accepted and ignored (logged once); any other unknown key is an error naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from kvtier_async import defaults
from kvtier_async._log import get_logger
from kvtier_async.config import ConfigError, NonEmptyStr, parse
from kvtier_async.ledger import BUILTIN_POLICIES, check_policy
from kvtier_async.settings import CommonConfig

__all__ = ["ConnectorConfig"]

log = get_logger(__name__)

SPECS = ("TieringOffloadingSpec", "CPUOffloadingSpec")
# vLLM offloading keys that have no meaning here: accepted and ignored (logged once)
_VLLM_IGNORED = (
    "spec_module_path",
    "blocks_per_chunk",
    "canonical_layout",
    "tier_poll_interval_s",
    "backpressure",
)
_BUILTIN: tuple[object, ...] = (*BUILTIN_POLICIES, None)  # None: the default, lru


class ConnectorConfig(CommonConfig):
    """``kv_connector_extra_config`` validated: the `CommonConfig` fields, vLLM's
    OffloadingConnector keys (``spec_name``, ``cpu_bytes_to_use``, ``block_size``,
    ``offload_prompt_only``, ``cache_policy_module_path``,
    ``sync_load_budget_bytes``) and the connector's own (``wait_timeout_s``: how long a
    worker waits on the scheduler's region; ``worker_copies``: ``auto``, ``engine`` or
    ``inline``)."""

    TIERS_AT: ClassVar[str] = "kv_connector_extra_config.secondary_tiers"

    spec_name: Literal["TieringOffloadingSpec", "CPUOffloadingSpec"] = "TieringOffloadingSpec"
    cpu_bytes_to_use: int = Field(ge=1)
    block_size: int | None = Field(None, ge=1)
    offload_prompt_only: bool = True
    cache_policy_module_path: NonEmptyStr | None = None
    sync_load_budget_bytes: int = Field(0, ge=0)
    wait_timeout_s: float = Field(defaults.WAIT_TIMEOUT_S, ge=0.001, allow_inf_nan=False)
    worker_copies: Literal["auto", "engine", "inline"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _vllm_keys(cls, data: Any) -> Any:
        """Drops vLLM's keys that mean nothing here, and takes ``cache_policy_module_path``
        as the policy where ``eviction_policy`` names none of ours (as vLLM does)."""
        if not isinstance(data, Mapping):
            return data
        if ignored := sorted(set(data) & set(_VLLM_IGNORED)):
            log.info("ignoring vLLM offloading keys that have no meaning here", keys=ignored)
        data = {k: v for k, v in data.items() if k not in _VLLM_IGNORED}
        module = data.get("cache_policy_module_path")
        if isinstance(module, str) and module and data.get("eviction_policy") not in _BUILTIN:
            try:
                data["eviction_policy"] = check_policy(module)
            except ValueError as exc:
                raise ConfigError("cache_policy_module_path", str(exc)) from None
        return data

    @model_validator(mode="after")
    def _spec(self) -> ConnectorConfig:
        if self.spec_name == "CPUOffloadingSpec" and self.secondary_tiers:
            raise ConfigError(
                "secondary_tiers",
                "CPUOffloadingSpec has no secondary tiers; use TieringOffloadingSpec",
            )
        return self

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """vLLM's ``kv_connector_extra_config`` validated; `ConfigError` names the first bad
        field (``kv_connector_extra_config.secondary_tiers[0].root_dir``)."""
        return parse(cls, extra or {}, "kv_connector_extra_config")
