"""The obj tier's circuit breaker: plain synchronous bookkeeping, the tier does the I/O.

After ``threshold`` consecutive connection failures, or ``timeouts`` timeouts without an
answer in between, the circuit opens for ``open_s`` (a refused connection costs nothing, a
timeout costs ``timeout_s``: two are enough to know). While it is open, calls are rejected
with no I/O; then the next call is told to probe, and the probe's outcome closes the circuit
or opens it again. The clock is injectable for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

__all__ = [
    "DEFAULT_BREAKER_OPEN_S",
    "DEFAULT_BREAKER_THRESHOLD",
    "DEFAULT_BREAKER_TIMEOUTS",
    "Breaker",
]

DEFAULT_BREAKER_THRESHOLD: Final = 5
DEFAULT_BREAKER_TIMEOUTS: Final = 2
DEFAULT_BREAKER_OPEN_S: Final = 5.0


class Breaker:
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
