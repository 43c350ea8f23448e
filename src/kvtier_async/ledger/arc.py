"""vLLM 0.33's ARC eviction policy (`ARCPolicy`), on the hooks of `policy.CachePolicy`, and
ARC's choice of victims (`arc_choose`), which `prefix_policy` shares.

**ARC.** vLLM's exactly: T1 (seen once) and T2 (reused) as plain recency lists, ghost lists
B1/B2 capped at the capacity; a ghost hit on a store miss moves the target size of T1
(B1: grow, B2: shrink); a finished request moves the ready keys it reused to T2's end and
the keys it only inserted to the end of their list; a `touch` promotes ready T1 keys and
adapts on ghosts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from .policy import CachePolicy, RequestAccess, SlotTable

__all__ = ["ARCPolicy", "arc_choose"]


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

    def eviction_order(self) -> list[bytes]:
        """Every held key, roughly in the order ARC would evict them (T1's oldest first,
        then T2's; the target size decides between them at each eviction)."""
        return [*self.t1, *self.t2]

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
