"""The obj tier: one object per block in an S3-compatible store (AWS S3, MinIO, Ceph, moto).

Theory of operation
-------------------
*Names and format.* Block ``key`` is object ``<prefix>/`` + `block_relpath` in ``bucket``,
and its body is the fs tier's block file: one 4096-byte header page (length, checksums of the
payload and of the key, the checksum's name), then the payload. A root directory synced to a
bucket, or a bucket synced to a root directory, is therefore found and verified by the other
tier as it is. The checksum travels inside the object, so it works on every S3-compatible
store; S3's own checksum headers are not sent (moto neither checks nor returns them, and
SigV4 already covers the payload over plain HTTP).

*Store* PUTs the header page and the slot's memory as one body without copying the block
(`_BlockFileBody` hands aiohttp slices of the slot itself), with ``If-None-Match: *``: one
request whether or not the object exists. An existing object answers 412 and is left alone;
the key counts as stored ("skipped"). New blocks are the usual case, and for them this saves
the HEAD of HEAD-then-PUT: on moto, 2x the store throughput at 256 KiB and 1.1x at 2 MiB. A
duplicate costs an upload instead of a HEAD. botocore asks for ``Expect: 100-continue`` on
every PUT whose body looks like a file; a hook on ``before-sign.s3.PutObject`` removes it,
because aiohttp waits for the ``100 Continue`` with no timeout running (neither connect nor
read), so an endpoint that accepted the connection and went silent held the PUT, its pinned
CPU slot and the engine's drain forever. A store that answers 501 to conditional PUTs
switches the tier to HEAD-then-PUT, once.

*Load* GETs the object and streams the body chunk by chunk straight into the slot's memory
(the header page into a small buffer): no whole-object copy. Length and checksums are verified
before the key is reported loaded. A corrupt object (wrong length, bad header, wrong key or
payload checksum) fails its key and is deleted, so later lookups answer False; a missing one
fails its key. *Lookup* HEADs each key; keys run concurrently, up to ``max_concurrency``.

*Deadlines.* Every attempt of every request ends within ``timeout_s``, all of it: connect,
send, first byte and the whole body (a GET's body is read inside the attempt). botocore's
connect and read timeouts are set too, but they time single socket waits only, so the
attempt runs in `anyio.move_on_after` as well; whatever aiohttp or botocore waits for inside,
the attempt ends as `RequestTimeoutError`. A request and its retries get ``2 * timeout_s`` in
all (from its first attempt: a wait for a `max_concurrency` token does not count), except a
lookup's HEAD, which gets ``lookup_timeout_s`` (default ``min(1.0, timeout_s)``) in all: a
lookup that does not answer in time is a miss, counted in ``lookup_timeouts``. The breaker's
probe gets ``min(timeout_s, lookup_timeout_s)``. ``aclose`` waits at most ``timeout_s``, so
a failed ``open`` returns within ``3 * timeout_s`` (its probe's budget, then the close).

*Failures.* Every request holds one token of an `anyio.CapacityLimiter` of ``max_concurrency``.
Throttling (429, 503 SlowDown), other 5xx, timeouts and connection errors are retried up to
``retries`` times with capped exponential backoff and full jitter, within the budget above;
botocore's own retries are off. Connection errors and timeouts also feed a circuit breaker:
after ``breaker_threshold`` consecutive failures, or ``breaker_timeouts`` timeouts without an
answer in between, it opens for ``breaker_open_s`` (a refused connection costs nothing, a
timeout costs ``timeout_s``: two are enough to know). A request whose attempt failed while
the circuit opened is not retried. While it is open, ``lookup`` answers all False at once and
``store``/``load`` raise `CircuitOpenError`, with no I/O, so a dead endpoint costs the engine
nothing. Then the next call sends one probe (HEAD bucket): an answer closes the circuit, a
connection error or a timeout opens it again. The clock is injectable for tests. Per-key
warnings (``obj store failed``, ...) are rate-limited (`RateLimited`: one line per event per
10 s, then a count); ``warnings_suppressed`` counts the lines not logged.

*Start-up.* ``open`` creates one aioboto3 session and S3 client (closed by ``aclose``) and
probes the bucket, raising a `TierOpenError` subclass that says what to fix:
`EndpointUnreachableError` (a `ConnectionError`), `BucketNotFoundError` (a `LookupError`),
`AccessDeniedError` (a `PermissionError`: credentials rejected, or access denied). Empty
``access_key``/``secret_key`` use the standard AWS credential chain (environment, profile,
instance role): the documented way, since hosts log their configuration (``vllm serve`` logs
``kv_connector_extra_config`` among its non-default arguments). Credentials given inline are
accepted, with one warning at ``open`` that names the fields, never their values.

*Secrets* are held as `Secret` and never reach a repr, a log line, the statistics, a config
dump (`S3Config.as_dict`) or an error message (texts from botocore are scrubbed of them too;
`kvtier_async.config` never echoes the value of a secret field, even one of the wrong type).
botocore's own DEBUG logging, which the host controls, prints request headers: the access key
id and a session token appear there, as with any boto3 program.

*Event loop.* aiobotocore runs on asyncio only, so this tier does too (under trio, ``open``
raises `TierOpenError`); the rest of the engine runs on both. After ``open`` nothing blocks
the loop (checked with blockbuster); ``open`` itself lets botocore read its S3 model files
synchronously, a few milliseconds once per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import random
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, TypeVar

import aioboto3
import aiohttp
import aiohttp.payload
import anyio
import anyio.lowlevel
from aiohttp.abc import AbstractStreamWriter
from botocore import exceptions as boto_errors  # type: ignore[import-untyped]
from botocore.config import Config as BotoConfig  # type: ignore[import-untyped]

from kvtier_async._log import RateLimited, get_logger
from kvtier_async.config import ConfigError, Section
from kvtier_async.tiers.base import SecondaryTier, TierContext, TierStatistics, block_relpath

# The object body is the fs tier's block file format, so fs and obj are interchangeable.
from kvtier_async.tiers.fs import HEADER_BYTES, CorruptBlockError
from kvtier_async.tiers.fs import _pack_header as pack_header
from kvtier_async.tiers.fs import _verify as verify_block

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "CircuitOpenError",
    "EndpointUnreachableError",
    "RequestTimeoutError",
    "S3Config",
    "S3Tier",
    "S3TierStatistics",
    "Secret",
    "TierOpenError",
    "from_config",
]

log = get_logger(__name__)
T = TypeVar("T")

DEFAULT_MAX_CONCURRENCY: Final = 16
DEFAULT_TIMEOUT_S: Final = 5.0
DEFAULT_LOOKUP_TIMEOUT_S: Final = 1.0  # at most; never more than timeout_s by default
DEFAULT_RETRIES: Final = 3
DEFAULT_BREAKER_THRESHOLD: Final = 5
DEFAULT_BREAKER_TIMEOUTS: Final = 2
DEFAULT_BREAKER_OPEN_S: Final = 5.0
DEFAULT_BACKOFF_S: Final = 0.05
_BACKOFF_CAP_S: Final = 2.0
_BUDGET_TIMEOUTS: Final = 2  # a request and its retries: 2 * timeout_s in all
_WARN_INTERVAL_S: Final = 10.0
_SEND_CHUNK: Final = 256 * 1024  # slices handed to aiohttp: bounds its transport buffer
_DEFAULT_ENDPOINT_REGION: Final = "us-east-1"

# vLLM's ObjStoreConfig fields (also accepted nested as vLLM's "store_config"), then ours.
_VLLM_FIELDS: Final = ("bucket", "endpoint_override", "access_key", "secret_key",
                       "session_token", "region", "scheme", "ca_bundle")  # fmt: skip
_CONFIG_KEYS: Final = ("type", "name", *_VLLM_FIELDS, "prefix", "max_concurrency",
                       "timeout_s", "lookup_timeout_s", "retries", "store_config",
                       "io_threads")  # fmt: skip

_RETRY_CODES: Final = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
    "RequestTimeout", "InternalError", "ServiceUnavailable", "OperationAborted",
    "ConditionalRequestConflict",
})  # fmt: skip
_CREDENTIAL_CODES: Final = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
    "TokenRefreshRequired", "InvalidClientTokenId", "AuthorizationHeaderMalformed",
})  # fmt: skip
_TIMEOUTS: Final = (
    TimeoutError,  # ours (RequestTimeoutError), asyncio's
    boto_errors.ConnectTimeoutError,
    boto_errors.ReadTimeoutError,
)
_CONNECTION_ERRORS: Final = (
    boto_errors.ConnectionError,  # refused, connect timeout, TLS, proxy
    boto_errors.HTTPClientError,  # read timeout, connection closed, body stream broken
    boto_errors.IncompleteReadError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    TimeoutError,
    ConnectionError,
)


# -- errors ------------------------------------------------------------------------------------


class TierOpenError(Exception):
    """The obj tier could not start; the message says what to check, naming config fields."""


class EndpointUnreachableError(TierOpenError, ConnectionError):
    """No answer from the endpoint (refused, timed out, TLS failure, bad address)."""


class AccessDeniedError(TierOpenError, PermissionError):
    """The endpoint rejected the credentials, or they may not use the bucket."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class BucketNotFoundError(TierOpenError, LookupError):
    """The bucket does not exist at the endpoint."""


