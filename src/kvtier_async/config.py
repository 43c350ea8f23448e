"""Typed, validated configuration on pydantic.

Every config is a pydantic model (`ConfigModel`: frozen, strict, unknown keys refused) read
from a plain mapping, JSON-shaped as in vLLM's ``kv_connector_extra_config``, by `parse`.
`parse` turns pydantic's errors into one `ConfigError` that names the field by its full path
(``secondary_tiers[1].root_dir``) and says what is allowed. Nothing here touches the file
system or the network.

A validator that checks several fields together raises `ConfigError` itself, naming the field
relative to the model it validates (``"store_config.bucket"``); `parse` puts the model's own
path in front.

Secrets: a field named in `SECRET_FIELDS` (a credential, wherever it appears: a tier config,
vLLM's nested ``store_config``) is a `pydantic.SecretStr`, shown as stars in every repr, and an
error about it names its type only, never its value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["SECRET_FIELDS", "ConfigError", "ConfigModel", "NonEmptyStr", "field_path", "parse"]

SECRET_FIELDS: Final = frozenset({"access_key", "secret_key", "session_token"})

NonEmptyStr = Annotated[str, Field(min_length=1)]

M = TypeVar("M", bound="ConfigModel")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; ``field`` is its path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigModel(BaseModel):
    """The base of every config model: frozen, strict types (no ``"1"`` for 1, no 1 for
    True), and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def field_path(path: str, field: str) -> str:
    """``field`` under ``path``: ``secondary_tiers[1]`` + ``root_dir``."""
    if not path:
        return field
    if not field:
        return path
    return f"{path}{field}" if field.startswith("[") else f"{path}.{field}"


def parse(model: type[M], data: object, path: str = "") -> M:
    """``data`` validated as ``model``; `ConfigError` names the first bad field under
    ``path`` (the place the mapping came from, ``""`` at the top)."""
    if not isinstance(data, Mapping):
        raise ConfigError(path or "config", f"must be a mapping (JSON object), got {_kind(data)}")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise _config_error(model, exc, path) from None
    except ConfigError as exc:  # raised by a validator outside pydantic's wrapping
        raise ConfigError(field_path(path, exc.field), exc.message) from None


def _config_error(model: type[ConfigModel], exc: ValidationError, path: str) -> ConfigError:
    error = exc.errors(include_url=False)[0]
    where = _loc_path(error["loc"])
    ctx = error.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, ConfigError):  # a validator's own: its field is relative to the model
        return ConfigError(field_path(path, field_path(where, cause.field)), cause.message)
    key = next((str(p) for p in reversed(error["loc"]) if isinstance(p, str)), "")
    got = _shown(key, error.get("input"))
    kind = error["type"]
    if kind == "extra_forbidden":
        message = f"unknown key; allowed: {_allowed(model, error['loc'])}"
    elif kind == "missing":
        message = "is required"
    elif kind in ("int_type", "int_parsing", "int_from_float"):
        message = f"must be an integer, got {got}"
    elif kind in ("float_type", "float_parsing"):
        message = f"must be a number, got {got}"
    elif kind == "finite_number":
        message = f"must be a finite number, got {got}"
    elif kind in ("bool_type", "bool_parsing"):
        message = f"must be true or false, got {got}"
    elif kind == "string_type":
        message = f"must be a string, got {got}"
    elif kind == "string_too_short":
        message = f"must be a non-empty string, got {got}"
    elif kind in ("dict_type", "model_type", "model_attributes_type"):
        message = f"must be a mapping (JSON object), got {_kind(error.get('input'))}"
    elif kind in ("list_type", "tuple_type"):
        message = f"must be a list, got {_kind(error.get('input'))}"
    elif kind in ("literal_error", "enum"):
        message = f"must be one of {ctx.get('expected')}, got {got}"
    elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        message = f"must be {_bounds(model, error['loc'], ctx)}, got {got}"
    elif kind == "value_error" and cause is not None:
        message = str(cause)
    else:
        message = f"{error['msg'][:1].lower()}{error['msg'][1:]}, got {got}"
    return ConfigError(field_path(path, where), message)


_TAGS: Final = ("function-", "union[", "tagged-union[")  # pydantic's names in a loc, not ours


def _loc_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(_TAGS):
            out = f"{out}.{part}" if out else part
    return out


def _field_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[Any, Any]:
    """The model holding the last field named in ``loc`` (through nested models, list
    indexes and pydantic's tags skipped) and that field's `FieldInfo`, None if it has none."""
    owner: Any = model
    info: Any = None
    for part in loc:
        if isinstance(part, int) or part.startswith(_TAGS):
            continue
        if info is not None:
            owner = _model_in(info.annotation)
        info = getattr(owner, "model_fields", {}).get(part)
        if info is None:
            break
    return owner, info


def _model_in(annotation: Any) -> Any:
    """The model class inside ``annotation`` (``Sub | None``, ``tuple[Sub, ...]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _allowed(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys allowed beside the unknown one at ``loc``."""
    owner, _ = _field_at(model, loc)
    fields = getattr(owner, "model_fields", {})
    return sorted(info.alias or name for name, info in fields.items())


_LIMITS: Final = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _bounds(model: type[BaseModel], loc: tuple[int | str, ...], ctx: Mapping[str, Any]) -> str:
    """``>= 1``, ``in [0, 20]``: the field's whole allowed range (pydantic's error names only
    the limit crossed)."""
    _, info = _field_at(model, loc)
    limits = {
        op: getattr(meta, op)
        for meta in getattr(info, "metadata", ())
        for op in _LIMITS
        if getattr(meta, op, None) is not None
    }
    limits |= {op: ctx[op] for op in _LIMITS if op in ctx}
    if "ge" in limits and "le" in limits:
        return f"in [{limits['ge']}, {limits['le']}]"
    return " and ".join(f"{_LIMITS[op]} {value}" for op, value in limits.items())


def _kind(value: object) -> str:
    return type(value).__name__


def _shown(key: str, value: Any) -> str:
    """``repr(value)``, or only its type when ``key`` is a secret field."""
    return f"{_kind(value)} (value not shown)" if key in SECRET_FIELDS else repr(value)
