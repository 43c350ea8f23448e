"""The obj tier's configuration: `ObjTierConfig` (the schema), `S3Config` (it resolved), `Secret`.

Fields are vLLM's ``ObjStoreConfig`` ones (also accepted nested, as vLLM writes them, under
``"store_config"``, with ``"io_threads"`` for ``max_concurrency``) and ours (``prefix``,
``max_concurrency``, ``timeout_s``, ``lookup_timeout_s``, ``retries``, ``staging_bytes``);
`ConfigError` names a bad field. Empty ``access_key``/``secret_key`` use the standard AWS
credential chain (environment, profile, instance role): the documented way, since hosts log
their configuration (``vllm serve`` logs ``kv_connector_extra_config`` among its non-default
arguments). Credentials given inline are accepted (the tier warns once at ``open``).

*Secrets* are held as `Secret` and never reach a repr, a log line, the statistics, a config
dump (`S3Config.as_dict`) or an error message (`Scrubber` takes them out of texts from
botocore; `kvtier_async.config` never echoes the value of a secret field, even one of the
wrong type). botocore's own DEBUG logging, which the host controls, prints request headers:
the access key id and a session token appear there, as with any boto3 program.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import Field, SecretStr, model_validator

from kvtier_async.config import ConfigError, ConfigModel, NonEmptyStr
from kvtier_async.tiers.base import TierConfig, tier_config

__all__ = [
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_RETRIES",
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_TIMEOUT_S",
    "ObjTierConfig",
    "S3Config",
    "Scrubber",
    "Secret",
    "StoreConfig",
]

DEFAULT_MAX_CONCURRENCY: Final = 16
DEFAULT_TIMEOUT_S: Final = 5.0
DEFAULT_LOOKUP_TIMEOUT_S: Final = 1.0  # at most; never more than timeout_s by default
DEFAULT_RETRIES: Final = 3
DEFAULT_STAGING_BYTES: Final = 128 << 20  # blocks a lookup fetched, kept for the load
_DEFAULT_ENDPOINT_REGION: Final = "us-east-1"


class Secret:
    """A string that never shows itself: ``repr``/``str`` print ``***`` (``''`` when empty)."""

    __slots__ = ("_value",)

    def __init__(self, value: str = "") -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash((Secret, self._value))

    def __str__(self) -> str:
        return "***" if self._value else ""

    def __repr__(self) -> str:
        return f"Secret({str(self)!r})"


_NO_SECRET: Final = Secret()
_EMPTY: Final = SecretStr("")


class Scrubber:
    """Replaces every credential value in a text with ``***``."""

    def __init__(self, *secrets: Secret) -> None:
        values: Iterable[str] = (s.reveal() for s in secrets if s)
        self._values = sorted(set(values), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self._values:
            text = text.replace(value, "***")
        return text

    def describe(self, exc: BaseException) -> str:
        """``Type: message`` with every credential scrubbed out."""
        return self(f"{type(exc).__name__}: {exc}")


class StoreConfig(ConfigModel):
    """vLLM's ``ObjStoreConfig`` fields, nested under ``"store_config"`` as vLLM writes them;
    each one set here must not be set at the tier's top level too."""

    bucket: NonEmptyStr | None = None
    endpoint_override: str | None = None
    access_key: SecretStr | None = None
    secret_key: SecretStr | None = None
    session_token: SecretStr | None = None
    region: str | None = None
    scheme: Literal["http", "https"] | None = None
    ca_bundle: str | None = None


