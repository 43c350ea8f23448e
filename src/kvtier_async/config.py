"""Typed, validated configuration.

Every config section is a plain mapping (JSON-shaped, as in vLLM's
``kv_connector_extra_config``) read through a `Section`, which rejects unknown keys and bad
values with a `ConfigError` naming the field (``secondary_tiers[0].root_dir``) and what is
allowed. Nothing here touches the file system or the network.

Secrets: a field named in `SECRET_FIELDS` (a credential, wherever it appears: a tier config,
vLLM's nested ``store_config``) never has its value echoed: an error about it names its type
only, and a `ConfigMapping` (the read-only copy a validated config keeps of a raw section,
such as one entry of ``secondary_tiers``) shows it as ``'***'`` in its repr.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final, TypeVar

__all__ = ["SECRET_FIELDS", "ConfigError", "ConfigMapping", "Section", "config_mappings"]

SECRET_FIELDS: Final = frozenset({"access_key", "secret_key", "session_token"})

T = TypeVar("T")
_MISSING: Any = object()


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ConfigMapping(Mapping[str, Any]):
    """A read-only copy of a config mapping (nested mappings too) whose repr and str show
    every `SECRET_FIELDS` value as ``'***'``."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = {
            key: ConfigMapping(value) if isinstance(value, Mapping) else value
            for key, value in data.items()
        }

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        shown = {k: "***" if k in SECRET_FIELDS and v else v for k, v in self._data.items()}
        return repr(shown)


def config_mappings(values: Iterable[Any]) -> tuple[Any, ...]:
    """``values`` with every mapping among them as a `ConfigMapping` (others as they are:
    the reader of each entry reports them)."""
    return tuple(ConfigMapping(v) if isinstance(v, Mapping) else v for v in values)


def _shown(key: str, value: Any) -> str:
    """``repr(value)``, or only its type when ``key`` is a secret field."""
    return f"{type(value).__name__} (value not shown)" if key in SECRET_FIELDS else repr(value)


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
            raise ConfigError(self.name(key), f"must be an integer, got {_shown(key, value)}")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(self.name(key), f"must be {bound}, got {_shown(key, value)}")
        return value

    def get_float(
        self, key: str, default: Any = _MISSING, *, low: float = 0.0, high: float | None = None
    ) -> Any:
        value = self._get(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(self.name(key), f"must be a number, got {_shown(key, value)}")
        if not math.isfinite(value):  # NaN compares false with every bound
            raise ConfigError(self.name(key), f"must be a finite number, got {_shown(key, value)}")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(self.name(key), f"must be {bound}, got {_shown(key, value)}")
        return float(value)

    def get_bool(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.name(key), f"must be true or false, got {_shown(key, value)}")
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
            shown = _shown(key, value)
            raise ConfigError(self.name(key), f"must be a non-empty string, got {shown}")
        if choices is not None and value not in (options := list(choices)):
            raise ConfigError(self.name(key), f"must be one of {options}, got {_shown(key, value)}")
        return value

    def get_list(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(self.name(key), f"must be a list, got {type(value).__name__}")
        return list(value)
