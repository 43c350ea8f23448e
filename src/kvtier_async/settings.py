"""The one config model of both faces: `CommonConfig` and the async API's `CacheConfig`.

`CommonConfig` holds every field the async API (`CacheConfig`) and the vLLM connector
(`kvtier_async.integrations.vllm.ConnectorConfig`) share, each with one default; each face
adds only what is its own (the async API's ``block_bytes`` and ``num_slots``, vLLM's
``cpu_bytes_to_use`` and ``block_size``...). Both are pydantic models (`ConfigModel`): read a
mapping with `from_dict` / `ConnectorConfig.from_extra_config`, and a bad field fails with a
`ConfigError` naming its path (``secondary_tiers[1].root_dir``) and what is allowed.

Built directly (``CacheConfig(block_bytes=65536, num_slots=1024)``, typed for mypy through
pydantic's plugin), a bad value raises pydantic's ``ValidationError`` (a ValueError too),
which names the field as well.

``secondary_tiers`` entries are validated with the rest, each by its kind's model
(`kvtier_async.tiers.base.tier_config`), so a bad tier field fails at once, not when the
cache opens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from kvtier_async import defaults
from kvtier_async.config import ConfigError, ConfigModel, NonEmptyStr, field_path, parse
from kvtier_async.ledger import check_policy
from kvtier_async.ledger.tiering import StorePolicy
from kvtier_async.tiers.base import TierConfig, tier_config

__all__ = ["CacheConfig", "CommonConfig"]


class CommonConfig(ConfigModel):
    """The fields both faces share.

    - ``eviction_policy``: the CPU tier's policy: ``lru``, ``arc``, ``prefix``, ``reuse``,
      ``sieve``, ``s3fifo``, ``tinylfu``, ``adaptive`` or ``package.module:ClassName``.
    - ``store_threshold``: how many times a block is seen before it is stored (0 and 1 both
      mean the first time, as in vLLM).
    - ``max_tracker_size``: how many blocks the store-threshold tracker remembers.
    - ``store_policy``: ``block_level`` (cascade the blocks a request stored) or
      ``request_level`` (its hit blocks too).
    - ``secondary_tiers``: the tiers below the CPU tier, in order (``{"type": "fs", ...}``).
    - ``instance_id``: names the shared CPU region; one live cache per id. None: the async
      API makes one per cache, the connector takes vLLM's engine id.
    - ``region_dir``: where the CPU region's file lives (a tmpfs).
    - ``queue_depth``: how many jobs may wait in each engine lane.
    - ``close_timeout_s``: how long a clean close drains before it cancels.
    """

    TIERS_AT: ClassVar[str] = "secondary_tiers"  # the tiers' path, for their messages

    eviction_policy: NonEmptyStr = defaults.EVICTION_POLICY
    store_threshold: int = Field(defaults.STORE_THRESHOLD, ge=0)
    max_tracker_size: int = Field(defaults.MAX_TRACKER_SIZE, ge=1)
    store_policy: Annotated[StorePolicy, Field(strict=False)] = StorePolicy.BLOCK_LEVEL
    secondary_tiers: tuple[TierConfig, ...] = ()
    instance_id: NonEmptyStr | None = None
    region_dir: NonEmptyStr = defaults.REGION_DIR
    queue_depth: int = Field(defaults.QUEUE_DEPTH, ge=1, le=1 << 20)
    close_timeout_s: float = Field(
        defaults.CLOSE_TIMEOUT_S, ge=0.0, le=86400.0, allow_inf_nan=False
    )

    @field_validator("eviction_policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        return check_policy(value)  # a bad name or module fails here, named

    @field_validator("store_threshold")
    @classmethod
    def _at_least_once(cls, value: int) -> int:
        return max(1, value)

    @field_validator("secondary_tiers", mode="before")
    @classmethod
    def _tiers(cls, value: object) -> tuple[TierConfig, ...]:
        if not isinstance(value, (list, tuple)):
            raise ConfigError("", f"must be a list, got {type(value).__name__}")
        tiers: list[TierConfig] = []
        for i, entry in enumerate(value):
            tier = entry if isinstance(entry, TierConfig) else tier_config(entry, f"[{i}]")
            tiers.append(tier.at(field_path(cls.TIERS_AT, f"[{i}]")))
        return tuple(tiers)


class CacheConfig(CommonConfig):
    """Validated configuration of a `kvtier_async.TieredKVCache`: the `CommonConfig` fields
    and

    - ``block_bytes`` (required): the bytes of one block;
    - ``num_slots`` or ``cpu_bytes_to_use`` (exactly one): the CPU tier's size, in blocks or
      in bytes;
    - ``device_workers``: copies between device and CPU memory at once;
    - ``model``: the model name, part of every stored block's namespace.
    """

    block_bytes: int = Field(ge=1)
    num_slots: int = Field(0, ge=1, validate_default=False)  # 0: from cpu_bytes_to_use
    cpu_bytes_to_use: int | None = Field(None, ge=1)
    device_workers: int = Field(defaults.DEVICE_WORKERS, ge=1, le=64)
    model: NonEmptyStr = "kvtier-demo"

    @model_validator(mode="after")
    def _size(self) -> CacheConfig:
        by_bytes = self.cpu_bytes_to_use is not None
        if by_bytes == ("num_slots" in self.model_fields_set):
            raise ConfigError(
                "cpu_bytes_to_use", "give exactly one of cpu_bytes_to_use or num_slots"
            )
        if self.cpu_bytes_to_use is not None:  # (by_bytes, spelled for mypy)
            if self.cpu_bytes_to_use < self.block_bytes:
                got = self.cpu_bytes_to_use
                raise ConfigError(
                    "cpu_bytes_to_use", f"must be >= block_bytes ({self.block_bytes}), got {got}"
                )
            self.__dict__["num_slots"] = self.cpu_bytes_to_use // self.block_bytes
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheConfig:
        """``data`` validated; `ConfigError` names the first bad field."""
        return parse(cls, data)
