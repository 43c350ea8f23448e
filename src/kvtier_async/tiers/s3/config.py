"""The obj tier's configuration: `S3Config`, read from a config section, and `Secret`.

Fields are vLLM's ``ObjStoreConfig`` ones (also accepted nested, as vLLM writes them, under
``"store_config"``, with ``"io_threads"`` for ``max_concurrency``) and ours (``prefix``,
``max_concurrency``, ``timeout_s``, ``lookup_timeout_s``, ``retries``); `ConfigError` names a
bad field. Empty ``access_key``/``secret_key`` use the standard AWS credential chain
(environment, profile, instance role): the documented way, since hosts log their
configuration (``vllm serve`` logs ``kv_connector_extra_config`` among its non-default
arguments). Credentials given inline are accepted (the tier warns once at ``open``).

*Secrets* are held as `Secret` and never reach a repr, a log line, the statistics, a config
dump (`S3Config.as_dict`) or an error message (`Scrubber` takes them out of texts from
botocore; `kvtier_async.config` never echoes the value of a secret field, even one of the
wrong type). botocore's own DEBUG logging, which the host controls, prints request headers:
the access key id and a session token appear there, as with any boto3 program.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from kvtier_async.config import ConfigError, Section

__all__ = [
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "S3Config",
    "Scrubber",
    "Secret",
]

DEFAULT_MAX_CONCURRENCY: Final = 16
DEFAULT_TIMEOUT_S: Final = 5.0
DEFAULT_LOOKUP_TIMEOUT_S: Final = 1.0  # at most; never more than timeout_s by default
DEFAULT_RETRIES: Final = 3
_DEFAULT_ENDPOINT_REGION: Final = "us-east-1"

# vLLM's ObjStoreConfig fields (also accepted nested as vLLM's "store_config"), then ours.
_VLLM_FIELDS: Final = ("bucket", "endpoint_override", "access_key", "secret_key",
                       "session_token", "region", "scheme", "ca_bundle")  # fmt: skip
_CONFIG_KEYS: Final = ("type", "name", *_VLLM_FIELDS, "prefix", "max_concurrency",
                       "timeout_s", "lookup_timeout_s", "retries", "store_config",
                       "io_threads")  # fmt: skip


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


@dataclass(frozen=True)
class S3Config:
    """A validated obj tier config (see `from_section` for the fields and their defaults)."""

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
    path: str = ""  # where the config came from (``secondary_tiers[1]``), for messages

    @classmethod
    def from_section(cls, section: Section) -> S3Config:
        """Read ``{"type": "obj", "bucket": ..., ...}``; `ConfigError` names a bad field.

        vLLM's shape, with its fields nested under ``"store_config"`` and ``"io_threads"``
        (an alias of ``max_concurrency``), is accepted too.
        """
        section.allow_only(_CONFIG_KEYS)
        owner = _field_owners(section)

        def text(key: str, default: Any = "", **options: Any) -> Any:
            return owner.get(key, section).get_str(key, default, allow_empty=True, **options)

        bucket = owner.get("bucket", section).get_str("bucket")
        if "/" in bucket or any(c.isspace() for c in bucket):
            raise ConfigError(owner.get("bucket", section).name("bucket"), "is not a bucket name")
        endpoint_section = owner.get("endpoint_override", section)
        url_scheme, host = _split_endpoint(text("endpoint_override"), endpoint_section)
        scheme = _scheme(owner.get("scheme", section), url_scheme, bool(host))
        access_key, secret_key, session_token = _credentials(section, owner)
        timeout_s = section.get_float("timeout_s", DEFAULT_TIMEOUT_S, low=0.001, high=3600.0)
        lookup_default = min(DEFAULT_LOOKUP_TIMEOUT_S, timeout_s)
        return cls(
            bucket=bucket,
            endpoint_override=host,
            scheme=scheme,
            access_key=access_key,
            secret_key=secret_key,
            session_token=session_token,
            region=text("region"),
            ca_bundle=text("ca_bundle"),
            prefix=section.get_str("prefix", "", allow_empty=True).strip("/"),
            max_concurrency=_max_concurrency(section),
            timeout_s=timeout_s,
            lookup_timeout_s=section.get_float(
                "lookup_timeout_s", lookup_default, low=0.001, high=3600.0
            ),
            retries=section.get_int("retries", DEFAULT_RETRIES, low=0, high=20),
            path=section.path,
        )

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
        }

    @property
    def inline_credentials(self) -> list[str]:
        """The credential fields set in the config itself (not the AWS chain), by name."""
        secrets = ("access_key", self.access_key), ("secret_key", self.secret_key), (
            "session_token", self.session_token)  # fmt: skip
        return [self.field(key) for key, value in secrets if value]


def _field_owners(section: Section) -> dict[str, Section]:
    """Which section holds each vLLM field set in vLLM's nested ``store_config``."""
    if "store_config" not in section.data:
        return {}
    nested = Section(section.data["store_config"], section.name("store_config"))
    nested.allow_only(_VLLM_FIELDS)
    for key in nested.data:
        if key in section.data:
            raise ConfigError(nested.name(key), f"is also set as {section.name(key)}")
    return dict.fromkeys(nested.data, nested)


def _split_endpoint(value: str, section: Section) -> tuple[str | None, str]:
    """``(scheme or None, host[:port])`` of ``endpoint_override``; ``""`` host for AWS."""
    field = section.name("endpoint_override")
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


def _scheme(section: Section, url_scheme: str | None, has_endpoint: bool) -> str:
    """The scheme: from the endpoint URL, else ``scheme``, else http for an endpoint (as
    vLLM) and https for AWS S3."""
    default = url_scheme or ("http" if has_endpoint else "https")
    scheme: str = section.get_str("scheme", default, choices=("http", "https"))
    if url_scheme and scheme != url_scheme:
        raise ConfigError(
            section.name("scheme"), f"is {scheme!r} but endpoint_override is {url_scheme}"
        )
    return scheme


def _credentials(section: Section, owner: dict[str, Section]) -> tuple[Secret, Secret, Secret]:
    def secret(key: str) -> tuple[Secret, str]:
        where = owner.get(key, section)
        return Secret(where.get_str(key, "", allow_empty=True)), where.name(key)

    (access, access_field), (secret_key, secret_field) = secret("access_key"), secret("secret_key")
    token, token_field = secret("session_token")
    if access and not secret_key:
        raise ConfigError(secret_field, f"is required when {access_field} is set")
    if secret_key and not access:
        raise ConfigError(access_field, f"is required when {secret_field} is set")
    if token and not access:
        raise ConfigError(token_field, "needs access_key and secret_key")
    return access, secret_key, token


def _max_concurrency(section: Section) -> int:
    if "io_threads" in section.data and "max_concurrency" in section.data:
        raise ConfigError(section.name("io_threads"), "set max_concurrency or io_threads, not both")
    key = "io_threads" if "io_threads" in section.data else "max_concurrency"
    value: int = section.get_int(key, DEFAULT_MAX_CONCURRENCY, low=1, high=1024)
    return value
