"""The obj tier's exceptions.

``open`` raises a `TierOpenError` subclass that says what to fix, naming config fields:
`EndpointUnreachableError` (a `ConnectionError`), `BucketNotFoundError` (a `LookupError`),
`AccessDeniedError` (a `PermissionError`: credentials rejected, or access denied). While the
circuit is open, ``store`` and ``load`` raise `CircuitOpenError` without I/O; an attempt of a
request that gets no complete answer in time ends as `RequestTimeoutError`.
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "CircuitOpenError",
    "EndpointUnreachableError",
    "RequestTimeoutError",
    "TierOpenError",
]


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
