"""vLLM 0.33's LRU eviction policy (`LRUPolicy`), on the hooks of `policy.CachePolicy`.

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
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator, Sequence

from .policy import CachePolicy, RequestAccess, SlotTable

__all__ = ["LRUPolicy"]


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

    def eviction_order(self) -> list[bytes]:
        """Every held key, the next victim first, pins and protection aside."""
        return [key for bucket in self._buckets.values() for key in bucket.coldest_first()]

    def clear(self) -> None:
        self._buckets.clear()
        self._where.clear()
        self._open = None
        self._next_rank = 0
