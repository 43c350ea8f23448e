"""SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI'24) as an eviction policy of the
ledger (``eviction_policy: "sieve"``).

One FIFO queue and a *hand*. A key joins at the head; a hit sets its *visited* bit and
moves nothing. To evict, the hand walks from where it stopped towards the head (wrapping to
the tail): a visited key loses its bit and stays where it is, the first unvisited key goes,
and the hand stops at the key after it. New keys and the keys that survived a pass are not
mixed: a key read once goes at the hand's next pass (quick demotion), a key read again
survives it (lazy promotion).

The queue is a list, coldest (tail) first, with holes where keys left (compacted when the
holes are half of it); the hand is an index into it. A pinned, writing or protected key is
passed over with its bit unchanged. All or nothing: the victims are found before anything
changes (two passes at most: the first clears bits, the second finds every key it cleared
unvisited).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .keyed_policy import KeyedPolicy
from .policy import SlotTable

__all__ = ["SievePolicy"]


class SievePolicy(KeyedPolicy):
    """SIEVE: a FIFO queue, a visited bit per key, a hand (see the module docstring)."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self._queue: list[bytes | None] = []  # tail (coldest) first; None: a hole
        self._index: dict[bytes, int] = {}
        self._visited: set[bytes] = set()
        self._hand = 0

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def visited(self, key: bytes) -> bool:
        """Whether ``key``'s visited bit is set."""
        return key in self._visited

    def queue(self) -> list[bytes]:
        """The held keys, tail (oldest) first; `hand_key` is where the hand is."""
        return [key for key in self._queue if key is not None]

    def hand_key(self) -> bytes | None:
        """The key the hand points at (the next one it examines), or None when empty."""
        queue, n = self._queue, len(self._queue)
        for step in range(n):
            key = queue[(self._hand + step) % n]
            if key is not None:
                return key
        return None

    def _read(self, keys: Sequence[bytes]) -> None:
        index = self._index
        self._visited.update(key for key in keys if key in index)

    def _admit(self, key: bytes) -> None:
        self._index[key] = len(self._queue)
        self._queue.append(key)

    def eviction_order(self) -> list[bytes]:
        # The hand's walk: unvisited keys from the hand on, then the visited ones (in the
        # same walk, as the second pass reaches them).
        queue, visited = self._queue, self._visited
        start = self._hand if self._hand < len(queue) else 0
        walk = [key for key in queue[start:] + queue[:start] if key is not None]
        return [k for k in walk if k not in visited] + [k for k in walk if k in visited]

    def remove(self, key: bytes) -> None:
        self._queue[self._index.pop(key)] = None
        self._visited.discard(key)
        self._compact()

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        queue, visited = self._queue, self._visited
        size = len(queue)
        if size == 0:
            return None
        slot_of, ref = self.table.slot_of, self.table.ref
        victims: list[bytes] = []
        chosen: set[bytes] = set()
        cleared: set[bytes] = set()
        i = self._hand if self._hand < size else 0
        for _ in range(2 * size):
            key = queue[i]
            i += 1
            if i == size:
                i = 0
            if key is None or key in chosen:
                continue
            if ref[slot_of[key]] != 0 or key in protected:
                continue
            if key in visited and key not in cleared:
                cleared.add(key)
                continue
            victims.append(key)
            chosen.add(key)
            if len(victims) == n:
                break
        else:
            return None
        visited -= cleared
        visited -= chosen
        index = self._index
        for key in victims:
            queue[index.pop(key)] = None
        self._hand = i
        self._compact()
        return victims

    def _compact(self) -> None:
        queue = self._queue
        holes = len(queue) - len(self._index)
        if holes < 32 or 2 * holes < len(queue):
            return
        hand = self._hand
        before = sum(1 for key in queue[:hand] if key is not None)
        live = [key for key in queue if key is not None]
        self._queue = list[bytes | None](live)
        self._index = {key: i for i, key in enumerate(live)}
        self._hand = before if before < len(live) else 0

    def adopt(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._admit(key)
        self._hand = 0

    def clear(self) -> None:
        self._queue.clear()
        self._index.clear()
        self._visited.clear()
        self._hand = 0
