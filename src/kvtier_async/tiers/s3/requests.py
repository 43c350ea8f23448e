"""How the obj tier sends a request: deadlines, retries, failure classes, and the breaker.

*Deadlines.* Every attempt of every request ends within ``timeout_s``, all of it: connect,
send, first byte and the whole body (a GET's body is read inside the attempt). botocore's
connect and read timeouts are set too, but they time single socket waits only, so the
attempt runs in `anyio.move_on_after` as well; whatever aiohttp or botocore waits for inside,
the attempt ends as `RequestTimeoutError`. A request and its retries get ``2 * timeout_s`` in
all (from its first attempt: a wait for a ``max_concurrency`` token does not count), unless
the caller gives a budget (a lookup's HEAD: ``lookup_timeout_s``). The breaker's probe gets
``min(timeout_s, lookup_timeout_s)``.

*Failures.* Every request holds one token of an `anyio.CapacityLimiter` of ``max_concurrency``.
Throttling (429, 503 SlowDown), other 5xx, timeouts and connection errors are retried up to
``retries`` times with capped exponential backoff and full jitter, within the budget above;
botocore's own retries are off. Connection errors and timeouts also feed the circuit breaker
(`kvtier_async.tiers.s3.breaker`); a request whose attempt failed while the circuit opened is
not retried. While it is open, `Requests.admit` raises `CircuitOpenError` with no I/O; then
the next call sends one probe (HEAD bucket): an answer closes the circuit, a connection error
or a timeout opens it again.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Final, TypeVar

import aiohttp
import anyio
import anyio.lowlevel
from botocore import exceptions as boto_errors  # type: ignore[import-untyped]

from kvtier_async._log import get_logger
from kvtier_async.tiers.s3.breaker import Breaker
from kvtier_async.tiers.s3.config import S3Config
from kvtier_async.tiers.s3.errors import CircuitOpenError, RequestTimeoutError

__all__ = [
    "CONNECTION_ERRORS",
    "DEFAULT_BACKOFF_S",
    "Failure",
    "Requests",
    "classify",
    "code_of",
    "status_of",
]

log = get_logger(__name__)
T = TypeVar("T")

DEFAULT_BACKOFF_S: Final = 0.05
_BACKOFF_CAP_S: Final = 2.0
_BUDGET_TIMEOUTS: Final = 2  # a request and its retries: 2 * timeout_s in all

_RETRY_CODES: Final = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
    "RequestTimeout", "InternalError", "ServiceUnavailable", "OperationAborted",
    "ConditionalRequestConflict",
})  # fmt: skip
_TIMEOUTS: Final = (
    TimeoutError,  # ours (RequestTimeoutError), asyncio's
    boto_errors.ConnectTimeoutError,
    boto_errors.ReadTimeoutError,
)
CONNECTION_ERRORS: Final = (
    boto_errors.ConnectionError,  # refused, connect timeout, TLS, proxy
    boto_errors.HTTPClientError,  # read timeout, connection closed, body stream broken
    boto_errors.IncompleteReadError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    TimeoutError,
    ConnectionError,
)


class Failure(Enum):
    """How a failed attempt ends."""

    RETRY = "retry"  # throttled or a server error: retry
    CONNECTION = "connection"  # no connection: retry, and count towards the breaker
    TIMEOUT = "timeout"  # no answer in time: the same, and trips the breaker sooner
    FINAL = "final"  # an answer that retrying will not change


def status_of(exc: BaseException) -> int:
    """The HTTP status of an error answer; 0 for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    status: int = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status


