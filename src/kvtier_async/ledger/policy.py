"""What the primary ledger asks of an eviction policy: the base classes (`CachePolicy`, the
`SlotTable` it reads, the `RequestAccess` of each request). The built-in policies are `lru`,
`arc`, `prefix_policy`, `reuse_policy`, the caching literature's `sieve`, `s3fifo` and
`tinylfu` (on `keyed_policy`), and `adaptive`, which follows the best of them on a sample of
the traffic; `registry` builds them, or your own, by name.

Theory of operation
-------------------
A policy orders the keys the ledger holds and picks victims; the ledger owns slots and
reference counts and shares them read-only through a `SlotTable`, so a policy can skip
pinned (``ref > 0``) and writing (``ref == -1``) keys without being told about each pin.

The signals and the decisions are vLLM 0.33's (``vllm/v1/kv_offload/cpu/policies``): the
ledger calls the same hooks at the same points as vLLM's ``CPUOffloadingManager``, with a
`RequestAccess` where vLLM passes a ``ReqContext``:

    insert(keys, req)                 new keys, being written for request ``req``
    remove(key)                       a failed write
    touch(keys)                       keys (head -> tail) used, outside any request
    on_store_miss(keys, req)          keys a request is about to store, once per request
    on_request_access(keys, req)      keys a request sees for the first time
    on_request_finished(order, inserted, reused, req)   the request's keys, head -> tail
    evict(n, protected)               all or nothing: the victims, or None and no change
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

from ._types import get_group_idx

__all__ = ["CachePolicy", "RequestAccess", "SlotTable"]


class SlotTable:
    """The ledger's key -> slot map and per-slot reference counts, shared with its policy."""

    __slots__ = ("ref", "slot_of")

    def __init__(self, num_slots: int) -> None:
        self.slot_of: dict[bytes, int] = {}
        self.ref: list[int] = [0] * num_slots


class RequestAccess:
    """What one request did, kept by the ledger while it runs: vLLM's ``_RequestCacheAccess``
    plus the key positions its ``ReqContext`` carries.

    ``seen`` maps the keys the request recorded, first time first, to their position in the
    request: the one the caller noted in ``noted``, or else the next one in record order;
    ``in_order`` says that record order is already head -> tail. ``policy_state`` belongs to
    the policy (LRU: the request's rank bucket).
    """

    __slots__ = (
        "in_order",
        "inserted",
        "last_position",
        "next_position",
        "noted",
        "policy_state",
        "reused",
        "seen",
        "store_misses",
    )

    def __init__(self) -> None:
        self.noted: dict[bytes, int] = {}
        self.seen: dict[bytes, int] = {}
        self.next_position = 1  # the next derived position: above every position so far
        self.last_position = -1  # the position of the key seen last
        self.in_order = True
        self.inserted: set[bytes] = set()
        self.reused: set[bytes] = set()
        self.store_misses: set[bytes] = set()
        self.policy_state: Any = None

    def order(self) -> list[bytes]:
        """The seen keys head -> tail: by position, then KV group, then first sight (the
        order vLLM's manager and ``order_request_keys`` give a request with positions)."""
        seen = self.seen
        if self.in_order:
            return list(seen)
        return sorted(seen, key=lambda key: (seen[key], get_group_idx(key)))


class CachePolicy(ABC):
    """What the ledger asks of a policy (the hooks of vLLM 0.33's ``CachePolicy``).

    Preconditions (guaranteed by the ledger): keys passed to `insert` are not held yet and
    were recorded by ``req``; keys passed to `remove` are held; `on_request_finished` is
    called once per request, after its last other hook.
    """

    #: Whether `on_store_miss` is wanted (else the ledger skips it and its bookkeeping).
    observes_store_misses = True

    def __init__(self, capacity: int, table: SlotTable) -> None:
        self.capacity = capacity
        self.table = table

    def _evictable(self, order: Iterable[bytes], protected: Collection[bytes]) -> Iterator[bytes]:
        """The keys of ``order``, in order, that may go now: readable, no reader, and not
        ``protected``."""
        slot_of, ref = self.table.slot_of, self.table.ref
        for key in order:
            if ref[slot_of[key]] == 0 and key not in protected:
                yield key

    @abstractmethod
    def insert(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        """New keys (being written, in offer order) join the cache for request ``req``."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget a key (a failed write)."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Keys (head -> tail, held or not) were used."""

    def on_store_miss(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        """Keys ``req`` is about to store, each seen once per request; like vLLM, a
        touch unless the policy knows better."""
        self.touch(keys)

    def on_request_access(  # noqa: B027 -- a hook: doing nothing is the default
        self, keys: Sequence[bytes], req: RequestAccess
    ) -> None:
        """Keys ``req`` records for the first time (held or not), in call order."""

    def on_request_finished(
        self,
        order: Sequence[bytes],
        inserted: Collection[bytes],
        reused: Collection[bytes],
        req: RequestAccess,
    ) -> None:
        """``req`` ended: ``order`` lists its keys head -> tail; keys in ``reused`` were
        ready keys it reused, keys in ``inserted`` but not ``reused`` it only stored."""
        self.touch(order)

    @abstractmethod
    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        """Pick and forget ``n`` evictable keys not in ``protected``; or return None and
        change nothing."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, adaptive state included."""
