"""The sans-I/O ledger: keys, transfer specs, eviction policies and the primary tier's books.

Everything here is synchronous and single-owner; see `primary` for the state machine.
"""

from ._types import (
    CPUSpec,
    GPUSpec,
    JobKind,
    LedgerError,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    TierSpec,
    get_group_idx,
    make_offload_key,
    make_offload_keys,
    split_offload_key,
)
from .arc import ARCPolicy
from .counters import DeviceCounters, TierCounters
from .keys import prefix_keys
from .lru import LRUPolicy
from .policy import CachePolicy, RequestAccess, SlotTable
from .primary import LedgerStatistics, PrimaryLedger
from .registry import BUILTIN_POLICIES, check_policy, make_policy
from .tiering import StorePolicy, TieringLedger, TierTask

__all__ = [
    "BUILTIN_POLICIES",
    "ARCPolicy",
    "CPUSpec",
    "CachePolicy",
    "DeviceCounters",
    "GPUSpec",
    "JobKind",
    "LRUPolicy",
    "LedgerError",
    "LedgerStatistics",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "PrimaryLedger",
    "RequestAccess",
    "SlotTable",
    "StorePolicy",
    "TierCounters",
    "TierSpec",
    "TierTask",
    "TieringLedger",
    "check_policy",
    "get_group_idx",
    "make_offload_key",
    "make_offload_keys",
    "make_policy",
    "prefix_keys",
    "split_offload_key",
]
