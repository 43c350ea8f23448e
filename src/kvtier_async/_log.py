"""Library logging: structlog's API on top of the standard library's ``logging``.

Libraries log; applications configure. Every logger made here wraps ``logging.getLogger(name)``
with its own processor chain, so a line goes to whatever handlers the host (vLLM, a server, the
``kvtier`` CLI) installed, and nothing is printed when the host installed none. Library code
never calls ``structlog.configure()`` or ``logging.basicConfig()``.

A line reaches ``logging`` as one message, ``event key=value ...``, with the caller's file and
line, so a host's plain ``logging.Formatter`` shows it well. Because the chain is not the global
structlog one, ``structlog.testing.capture_logs()`` does not see these lines: assert on them
with pytest's ``caplog`` instead.

`RateLimited` keeps a repeated warning from flooding the host's log (one per failed job while
a circuit is open or a disk is full): the first line goes out, repeats within ``interval_s``
are counted, and the next line after the interval says how many there were
(``obj store failed (37 more in the last 10 s) tier='obj[1]' ...``). A lane or a tier makes
one and calls it instead of ``log.warning``; ``suppressed`` feeds its statistics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = ["RateLimited", "get_logger"]

# Frames between the caller and ``logging.Logger.<method>``: structlog's BoundLogger.<method>,
# its _proxy_to_logger, and BoundLoggerBase._proxy_to_logger. Python 3.10 counts one more frame
# (it did not skip logging's own frames before counting; fixed in 3.11).
_STACKLEVEL = 4


def _render(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> Any:
    """Turn the event dict into ``logging`` arguments: one message plus exc/stack info."""
    exc_info = event_dict.pop("exc_info", None)
    stack_info = bool(event_dict.pop("stack_info", False))
    extra_frames = int(event_dict.pop("_extra_frames", 0))  # a wrapper's own frames
    event = str(event_dict.pop("event", ""))
    pairs = " ".join(f"{key}={value!r}" for key, value in event_dict.items())
    message = f"{event} {pairs}" if pairs else event
    options = {
        "exc_info": exc_info,
        "stack_info": stack_info,
        "stacklevel": _STACKLEVEL + extra_frames,
    }
    return (message,), options


_PROCESSORS: list[Processor] = [
    structlog.stdlib.filter_by_level,
    structlog.stdlib.PositionalArgumentsFormatter(),
    _render,
]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """Return a structlog logger that writes through ``logging.getLogger(name)``.

    Binding is lazy, so calling this at module scope is cheap and binds nothing.
    """
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return logger


class RateLimited:
    """Logs each event at most once per ``interval_s``; repeats in between are counted.

    ``warn = RateLimited(log)``, then ``warn("store failed", tier=...)`` where the code said
    ``log.warning(...)``. Each event text has its own window. The line that ends a window
    carries the count, ``store failed (37 more in the last 10 s) tier=...``, and the fields
    of the call that sent it. Thread-safe; the record points at the caller's line.
    """

    def __init__(
        self,
        logger: structlog.stdlib.BoundLogger,
        interval_s: float = 10.0,
        *,
        level: str = "warning",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = getattr(logger, level)
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, list[float]] = {}  # event -> [window start, repeats]
        self.suppressed = 0  # repeats not logged, in all

    def __call__(self, event: str, **fields: Any) -> bool:
        """Log ``event`` unless it went out less than ``interval_s`` ago; whether it did."""
        with self._lock:
            now = self._clock()
            window = self._windows.get(event)
            if window is not None and now - window[0] < self.interval_s:
                window[1] += 1
                self.suppressed += 1
                return False
            self._windows[event] = [now, 0]
        if window is not None and window[1]:
            event = f"{event} ({window[1]:.0f} more in the last {now - window[0]:.0f} s)"
        self._emit(event, _extra_frames=1, **fields)
        return True