class CircuitOpenError(ConnectionError):
    """The endpoint is unreachable and the circuit is open: the call failed without I/O."""


class RequestTimeoutError(TimeoutError):
    """One attempt of a request got no complete answer within its deadline."""


# -- configuration -----------------------------------------------------------------------------


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


def from_config(section: Section, name: str, ctx: TierContext) -> S3Tier:
    """Build an `S3Tier` from its config section (the tier factory's ``"obj"`` entry)."""
    return S3Tier(name, ctx, S3Config.from_section(section))


# -- circuit breaker ---------------------------------------------------------------------------


class _Breaker:
    """Opens after ``threshold`` consecutive connection failures, or ``timeouts`` timeouts
    without an answer in between; after ``open_s`` one probe decides. States: closed (calls
    pass), open (calls are rejected), probing (one probe runs, other calls are rejected).
    Plain synchronous bookkeeping; the tier does the I/O."""

    def __init__(
        self, threshold: int, open_s: float, clock: Callable[[], float], timeouts: int
    ) -> None:
        self.threshold = threshold
        self.timeout_threshold = timeouts
        self.open_s = open_s
        self.clock = clock
        self.state = "closed"
        self.failures = 0
        self.timeouts = 0
        self.opened_at = 0.0
        self.opens = 0

    def admit(self) -> str:
        """``pass``, ``probe`` (the caller must probe, then report) or ``reject``."""
        if self.state == "closed":
            return "pass"
        if self.state == "open" and self.retry_in() <= 0:
            self.state = "probing"
            return "probe"
        return "reject"

    def retry_in(self) -> float:
        return max(0.0, self.opened_at + self.open_s - self.clock())

    def succeeded(self) -> bool:
        """The endpoint answered; True when that closed the circuit."""
        self.failures = self.timeouts = 0
        reopened, self.state = self.state != "closed", "closed"
        return reopened

    def failed(self, *, timeout: bool = False) -> bool:
        """A connection failure (``timeout``: no answer in time); True when it opened the
        circuit."""
        self.failures += 1
        self.timeouts += timeout
        tripped = self.failures >= self.threshold or self.timeouts >= self.timeout_threshold
        if self.state == "probing" or (self.state == "closed" and tripped):
            self.state, self.opened_at = "open", self.clock()
            self.opens += 1
            return True
        return False

    def abandon_probe(self) -> None:
        """The probe ended without a verdict (cancelled): due again at once."""
        if self.state == "probing":
            self.state = "open"


