"""Worker-side data movement: canonical KV views, copy plans, handlers, the event bridge.

`canonicalize` views any attention backend's KV caches as byte pages per block;
`TransferRouter` moves a (GPUSpec, CPUSpec) pair between those pages and the CPU tier's
slots with the handler for the pair's media; `EventBridge` wakes the awaiting job when a
device copy completes.
"""

from .bridge import (
    BridgeClosedError,
    BridgeStatistics,
    BridgeStrategy,
    CompletionEvent,
    EventBridge,
)
from .canonical import (
    ByteRun,
    CanonicalKV,
    CanonicalLayoutError,
    CanonicalView,
    SlotLayout,
    canonicalize,
)
from .handlers import (
    CudaCopyHandler,
    HostCopyHandler,
    TransferError,
    TransferHandler,
    TransferResult,
    TransferRouter,
)
from .plan import CopyPlan, HostSlots, plan_transfer

__all__ = [
    "BridgeClosedError",
    "BridgeStatistics",
    "BridgeStrategy",
    "ByteRun",
    "CanonicalKV",
    "CanonicalLayoutError",
    "CanonicalView",
    "CompletionEvent",
    "CopyPlan",
    "CudaCopyHandler",
    "EventBridge",
    "HostCopyHandler",
    "HostSlots",
    "SlotLayout",
    "TransferError",
    "TransferHandler",
    "TransferResult",
    "TransferRouter",
    "canonicalize",
    "plan_transfer",
]
