"""Typed, validated configuration.

Every config section is a plain mapping (JSON-shaped, as in vLLM's
``kv_connector_extra_config``) read through a `Section`, which rejects unknown keys and bad
values with a `ConfigError` naming the field (``secondary_tiers[0].root_dir``) and what is
allowed. Nothing here touches the file system or the network.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["ConfigError", "Section"]

T = TypeVar("T")
_MISSING: Any = object()


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Section:
    """Reads one config mapping, field by field, with errors that name the field."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(path, f"must be a mapping (JSON object), got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def allow_only(self, keys: Iterable[str]) -> None:
        allowed = set(keys)
        unknown = sorted(set(self.data) - allowed)
        if unknown:
            raise ConfigError(self.name(unknown[0]), f"unknown key; allowed: {sorted(allowed)}")

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise ConfigError(self.name(key), "is required")
        return value

    def get_int(
        self, key: str, default: Any = _MISSING, *, low: int = 0, high: int | None = None
    ) -> Any:
        value = self._get(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(self.name(key), f"must be an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(self.name(key), f"must be {bound}, got {value}")
        return value

    def get_float(
        self, key: str, default: Any = _MISSING, *, low: float = 0.0, high: float | None = None
    ) -> Any:
        value = self._get(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(self.name(key), f"must be a number, got {value!r}")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(self.name(key), f"must be {bound}, got {value}")
        return float(value)

    def get_bool(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.name(key), f"must be true or false, got {value!r}")
        return value

    def get_str(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        choices: Iterable[str] | None = None,
        allow_empty: bool = False,
    ) -> Any:
        value = self._get(key, default)
        if value is None and default is None:
            return None
        if not isinstance(value, str) or (not value and not allow_empty):
            raise ConfigError(self.name(key), f"must be a non-empty string, got {value!r}")
        if choices is not None and value not in (options := list(choices)):
            raise ConfigError(self.name(key), f"must be one of {options}, got {value!r}")
        return value

    def get_list(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(self.name(key), f"must be a list, got {type(value).__name__}")
        return list(value)
