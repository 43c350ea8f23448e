"""Data movement between devices and the CPU tier: KV views, copy plans, copiers, handlers.

`canonicalize` views any attention backend's KV caches as byte pages per block;
`TransferRouter` moves a (GPUSpec, CPUSpec) pair between those pages and the CPU tier's
slots with the handler for the pair's media (the vLLM worker's path); `BlockCopier` moves
whole caller blocks (the async API's path). Both plan byte copies (`CopyPlan`) and run them
with the same plan copiers (`HostPlanCopier`, `CudaPlanCopier`); `EventBridge` wakes the
awaiting job when a device copy completes.
"""

from .blocks import BlockCopier, DeviceBlock
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
from .copier import CudaPlanCopier, HostPlanCopier
from .handlers import (
    CudaCopyHandler,
    HostCopyHandler,
    TransferError,
    TransferHandler,
    TransferResult,
    TransferRouter,
)
from .plan import CopyPlan, HostSlots, Planner, plan_transfer

__all__ = [
    "BlockCopier",
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
    "CudaPlanCopier",
    "DeviceBlock",
    "EventBridge",
    "HostCopyHandler",
    "HostPlanCopier",
    "HostSlots",
    "Planner",
    "SlotLayout",
    "TransferError",
    "TransferHandler",
    "TransferResult",
    "TransferRouter",
    "canonicalize",
    "plan_transfer",
]