# -- the tier ----------------------------------------------------------------------------------


class _Failure(Enum):
    RETRY = "retry"  # throttled or a server error: retry
    CONNECTION = "connection"  # no connection: retry, and count towards the breaker
    TIMEOUT = "timeout"  # no answer in time: the same, and trips the breaker sooner
    FINAL = "final"  # an answer that retrying will not change


@dataclass(frozen=True)
class S3TierStatistics(TierStatistics):
    """`TierStatistics` plus what the obj tier adds."""

    blocks_skipped: int = 0  # stores that found the object there already (no upload)
    corrupt_objects: int = 0  # loads that found a corrupt object (deleted)
    retries: int = 0  # requests sent again after throttling, 5xx or a connection error
    circuit_state: str = "closed"  # closed, open or probing
    circuit_opens: int = 0
    timeouts: int = 0  # attempts (and probes) that got no complete answer in time
    lookup_timeouts: int = 0  # lookup keys answered as misses because the HEAD timed out
    warnings_suppressed: int = 0  # rate-limited warning lines not logged


class S3Tier(SecondaryTier):
    """Blocks as objects in an S3-compatible bucket (see the module docstring).

    ``breaker_threshold``, ``breaker_timeouts``, ``breaker_open_s``, ``backoff_s`` (the first
    retry's maximum delay) and ``clock`` (the breaker's, monotonic seconds) are for tuning
    and tests.
    """

    kind = "obj"

    def __init__(
        self,
        name: str,
        ctx: TierContext,
        config: S3Config,
        *,
        breaker_threshold: int = DEFAULT_BREAKER_THRESHOLD,
        breaker_timeouts: int = DEFAULT_BREAKER_TIMEOUTS,
        breaker_open_s: float = DEFAULT_BREAKER_OPEN_S,
        backoff_s: float = DEFAULT_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name, ctx, config.max_concurrency, config.max_concurrency)
        self.config = config
        self._breaker = _Breaker(breaker_threshold, breaker_open_s, clock, breaker_timeouts)
        self._backoff_s = backoff_s
        self._budget_s = _BUDGET_TIMEOUTS * config.timeout_s
        self._probe_s = min(config.timeout_s, config.lookup_timeout_s)
        self._warn = RateLimited(log, _WARN_INTERVAL_S)
        self._limiter = anyio.CapacityLimiter(config.max_concurrency)
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._closed = False
        self._conditional_put = True
        self._scrub = _Scrubber(config.access_key, config.secret_key, config.session_token)
        self._counts = dict.fromkeys(
            ("stored", "skipped", "loaded", "written", "read", "store_failures",
             "load_failures", "lookups", "hits", "corrupt", "retries", "timeouts",
             "lookup_timeouts"), 0)  # fmt: skip

    def __repr__(self) -> str:
        where = self.config.endpoint_url or "AWS"
        return f"<S3Tier {self.name!r} s3://{self.config.bucket}/{self.config.prefix} at {where}>"

    @property
    def client(self) -> Any:
        """The aiobotocore S3 client while open (for instrumentation: ``client.meta.events``)."""
        if self._client is None:
            raise RuntimeError(f"{self!r} is not open")
        return self._client

    def object_name(self, key: bytes) -> str:
        """The object key of block ``key``: ``<prefix>/`` + `block_relpath`."""
        relpath = block_relpath(self.ctx, key)
        return f"{self.config.prefix}/{relpath}" if self.config.prefix else relpath

    # -- life cycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the client and probe the bucket; raise a `TierOpenError` that says why not."""
        if self._stack is not None or self._closed:
            raise RuntimeError(f"{self!r} is {'closed' if self._closed else 'open already'}")
        self._require_asyncio()
        await self._check_ca_bundle()
        stack = AsyncExitStack()
        try:
            self._client = await self._enter_client(stack)
            await self._probe_bucket()
        except BaseException:
            self._client = None
            with anyio.move_on_after(self.config.timeout_s, shield=True):
                await stack.aclose()
            raise
        self._stack = stack
        if inline := self.config.inline_credentials:
            log.warning(
                "obj tier credentials are set inline in the config, where a host that logs its "
                "configuration shows them (vllm serve does); prefer the standard AWS credential "
                "chain: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment, a "
                "profile (AWS_PROFILE), or an instance role",
                tier=self.name,
                fields=inline,
            )
        log.info(
            "obj tier open",
            tier=self.name,
            bucket=self.config.bucket,
            prefix=self.config.prefix,
            endpoint=self.config.endpoint_url or "AWS",
            max_concurrency=self.config.max_concurrency,
        )

    async def aclose(self) -> None:
        """Close the client, waiting at most ``timeout_s``; idempotent."""
        self._closed = True
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            with anyio.move_on_after(self.config.timeout_s, shield=True):
                await stack.aclose()

    def _require_asyncio(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise TierOpenError(
                f"obj tier {self.name!r} needs asyncio: aioboto3 (aiobotocore) runs on asyncio "
                "only; run the engine under asyncio to use it"
            ) from None

    async def _check_ca_bundle(self) -> None:
        bundle = self.config.ca_bundle
        if bundle and self.config.scheme == "https" and not await anyio.Path(bundle).is_file():
            raise TierOpenError(f"{self.config.field('ca_bundle')}: no such file {bundle!r}")

    async def _enter_client(self, stack: AsyncExitStack) -> Any:
        config = self.config
        session = aioboto3.Session(
            aws_access_key_id=config.access_key.reveal() or None,
            aws_secret_access_key=config.secret_key.reveal() or None,
            aws_session_token=config.session_token.reveal() or None,
        )
        verify = config.ca_bundle if config.ca_bundle and config.scheme == "https" else None
        client_config = BotoConfig(
            connect_timeout=config.timeout_s,
            read_timeout=config.timeout_s,
            retries={"total_max_attempts": 1},  # ours, with the breaker, instead
            max_pool_connections=config.max_concurrency + 1,  # + the breaker's probe
            request_checksum_calculation="when_required",  # the body carries its checksum
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if config.endpoint_override else {},
            user_agent_extra="kvtier-async",
        )
        try:
            client = await stack.enter_async_context(
                session.client(
                    "s3",
                    endpoint_url=config.endpoint_url,
                    region_name=config.client_region,
                    use_ssl=config.scheme == "https",
                    verify=verify,
                    config=client_config,
                )
            )
            client.meta.events.register("before-sign.s3.PutObject", _no_expect_continue)
            return client
        except boto_errors.NoRegionError:
            raise TierOpenError(
                f"{config.field('region')}: empty, and the AWS configuration names no region"
            ) from None
        except Exception as exc:
            raise TierOpenError(
                f"obj tier {self.name!r}: cannot create the S3 client: {self._describe(exc)}"
            ) from exc

    async def _probe_bucket(self) -> None:
        config = self.config
        try:
            await self._request(self._head_bucket, gated=False)
        except boto_errors.ClientError as exc:
            raise await self._open_error(exc) from exc
        except (boto_errors.NoCredentialsError, boto_errors.PartialCredentialsError) as exc:
            raise AccessDeniedError(
                f"{config.field('access_key')} and {config.field('secret_key')} are empty and "
                f"the AWS credential chain found none ({self._describe(exc)})"
            ) from exc
        except _CONNECTION_ERRORS as exc:
            raise EndpointUnreachableError(
                f"obj tier {self.name!r}: cannot reach {config.endpoint_url or 'AWS S3'} "
                f"({self._describe(exc)}); check {config.field('endpoint_override')}, "
                f"{config.field('scheme')} and {config.field('ca_bundle')}"
            ) from exc

    async def _open_error(self, exc: Any) -> TierOpenError:
        """The `TierOpenError` for HEAD bucket's error answer."""
        config, status, code = self.config, _status(exc), _code(exc)
        where = f"bucket {config.bucket!r} at {config.endpoint_url or 'AWS S3'}"
        if status == 404 or code in ("NoSuchBucket", "NotFound"):
            return BucketNotFoundError(
                f"{config.field('bucket')}: {where} does not exist; create it first"
            )
        if status == 403:
            return await self._access_error(where)
        if status in (301, 307) or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            region = (
                exc.response.get("ResponseMetadata", {})
                .get("HTTPHeaders", {})
                .get("x-amz-bucket-region", "another region")
            )
            return TierOpenError(f"{config.field('region')}: {where} is in {region}")
        return TierOpenError(f"obj tier {self.name!r}: {where}: {self._describe(exc)}")

    async def _access_error(self, where: str) -> AccessDeniedError:
        """HEAD answers 403 without a reason; a GET of a probe name tells which 403 it was."""
        config, code = self.config, ""
        probe = f"{config.prefix}/.kvtier-probe" if config.prefix else ".kvtier-probe"
        with contextlib.suppress(Exception), anyio.move_on_after(config.timeout_s):
            try:  # without a reason (or an answer), the 403 stands as it is
                (await self.client.get_object(Bucket=config.bucket, Key=probe))["Body"].close()
            except boto_errors.ClientError as exc:
                code = _code(exc)
        if code in _CREDENTIAL_CODES:
            return AccessDeniedError(
                f"obj tier {self.name!r}: the endpoint rejected the credentials ({code}); check "
                f"{config.field('access_key')}, {config.field('secret_key')} and "
                f"{config.field('session_token')} (when empty: the AWS credential chain)",
                code,
            )
        return AccessDeniedError(
            f"obj tier {self.name!r}: access denied to {where} ({code or 403}); the credentials "
            "need s3:ListBucket on the bucket and s3:GetObject, s3:PutObject and "
            "s3:DeleteObject on its objects",
            code or "AccessDenied",
        )

    # -- the contract -------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """HEAD every key, up to ``max_concurrency`` at a time; an error or an open circuit
        answers False (a miss), never an exception."""
        self._require_open()
        self._counts["lookups"] += len(keys)
        try:
            await self._admit()  # before the fan-out, so a due probe is sent once
        except CircuitOpenError:
            return [False] * len(keys)
        if not keys:
            return []
        found = await self._fan_out(lambda i: self._lookup_one(keys[i]), len(keys))
        self._counts["hits"] += sum(found)
        return found

    async def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """PUT every block unless its object exists; `CircuitOpenError` while it is open."""
        self._check_batch(keys, blocks)
        await self._admit()
        return await self._fan_out(lambda i: self._store_one(keys[i], blocks[i]), len(keys))

    async def load(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """GET every key into its block and verify it; `CircuitOpenError` while it is open."""
        self._check_batch(keys, blocks)
        await self._admit()
        return await self._fan_out(lambda i: self._load_one(keys[i], blocks[i]), len(keys))

    def statistics(self) -> S3TierStatistics:
        counts = self._counts
        put = "conditional PUT" if self._conditional_put else "HEAD then PUT"
        return S3TierStatistics(
            name=self.name,
            kind=self.kind,
            blocks_stored=counts["stored"],
            blocks_loaded=counts["loaded"],
            bytes_written=counts["written"],
            bytes_read=counts["read"],
            store_failures=counts["store_failures"],
            load_failures=counts["load_failures"],
            lookups=counts["lookups"],
            lookup_hits=counts["hits"],
            detail=(
                f"s3://{self.config.bucket}/{self.config.prefix} at "
                f"{self.config.endpoint_url or 'AWS'}; {put}; "
                f"max_concurrency={self.config.max_concurrency} retries={self.config.retries} "
                f"timeout_s={self.config.timeout_s:g} "
                f"lookup_timeout_s={self.config.lookup_timeout_s:g}"
            ),
            blocks_skipped=counts["skipped"],
            corrupt_objects=counts["corrupt"],
            retries=counts["retries"],
            circuit_state=self._breaker.state,
            circuit_opens=self._breaker.opens,
            timeouts=counts["timeouts"],
            lookup_timeouts=counts["lookup_timeouts"],
            warnings_suppressed=self._warn.suppressed,
        )

    def _require_open(self) -> None:
        if self._client is None:
            raise RuntimeError(f"{self!r} is not open")

    def _check_batch(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> None:
        self._require_open()
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")

    async def _fan_out(self, one: Callable[[int], Awaitable[bool]], count: int) -> list[bool]:
        """``[await one(i) for i in range(count)]``, up to ``max_concurrency`` at a time."""
        if count == 1:
            return [await one(0)]
        results = [False] * count
        indices = iter(range(count))

        async def worker() -> None:
            for i in indices:
                results[i] = await one(i)

        async with anyio.create_task_group() as tg:
            for _ in range(min(count, self.config.max_concurrency)):
                tg.start_soon(worker)
        return results

    # -- one key ------------------------------------------------------------------------------

    async def _lookup_one(self, key: bytes) -> bool:
        """HEAD one key within ``lookup_timeout_s``, retries included; False on any failure."""
        try:
            return await self._exists(self.object_name(key), self.config.lookup_timeout_s)
        except CircuitOpenError:
            return False
        except Exception as exc:
            if _classify(exc) is _Failure.TIMEOUT:
                self._counts["lookup_timeouts"] += 1
            self._log_failure("obj lookup failed", key, exc)
            return False

    async def _store_one(self, key: bytes, block: memoryview) -> bool:
        header = memoryview(bytearray(HEADER_BYTES))
        pack_header(header, key, block)
        try:
            written = await self._put(self.object_name(key), header, block)
        except Exception as exc:
            self._counts["store_failures"] += 1
            self._log_failure("obj store failed", key, exc)
            return False
        if written:
            self._counts["stored"] += 1
            self._counts["written"] += block.nbytes
        else:
            self._counts["skipped"] += 1
        return True

    async def _load_one(self, key: bytes, block: memoryview) -> bool:
        name = self.object_name(key)
        try:
            await self._request(functools.partial(self._get_into, name, key, block))
        except CorruptBlockError as exc:
            self._counts["corrupt"] += 1
            self._counts["load_failures"] += 1
            log.warning(
                "obj corrupt object deleted", tier=self.name, key=key.hex(), reason=str(exc)
            )
            await self._delete(name)
            return False
        except Exception as exc:
            self._counts["load_failures"] += 1
            if _status(exc) == 404:
                log.debug("obj load missed", tier=self.name, key=key.hex())
            else:
                self._log_failure("obj load failed", key, exc)
            return False
        self._counts["loaded"] += 1
        self._counts["read"] += block.nbytes
        return True

    def _log_failure(self, event: str, key: bytes, exc: Exception) -> None:
        level = log.debug if isinstance(exc, CircuitOpenError) else self._warn
        level(event, tier=self.name, key=key.hex(), error=self._describe(exc))

    # -- requests -----------------------------------------------------------------------------

    async def _head_bucket(self) -> Any:
        return await self.client.head_bucket(Bucket=self.config.bucket)

    async def _exists(self, name: str, budget_s: float | None = None) -> bool:
        call = functools.partial(self.client.head_object, Bucket=self.config.bucket, Key=name)
        try:
            await self._request(call, budget_s=budget_s)
        except boto_errors.ClientError as exc:
            if _status(exc) == 404:
                return False
            raise
        return True

    async def _put(self, name: str, header: memoryview, block: memoryview) -> bool:
        """PUT header + block as ``name`` unless it exists; whether it was written."""

        async def put(**conditions: str) -> None:  # a fresh body for every attempt
            body = _BlockFileBody(header, block)
            await self.client.put_object(
                Bucket=self.config.bucket, Key=name, Body=body, **conditions
            )

        if not self._conditional_put:
            if await self._exists(name):
                return False
            await self._request(put)
            return True
        try:
            await self._request(functools.partial(put, IfNoneMatch="*"))
        except boto_errors.ClientError as exc:
            if _status(exc) == 412:
                return False
            if _status(exc) != 501 and _code(exc) != "NotImplemented":
                raise
            self._conditional_put = False
            log.warning("obj store refuses conditional PUT; using HEAD then PUT", tier=self.name)
            return await self._put(name, header, block)
        return True

    async def _get_into(self, name: str, key: bytes, block: memoryview) -> None:
        """GET ``name`` into ``block``, streaming; `CorruptBlockError` if it does not verify."""
        response = await self.client.get_object(Bucket=self.config.bucket, Key=name)
        stream = response["Body"]
        header = memoryview(bytearray(HEADER_BYTES))
        try:
            size, expected = response["ContentLength"], HEADER_BYTES + block.nbytes
            if size != expected:
                raise CorruptBlockError(f"object is {size} bytes, expected {expected}")
            await _read_into(stream, header)
            await _read_into(stream, block)
        finally:
            stream.close()
        verify_block(header, key, block)

    async def _delete(self, name: str) -> None:
        call = functools.partial(self.client.delete_object, Bucket=self.config.bucket, Key=name)
        try:
            await self._request(call)
        except Exception as exc:
            self._warn("obj delete failed", tier=self.name, object=name, error=self._describe(exc))

    async def _request(
        self,
        call: Callable[[], Awaitable[T]],
        *,
        gated: bool = True,
        budget_s: float | None = None,
    ) -> T:
        """``await call()`` under the limiter, each attempt within ``timeout_s``, retried
        while ``budget_s`` (default ``2 * timeout_s``, from the first attempt) lasts;
        ``gated``: through the breaker."""
        budget = self._budget_s if budget_s is None else budget_s
        deadline, error = math.inf, None
        for attempt in itertools.count():
            if gated:
                await self._admit()
            async with self._limiter:
                now = anyio.current_time()
                deadline = min(deadline, now + budget)
                if error is not None and deadline <= now:
                    raise error  # the budget went on waiting for a token
                try:
                    return await self._attempt(call, deadline - now)
                except Exception as exc:
                    pause = self._retry_pause(exc, attempt, deadline, gated)
                    if pause is None:
                        raise
                    error = exc
            self._counts["retries"] += 1
            await anyio.sleep(pause)
        raise AssertionError("unreachable")

    def _retry_pause(
        self, error: Exception, attempt: int, deadline: float, gated: bool
    ) -> float | None:
        """Count and report a failed attempt; the backoff before the next one, or None
        when it is not retried (final, the last, the circuit opened, no budget left)."""
        failure = self._failed(error, gated)
        pause = random.uniform(0, min(_BACKOFF_CAP_S, self._backoff_s * 2**attempt))
        if (
            failure is _Failure.FINAL
            or attempt >= self.config.retries
            or (gated and self._breaker.state != "closed")
            or anyio.current_time() + pause >= deadline
        ):
            return None
        return pause

    async def _attempt(self, call: Callable[[], Awaitable[T]], seconds: float) -> T:
        """``await call()``, all of it within ``min(timeout_s, seconds)``."""
        seconds = min(seconds, self.config.timeout_s)
        with anyio.move_on_after(seconds):
            return await call()
        raise RequestTimeoutError(f"no complete answer within {seconds:.3g} s")

    def _failed(self, error: Exception, gated: bool) -> _Failure:
        """Classify a failed attempt, count a timeout, and tell the breaker (``gated``)."""
        failure = _classify(error)
        if failure is _Failure.TIMEOUT:
            self._counts["timeouts"] += 1
        if gated:
            self._observe(failure)
        return failure

    # -- circuit breaker ----------------------------------------------------------------------

    async def _admit(self) -> None:
        """Return if a request may go out now; raise `CircuitOpenError` if not (a checkpoint
        either way)."""
        verdict = self._breaker.admit()
        if verdict == "probe" and await self._probe():
            return
        await anyio.lowlevel.checkpoint()
        if verdict == "pass":
            return
        raise CircuitOpenError(
            f"obj tier {self.name!r}: {self.config.endpoint_url or 'AWS S3'} is unreachable; "
            f"circuit open, next probe in {self._breaker.retry_in():.1f} s"
        )

    async def _probe(self) -> bool:
        """One HEAD bucket after the open time, within ``min(timeout_s, lookup_timeout_s)``:
        whether the endpoint answers again."""
        try:
            await self._attempt(self._head_bucket, self._probe_s)
        except Exception as exc:
            if self._failed(exc, gated=True) in (_Failure.CONNECTION, _Failure.TIMEOUT):
                log.info(
                    "obj endpoint still unreachable", tier=self.name, error=self._describe(exc)
                )
                return False
        except BaseException:
            self._breaker.abandon_probe()  # cancelled: no verdict, due again at once
            raise
        self._observe(None)  # any answer, even an error, shows the endpoint is back
        return True

    def _observe(self, failure: _Failure | None) -> None:
        """Tell the breaker how an attempt ended (None: it succeeded)."""
        if failure not in (_Failure.CONNECTION, _Failure.TIMEOUT):
            if self._breaker.succeeded():
                log.warning("obj endpoint reachable again; circuit closed", tier=self.name)
        elif self._breaker.failed(timeout=failure is _Failure.TIMEOUT):
            log.warning(
                "obj endpoint unreachable; circuit open",
                tier=self.name,
                endpoint=self.config.endpoint_url or "AWS",
                failures=self._breaker.failures,
                timeouts=self._breaker.timeouts,
                open_s=self._breaker.open_s,
            )

    def _describe(self, exc: BaseException) -> str:
        """``Type: message`` with every credential scrubbed out."""
        return self._scrub(f"{type(exc).__name__}: {exc}")


# -- helpers -----------------------------------------------------------------------------------


class _BlockFileBody(aiohttp.payload.Payload):
    """A PUT body made of the header page and the slot itself, never copied into one buffer.

    botocore sees a file (``read``/``seek``/``tell``/``len``: it hashes the payload for SigV4
    over plain HTTP, reading memoryview slices); aiohttp sees a ready `Payload` and sends
    slices of the two views. One body per attempt: aiohttp may consume a payload.
    """

    def __init__(self, *parts: memoryview) -> None:
        super().__init__(parts)
        self._parts = parts
        self._length = self._size = sum(part.nbytes for part in parts)
        self._position = 0

    def __len__(self) -> int:
        return self._length

    def read(self, size: int | None = -1) -> memoryview:
        """Up to ``size`` bytes (all: -1) from the position, within one part; empty at EOF."""
        offset = self._position
        for part in self._parts:
            if offset < part.nbytes:
                end = part.nbytes if size is None or size < 0 else offset + size
                chunk = part[offset:end]
                self._position += chunk.nbytes
                return chunk
            offset -= part.nbytes
        return memoryview(b"")

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._position, self._length)[whence]
        self._position = min(max(0, base + offset), self._length)
        return self._position

    def tell(self) -> int:
        return self._position

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._parts).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        left = self._length if content_length is None else min(content_length, self._length)
        for part in self._parts:
            for start in range(0, min(part.nbytes, left), _SEND_CHUNK):
                chunk = part[start : min(start + _SEND_CHUNK, left)]
                await writer.write(chunk)  # waits when the transport's buffer is full
            left -= min(part.nbytes, left)


def _no_expect_continue(request: Any, **_: Any) -> None:
    """``before-sign.s3.PutObject``: send the body at once, without ``Expect: 100-continue``
    (see the module docstring: no timeout covers aiohttp's wait for ``100 Continue``)."""
    del request.headers["Expect"]  # a no-op when absent


class _Scrubber:
    """Replaces every credential value in a text with ``***``."""

    def __init__(self, *secrets: Secret) -> None:
        values: Iterable[str] = (s.reveal() for s in secrets if s)
        self._values = sorted(set(values), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self._values:
            text = text.replace(value, "***")
        return text


async def _read_into(stream: Any, view: memoryview) -> None:
    """Fill ``view`` from a streaming body, chunk by chunk as the bytes arrive."""
    filled, size = 0, view.nbytes
    while filled < size:
        chunk = await stream.read(size - filled)
        if not chunk:
            raise CorruptBlockError(f"body ended after {filled} of {size} bytes")
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    status: int = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def _classify(exc: BaseException) -> _Failure:
    if isinstance(exc, boto_errors.ClientError):
        status = _status(exc)
        retry = (status >= 500 and status != 501) or status == 429 or _code(exc) in _RETRY_CODES
        return _Failure.RETRY if retry else _Failure.FINAL
    if isinstance(exc, _TIMEOUTS):
        return _Failure.TIMEOUT
    if isinstance(exc, _CONNECTION_ERRORS) and not isinstance(exc, CircuitOpenError):
        return _Failure.CONNECTION
    return _Failure.FINAL