class ObjTierConfig(TierConfig):
    """``{"type": "obj", "bucket": ..., ...}``: vLLM's ``ObjStoreConfig`` fields (flat, or
    nested under ``"store_config"``, with ``"io_threads"`` for ``max_concurrency``) and ours
    (``prefix``, ``max_concurrency``, ``timeout_s``, ``lookup_timeout_s``, ``retries``,
    ``staging_bytes``).
    `S3Config.from_config` resolves it (endpoint, scheme, defaults) for the tier."""

    type: Literal["obj"] = "obj"
    bucket: NonEmptyStr | None = None  # required, here or in store_config
    endpoint_override: str = ""
    access_key: SecretStr = _EMPTY
    secret_key: SecretStr = _EMPTY
    session_token: SecretStr = _EMPTY
    region: str = ""
    scheme: Literal["http", "https"] | None = None  # default: http with an endpoint, else https
    ca_bundle: str = ""
    prefix: str = ""
    max_concurrency: int | None = Field(None, ge=1, le=1024)  # default 16
    io_threads: int | None = Field(None, ge=1, le=1024)  # vLLM's name for max_concurrency
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, ge=0.001, le=3600.0, allow_inf_nan=False)
    lookup_timeout_s: float | None = Field(None, ge=0.001, le=3600.0, allow_inf_nan=False)
    retries: int = Field(DEFAULT_RETRIES, ge=0, le=20)
    staging_bytes: int = Field(DEFAULT_STAGING_BYTES, ge=0, le=1 << 40)
    store_config: StoreConfig | None = None

    @model_validator(mode="after")
    def _resolves(self) -> ObjTierConfig:
        _resolve(self)  # every check that spans fields, once, at validation
        return self

    def value(self, key: str) -> Any:
        """Field ``key`` from ``store_config`` where it is set there, else from the top."""
        nested = self.store_config
        if nested is not None and key in nested.model_fields_set:
            return getattr(nested, key)
        return getattr(self, key)

    def where(self, key: str) -> str:
        """Where field ``key`` is set, relative to the tier (``store_config.bucket``)."""
        nested = self.store_config
        return f"store_config.{key}" if nested and key in nested.model_fields_set else key


@dataclass(frozen=True)
class S3Config:
    """A resolved obj tier config: what the tier and the ops tools use."""

    bucket: str
    endpoint_override: str = ""  # host[:port] (its scheme, if it had one, is in `scheme`)
    scheme: str = "https"
    access_key: Secret = _NO_SECRET
    secret_key: Secret = _NO_SECRET
    session_token: Secret = _NO_SECRET
    region: str = ""
    ca_bundle: str = ""
    prefix: str = ""
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    timeout_s: float = DEFAULT_TIMEOUT_S
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    staging_bytes: int = DEFAULT_STAGING_BYTES
    path: str = ""  # where the config came from (``secondary_tiers[1]``), for messages

    @classmethod
    def from_config(cls, config: ObjTierConfig) -> S3Config:
        """The resolved form of a validated `ObjTierConfig`."""
        return cls(**_resolve(config), path=config.path)

    @classmethod
    def parse(cls, data: Mapping[str, Any], path: str = "") -> S3Config:
        """Validate ``{"type": "obj", "bucket": ..., ...}`` and resolve it; `ConfigError`
        names a bad field under ``path``."""
        return cls.from_config(tier_config({"type": "obj", **data}, path))  # type: ignore[arg-type]

    @property
    def endpoint_url(self) -> str | None:
        """``scheme://host[:port]``, or None for AWS S3's own endpoint."""
        return f"{self.scheme}://{self.endpoint_override}" if self.endpoint_override else None

    @property
    def client_region(self) -> str | None:
        """``region``, else us-east-1 for a custom endpoint, else None (the AWS chain)."""
        return self.region or (_DEFAULT_ENDPOINT_REGION if self.endpoint_override else None)

    def field(self, key: str) -> str:
        """The full name of config field ``key`` (``secondary_tiers[1].bucket``)."""
        return f"{self.path}.{key}" if self.path else key

    def as_dict(self) -> dict[str, Any]:
        """The config as plain data for dumps, credentials shown as ``***``."""
        return {
            "type": "obj",
            "bucket": self.bucket,
            "endpoint_override": self.endpoint_url or "",
            "scheme": self.scheme,
            "access_key": str(self.access_key),
            "secret_key": str(self.secret_key),
            "session_token": str(self.session_token),
            "region": self.region,
            "ca_bundle": self.ca_bundle,
            "prefix": self.prefix,
            "max_concurrency": self.max_concurrency,
            "timeout_s": self.timeout_s,
            "lookup_timeout_s": self.lookup_timeout_s,
            "retries": self.retries,
            "staging_bytes": self.staging_bytes,
        }

    @property
    def inline_credentials(self) -> list[str]:
        """The credential fields set in the config itself (not the AWS chain), by name."""
        secrets = ("access_key", self.access_key), ("secret_key", self.secret_key), (
            "session_token", self.session_token)  # fmt: skip
        return [self.field(key) for key, value in secrets if value]


