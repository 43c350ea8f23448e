"""The base of the per-key policies of the caching literature (`sieve`, `s3fifo`,
`tinylfu`): the ledger's hooks reduced to what those papers' caches see, a read of a key
(a hit, or a miss) and the admission of a key.

The papers' caches see one request for one object at a time; a request of the ledger reads a
chain of keys, head first, and stores the keys it missed. So:

- a key a request records for the first time (`on_request_access`) is a *read*: a hit if
  the cache holds it, else a miss (which a frequency sketch counts too); `touch` reads
  keys outside any request. A request's end (`on_request_finished`) reads nothing again:
  each request reads each of its keys once.
- `insert` admits a request's new keys *tail first*, so that a queue's coldest end holds a
  chain's tail, not its head: a prefix cache reads a chain until its first miss, so a head
  evicted first would leave the rest of the chain unreadable.
- `evict` is all or nothing, as the ledger needs: a policy whose eviction moves keys
  between its queues keeps a journal of the moves and undoes them when too few keys can go.

Each policy also gives `eviction_order` (held keys, coldest first, as it would pick them if
none were pinned) and `adopt` (start from held keys, coldest first): `adaptive` moves the
keys from one policy to another with them when it switches.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection, Sequence

from .policy import CachePolicy, RequestAccess

__all__ = ["KeyedPolicy"]


class KeyedPolicy(CachePolicy):
    """A policy of per-key reads and admissions (see the module docstring)."""

    observes_store_misses = False  # a store miss is read by `on_request_access` already

    # --- what a policy implements ---------------------------------------------------------

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the policy holds ``key``."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys the policy holds."""

    @abstractmethod
    def _read(self, keys: Sequence[bytes]) -> None:
        """A read of each of ``keys`` (held ones are hits), in order."""

    @abstractmethod
    def _admit(self, key: bytes) -> None:
        """``key`` joins the cache."""

    @abstractmethod
    def eviction_order(self) -> list[bytes]:
        """The held keys, coldest first (the order of victims if none were pinned)."""

    def adopt(self, keys: Sequence[bytes]) -> None:
        """Start from ``keys`` (held, coldest first), as if admitted in that order; the
        policy is empty before. Policies with several queues override it."""
        for key in keys:
            self._admit(key)

    # --- the ledger's hooks ---------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        for key in reversed(keys):
            self._admit(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._read(keys)

    def on_store_miss(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        return

    def on_request_access(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        self._read(keys)

    def on_request_finished(
        self,
        order: Sequence[bytes],
        inserted: Collection[bytes],
        reused: Collection[bytes],
        req: RequestAccess,
    ) -> None:
        return

    def _can_go(self, key: bytes, protected: Collection[bytes]) -> bool:
        """Whether ``key`` may be evicted now: readable, no reader, not protected."""
        return self.table.ref[self.table.slot_of[key]] == 0 and key not in protected
