"""Library logging: structlog's API on top of the standard library's ``logging``.

Libraries log; applications configure. Every logger made here wraps ``logging.getLogger(name)``
with its own processor chain, so a line goes to whatever handlers the host (vLLM, a server, the
``kvtier`` CLI) installed, and nothing is printed when the host installed none. Library code
never calls ``structlog.configure()`` or ``logging.basicConfig()``.

A line reaches ``logging`` as one message, ``event key=value ...``, with the caller's file and
line, so a host's plain ``logging.Formatter`` shows it well. Because the chain is not the global
structlog one, ``structlog.testing.capture_logs()`` does not see these lines: assert on them
with pytest's ``caplog`` instead.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = ["get_logger"]

# Frames between the caller and ``logging.Logger.<method>``: structlog's BoundLogger.<method>,
# its _proxy_to_logger, and BoundLoggerBase._proxy_to_logger. Python 3.10 counts one more frame
# (it did not skip logging's own frames before counting; fixed in 3.11).
_STACKLEVEL = 4


def _render(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> Any:
    """Turn the event dict into ``logging`` arguments: one message plus exc/stack info."""
    exc_info = event_dict.pop("exc_info", None)
    stack_info = bool(event_dict.pop("stack_info", False))
    event = str(event_dict.pop("event", ""))
    pairs = " ".join(f"{key}={value!r}" for key, value in event_dict.items())
    message = f"{event} {pairs}" if pairs else event
    options = {"exc_info": exc_info, "stack_info": stack_info, "stacklevel": _STACKLEVEL}
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