def _resolve(cfg: ObjTierConfig) -> dict[str, Any]:
    """`S3Config`'s fields from ``cfg``; `ConfigError` names a field relative to the tier."""
    nested = cfg.store_config
    if nested is not None:
        for key in sorted(nested.model_fields_set & cfg.model_fields_set):
            raise ConfigError(f"store_config.{key}", f"is also set as {key}")
    bucket = cfg.value("bucket")
    if bucket is None:
        raise ConfigError("bucket", "is required (here or in store_config)")
    if "/" in bucket or any(c.isspace() for c in bucket):
        raise ConfigError(cfg.where("bucket"), "is not a bucket name")
    url_scheme, host = _split_endpoint(
        cfg.value("endpoint_override") or "", cfg.where("endpoint_override")
    )
    scheme = cfg.value("scheme") or url_scheme or ("http" if host else "https")
    if url_scheme and scheme != url_scheme:
        raise ConfigError(
            cfg.where("scheme"), f"is {scheme!r} but endpoint_override is {url_scheme}"
        )
    access, secret_key, token = (
        Secret(value.get_secret_value() if value else "")
        for value in (cfg.value(k) for k in ("access_key", "secret_key", "session_token"))
    )
    if access and not secret_key:
        raise ConfigError(
            cfg.where("secret_key"), f"is required when {cfg.where('access_key')} is set"
        )
    if secret_key and not access:
        raise ConfigError(
            cfg.where("access_key"), f"is required when {cfg.where('secret_key')} is set"
        )
    if token and not access:
        raise ConfigError(cfg.where("session_token"), "needs access_key and secret_key")
    if cfg.io_threads is not None and cfg.max_concurrency is not None:
        raise ConfigError("io_threads", "set max_concurrency or io_threads, not both")
    concurrency = cfg.io_threads or cfg.max_concurrency or DEFAULT_MAX_CONCURRENCY
    lookup = cfg.lookup_timeout_s
    return {
        "bucket": bucket,
        "endpoint_override": host,
        "scheme": scheme,
        "access_key": access,
        "secret_key": secret_key,
        "session_token": token,
        "region": cfg.value("region") or "",
        "ca_bundle": cfg.value("ca_bundle") or "",
        "prefix": cfg.prefix.strip("/"),
        "max_concurrency": concurrency,
        "timeout_s": cfg.timeout_s,
        "lookup_timeout_s": min(DEFAULT_LOOKUP_TIMEOUT_S, cfg.timeout_s)
        if lookup is None
        else lookup,
        "retries": cfg.retries,
        "staging_bytes": cfg.staging_bytes,
    }


def _split_endpoint(value: str, field: str) -> tuple[str | None, str]:
    """``(scheme or None, host[:port])`` of ``endpoint_override``; ``""`` host for AWS."""
    if "@" in value:  # never echo: it may carry credentials
        raise ConfigError(field, "must not contain user info; use access_key and secret_key")
    if not value:
        return None, ""
    if "://" not in value:
        value = f"//{value}"
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("", "http", "https"):
        raise ConfigError(field, f"scheme must be http or https, got {parts.scheme!r}")
    if not parts.netloc or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(field, f"must be host[:port] or scheme://host[:port], got {value!r}")
    try:
        parts.port  # noqa: B018 (validates the port)
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from None
    return parts.scheme or None, parts.netloc