def code_of(exc: BaseException) -> str:
    """The S3 error code of an error answer (``NoSuchKey``...); empty for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def classify(exc: BaseException) -> Failure:
    """How a failed attempt ends: retried, counted by the breaker, or final."""
    if isinstance(exc, boto_errors.ClientError):
        status = status_of(exc)
        retry = (status >= 500 and status != 501) or status == 429 or code_of(exc) in _RETRY_CODES
        return Failure.RETRY if retry else Failure.FINAL
    if isinstance(exc, _TIMEOUTS):
        return Failure.TIMEOUT
    if isinstance(exc, CONNECTION_ERRORS) and not isinstance(exc, CircuitOpenError):
        return Failure.CONNECTION
    return Failure.FINAL


class Requests:
    """Sends one tier's requests (see the module docstring): ``send`` retries within a
    budget, ``attempt`` bounds one try, ``admit`` asks the breaker (and probes when due).

    ``probe`` is the breaker's request (HEAD bucket); ``describe`` renders an error with the
    credentials scrubbed out. ``retries`` and ``timeouts`` count for the tier's statistics.
    """

    def __init__(
        self,
        name: str,
        config: S3Config,
        breaker: Breaker,
        backoff_s: float,
        probe: Callable[[], Awaitable[object]],
        describe: Callable[[BaseException], str],
    ) -> None:
        self.name = name
        self.config = config
        self.breaker = breaker
        self._backoff_s = backoff_s
        self._probe_call = probe
        self.describe = describe
        self._budget_s = _BUDGET_TIMEOUTS * config.timeout_s
        self._probe_s = min(config.timeout_s, config.lookup_timeout_s)
        self._limiter = anyio.CapacityLimiter(config.max_concurrency)
        self.retries = 0  # requests sent again after throttling, 5xx or a connection error
        self.timeouts = 0  # attempts (and probes) that got no complete answer in time

    async def send(
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
                await self.admit()
            async with self._limiter:
                now = anyio.current_time()
                deadline = min(deadline, now + budget)
                if error is not None and deadline <= now:
                    raise error  # the budget went on waiting for a token
                try:
                    return await self.attempt(call, deadline - now)
                except Exception as exc:
                    pause = self._retry_pause(exc, attempt, deadline, gated)
                    if pause is None:
                        raise
                    error = exc
            self.retries += 1
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
            failure is Failure.FINAL
            or attempt >= self.config.retries
            or (gated and self.breaker.state != "closed")
            or anyio.current_time() + pause >= deadline
        ):
            return None
        return pause

    async def attempt(self, call: Callable[[], Awaitable[T]], seconds: float) -> T:
        """``await call()``, all of it within ``min(timeout_s, seconds)``."""
        seconds = min(seconds, self.config.timeout_s)
        with anyio.move_on_after(seconds):
            return await call()
        raise RequestTimeoutError(f"no complete answer within {seconds:.3g} s")

    def _failed(self, error: Exception, gated: bool) -> Failure:
        """Classify a failed attempt, count a timeout, and tell the breaker (``gated``)."""
        failure = classify(error)
        if failure is Failure.TIMEOUT:
            self.timeouts += 1
        if gated:
            self._observe(failure)
        return failure

    # -- the breaker ---------------------------------------------------------------------------

    async def admit(self) -> None:
        """Return if a request may go out now; raise `CircuitOpenError` if not (a checkpoint
        either way)."""
        verdict = self.breaker.admit()
        if verdict == "probe" and await self._probe():
            return
        await anyio.lowlevel.checkpoint()
        if verdict == "pass":
            return
        raise CircuitOpenError(
            f"obj tier {self.name!r}: {self.config.endpoint_url or 'AWS S3'} is unreachable; "
            f"circuit open, next probe in {self.breaker.retry_in():.1f} s"
        )

    async def _probe(self) -> bool:
        """One HEAD bucket after the open time, within ``min(timeout_s, lookup_timeout_s)``:
        whether the endpoint answers again."""
        try:
            await self.attempt(self._probe_call, self._probe_s)
        except Exception as exc:
            if self._failed(exc, gated=True) in (Failure.CONNECTION, Failure.TIMEOUT):
                log.info("obj endpoint still unreachable", tier=self.name, error=self.describe(exc))
                return False
        except BaseException:
            self.breaker.abandon_probe()  # cancelled: no verdict, due again at once
            raise
        self._observe(None)  # any answer, even an error, shows the endpoint is back
        return True

    def _observe(self, failure: Failure | None) -> None:
        """Tell the breaker how an attempt ended (None: it succeeded)."""
        if failure not in (Failure.CONNECTION, Failure.TIMEOUT):
            if self.breaker.succeeded():
                log.warning("obj endpoint reachable again; circuit closed", tier=self.name)
        elif self.breaker.failed(timeout=failure is Failure.TIMEOUT):
            log.warning(
                "obj endpoint unreachable; circuit open",
                tier=self.name,
                endpoint=self.config.endpoint_url or "AWS",
                failures=self.breaker.failures,
                timeouts=self.breaker.timeouts,
                open_s=self.breaker.open_s,
            )
