"""The eviction policies under one name, as they were imported before each had its own
module: the base classes (`policy`), `LRUPolicy` (`lru`) and `ARCPolicy` (`arc`).
``prefix`` lives in `prefix_policy`; `registry` builds all of them by name."""

from __future__ import annotations

from .arc import ARCPolicy, arc_choose
from .lru import LRUPolicy
from .policy import CachePolicy, RequestAccess, SlotTable

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "RequestAccess",
    "SlotTable",
    "arc_choose",
]
