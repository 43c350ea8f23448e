"""Eviction policies of the primary ledger: the base classes, LRU and ARC; `registry` builds
them and ``prefix`` (in `prefix_policy`) by name, or your own by module path.

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

**LRU.** vLLM ranks every key with a tuple and evicts the smallest first, ties broken on the
key bytes: a running request has one rank number, drawn from a global counter at its first
interaction, and gives the keys it inserts or first sees ``(its rank, -position)`` (a key
only ever moves up: a request started later pulls shared keys into its rank, an earlier one
does not); a finished request and a `touch` give each key a fresh global rank, tail first,
so the head ends most recent. vLLM keeps a lazily invalidated heap; we keep *buckets* in
rank order. A rank number is drawn only when a bucket is created, so buckets are appended
to a dict and never move: a request's bucket (its rank: created when the request draws it;
when it finishes, dropped, or turned into the open fresh bucket under a new rank when it
holds every key the request ranks) holds keys by ``(-position, key)``, which as a rule
arrive head -> tail and are iterated backwards (a scan that reaches the bucket after keys
arrived checks the order, and sorts it if need be); a fresh bucket holds keys in the order
their ranks were drawn, and takes more fresh ranks until another rank number is drawn.
Moving a key is O(1); a victim scan walks buckets from the oldest, O(victims + skipped).

**ARC.** vLLM's exactly: T1 (seen once) and T2 (reused) as plain recency lists, ghost lists
B1/B2 capped at the capacity; a ghost hit on a store miss moves the target size of T1
(B1: grow, B2: shrink); a finished request moves the ready keys it reused to T2's end and
the keys it only inserted to the end of their list; a `touch` promotes ready T1 keys and
adapts on ghosts.

**prefix** is not vLLM's: it lives in `prefix_policy` (private chains by recency, shared
prefixes by decayed frequency, ARC's adaptive split between the two) and takes the same calls.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

from ._types import get_group_idx

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "RequestAccess",
    "SlotTable",
]


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


class _Bucket:
    """Keys sharing a rank number (a request's) or holding consecutive fresh ranks."""

    __slots__ = ("keys", "live", "ordered", "rank", "request")

    def __init__(self, rank: int, request: bool) -> None:
        self.rank = rank
        self.request = request  # keys by (-position, key), coldest last in the dict
        self.live = request  # a running request's bucket stays while empty
        self.keys: dict[bytes, int] = {}  # key -> -position (0 in a fresh bucket)
        self.ordered = True  # a request bucket's dict is known to be in order

    def coldest_first(self) -> Iterator[bytes]:
        if not self.request:
            return iter(self.keys)
        if not self.ordered:  # keys arrive head -> tail as a rule: a linear check first
            items = list(self.keys.items())
            if any(_later(a, b) for a, b in itertools.pairwise(items)):
                items.sort(key=lambda item: (item[1], item[0]), reverse=True)
                self.keys = dict(items)
            self.ordered = True
        return reversed(self.keys)


def _later(a: tuple[bytes, int], b: tuple[bytes, int]) -> bool:
    """Whether request-bucket item ``b`` must be evicted after ``a`` (out of dict order)."""
    return b[1] > a[1] or (b[1] == a[1] and b[0] > a[0])


class LRUPolicy(CachePolicy):
    """vLLM 0.33's request-ranked LRU (see the module docstring), in O(1) per moved key."""

    observes_store_misses = False  # vLLM's LRU touches them: absent keys, nothing to do

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self._buckets: dict[int, _Bucket] = {}  # rank order, oldest first
        self._where: dict[bytes, _Bucket] = {}
        self._open: _Bucket | None = None  # the fresh bucket the next fresh rank joins
        self._next_rank = 0

    def _new_bucket(self, request: bool) -> _Bucket:
        self._next_rank += 1
        bucket = _Bucket(self._next_rank, request)
        self._buckets[bucket.rank] = bucket
        self._open = None if request else bucket
        return bucket

    def _request_bucket(self, req: RequestAccess) -> _Bucket:
        bucket: _Bucket | None = req.policy_state
        if bucket is None:
            bucket = req.policy_state = self._new_bucket(True)
        return bucket

    def _emptied(self, bucket: _Bucket) -> None:
        """A bucket lost its last key: it goes, unless a running request owns it."""
        if not bucket.live:
            del self._buckets[bucket.rank]
            if bucket is self._open:
                self._open = None

    def _refresh(self, keys: Iterable[bytes]) -> None:
        """A fresh rank for each held key, in order (vLLM's ``_update_recency``): each goes
        to the end of the open fresh bucket."""
        where, bucket = self._where, self._open
        for key in keys:
            old = where.get(key)
            if old is None:
                continue
            if bucket is None:  # the first fresh rank since another rank was drawn
                bucket = self._new_bucket(False)
            if old is bucket:
                del bucket.keys[key]
            else:
                old_keys = old.keys
                del old_keys[key]
                if not old_keys:
                    self._emptied(old)  # never the open bucket: that is ``bucket``
                where[key] = bucket
            bucket.keys[key] = 0

    def insert(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        where, positions = self._where, req.seen
        mine: _Bucket | None = req.policy_state
        for key in keys:
            position = positions.get(key)
            if position is None:
                self._fresh_insert(key)
                continue
            if mine is None:
                mine = self._request_bucket(req)
            mine.keys[key] = -position
            where[key] = mine
        if mine is not None:
            mine.ordered = False

    def _fresh_insert(self, key: bytes) -> None:
        bucket = self._open
        if bucket is None:
            bucket = self._new_bucket(False)
        bucket.keys[key] = 0
        self._where[key] = bucket

    def remove(self, key: bytes) -> None:
        bucket = self._where.pop(key)
        del bucket.keys[key]
        if not bucket.keys:
            self._emptied(bucket)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._refresh(reversed(keys))

    def on_store_miss(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        return

    def on_request_access(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        mine = self._request_bucket(req)
        rank, mine_keys = mine.rank, mine.keys
        where, positions = self._where, req.seen
        moved = False
        for key in keys:
            old = where.get(key)
            if old is None or old.rank > rank:
                continue
            position = positions.get(key)
            if position is None:
                continue
            neg = -position
            if old is mine:  # (vLLM: a rank only rises)
                if mine_keys[key] >= neg:
                    continue
                del mine_keys[key]
            else:
                old_keys = old.keys
                del old_keys[key]
                if not old_keys:
                    self._emptied(old)
                where[key] = mine
            mine_keys[key] = neg
            moved = True
        if moved:
            mine.ordered = False

    def on_request_finished(
        self,
        order: Sequence[bytes],
        inserted: Collection[bytes],
        reused: Collection[bytes],
        req: RequestAccess,
    ) -> None:
        mine: _Bucket | None = req.policy_state
        if mine is None:
            self._refresh(reversed(order))
            return
        req.policy_state = None
        mine.live = False
        where = self._where
        tail_first = [key for key in reversed(order) if key in where]
        if len(tail_first) == len(mine.keys):  # all in ``mine`` (which holds only these)
            del self._buckets[mine.rank]
            if tail_first:  # ``mine`` becomes the open fresh bucket: its keys stay put
                self._next_rank += 1
                mine.rank, mine.request, mine.ordered = self._next_rank, False, True
                mine.keys = dict.fromkeys(tail_first, 0)
                self._buckets[mine.rank] = self._open = mine
            return
        bucket = self._open
        left = len(mine.keys)  # every key ranked by the request is in ``order``
        for key in tail_first:  # _refresh, leaving ``mine`` to be dropped whole
            old = where[key]
            if bucket is None:
                bucket = self._new_bucket(False)
            if old is mine:
                left -= 1
            elif old is bucket:
                del bucket.keys[key]
            else:
                old_keys = old.keys
                del old_keys[key]
                if not old_keys:
                    self._emptied(old)
            where[key] = bucket
            bucket.keys[key] = 0
        if left:  # not so (a policy bug): keep what is left
            mine.keys = {key: neg for key, neg in mine.keys.items() if where[key] is mine}
            mine.ordered = False
        else:
            del self._buckets[mine.rank]

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        slot_of, ref = self.table.slot_of, self.table.ref
        victims: list[bytes] = []
        for bucket in self._buckets.values():
            if not bucket.keys:
                continue
            for key in bucket.coldest_first():
                if ref[slot_of[key]] == 0 and key not in protected:
                    victims.append(key)
                    if len(victims) == n:
                        break
            else:
                continue
            break
        else:
            return None
        where = self._where
        for key in victims:
            bucket = where.pop(key)
            bucket_keys = bucket.keys
            del bucket_keys[key]
            if not bucket_keys:
                self._emptied(bucket)
        return victims

    def clear(self) -> None:
        self._buckets.clear()
        self._where.clear()
        self._open = None
        self._next_rank = 0


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache, as vLLM 0.33 runs it (see the module docstring)."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self.target_t1 = 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        t1 = self.t1
        for key in keys:
            t1[key] = None
        for ghost in (self.b1, self.b2):
            if ghost:
                for key in ghost.keys() & keys:
                    del ghost[key]

    def remove(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def touch(self, keys: Sequence[bytes]) -> None:
        t1, t2 = self.t1, self.t2
        slot_of, ref = self.table.slot_of, self.table.ref
        for key in reversed(keys):
            if key in t1:
                if ref[slot_of[key]] < 0:  # still being written: not a second use
                    t1.move_to_end(key)
                else:
                    del t1[key]
                    t2[key] = None
            elif key in t2:
                t2.move_to_end(key)
            else:
                self._adapt(key)

    def _adapt(self, key: bytes) -> None:
        """A ghost hit moves the target size of T1 (B1: favour recency)."""
        b1, b2 = self.b1, self.b2
        if key in b1:
            delta = max(1.0, len(b2) / len(b1))
            self.target_t1 = min(self.target_t1 + delta, float(self.capacity))
            b1.move_to_end(key)
        elif key in b2:
            delta = max(1.0, len(b1) / len(b2))
            self.target_t1 = max(self.target_t1 - delta, 0.0)
            b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        ghosts = self.b1.keys() & keys
        ghosts.update(self.b2.keys() & keys)
        if ghosts:
            for key in reversed(keys):
                if key in ghosts:
                    self._adapt(key)

    def on_request_finished(
        self,
        order: Sequence[bytes],
        inserted: Collection[bytes],
        reused: Collection[bytes],
        req: RequestAccess,
    ) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(order):
            if key in reused:  # a ready key reused: one more access
                if key in t1:
                    del t1[key]
                    t2[key] = None
                elif key in t2:
                    t2.move_to_end(key)
            elif key in inserted:  # only stored: recency, not frequency
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        victims = self._select(n, protected, int(self.target_t1))
        if victims is None:
            return None
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for key, from_t1 in victims:
            if from_t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
        for ghost in (b1, b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return [key for key, _ in victims]

    def _select(
        self, n: int, protected: Collection[bytes], target: int
    ) -> list[tuple[bytes, bool]] | None:
        """vLLM's choice (`arc_choose`) between T1 and T2."""
        return arc_choose(
            self._evictable(self.t1, protected),
            self._evictable(self.t2, protected),
            len(self.t1),
            target,
            n,
        )

    def clear(self) -> None:
        self.target_t1 = 0.0
        for order in (self.t1, self.t2, self.b1, self.b2):
            order.clear()


def arc_choose(
    recent: Iterator[bytes], frequent: Iterator[bytes], recent_size: int, target: int, n: int
) -> list[tuple[bytes, bool]] | None:
    """ARC's choice of ``n`` victims, as vLLM makes it: from the recent list while its
    (virtual) size is at least ``target``, else from the frequent list, else from the recent
    one after all; one forward scan of each iterator (of evictable keys, coldest first).
    Returns (key, from the recent list) pairs, or None if fewer than ``n`` can go."""
    victims: list[tuple[bytes, bool]] = []
    while len(victims) < n:
        key = next(recent, None) if recent_size >= target else None
        from_recent = key is not None
        if key is None:
            key = next(frequent, None)
        if key is None:
            key = next(recent, None)
            from_recent = True
        if key is None:
            return None
        recent_size -= from_recent
        victims.append((key, from_recent))
    return victims
