"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23) as an
eviction policy of the ledger (``eviction_policy: "s3fifo"``).

Three FIFO queues: *small* (S, a tenth of the capacity), *main* (M, the rest) and a *ghost*
queue (G) of keys evicted from S, no data, as many keys as 90% of the capacity. A key joins S
(M while the cache has never evicted and S is full), or M if G remembers it; a hit raises
its count and moves nothing. To evict: from M when M holds more than its share or S is
empty, else from S. S's oldest key leaves, to M (its count reset) if it was read at least
twice since it joined, else to G, evicted; M's oldest key goes if its count is 0, else it
goes back to M's head with its count (capped at 3) less one, a 2-bit CLOCK. So most keys
read once leave after a short stay in S (quick demotion), without touching M. The numbers
and the order of these choices are the authors' own (libCacheSim's ``S3FIFO.c``:
``small-size-ratio=0.10``, ``ghost-size-ratio=0.90``, ``move-to-main-threshold=2``).

A pinned, writing or protected key at a queue's end goes back to that queue's head with its
count kept. All or nothing: every move of a call is journalled and undone when too few keys
can go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from .keyed_policy import KeyedPolicy
from .policy import SlotTable

__all__ = ["S3FIFOPolicy"]

MAX_FREQ = 3
MOVE_TO_MAIN = 2  # reads in S that move a key to M (libCacheSim's default)
SMALL_RATIO = 0.10
GHOST_RATIO = 0.90

# Journal entries: how to undo one move (see `S3FIFOPolicy._undo`).
_S_TO_M, _S_TO_G, _S_BACK, _M_BACK, _M_OUT = range(5)


class S3FIFOPolicy(KeyedPolicy):
    """S3-FIFO: small, main and ghost FIFO queues (see the module docstring)."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self.small_capacity = max(1, int(SMALL_RATIO * capacity))
        self.ghost_capacity = max(1, int(GHOST_RATIO * capacity))
        self.small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}
        self.main_capacity = max(1, capacity - self.small_capacity)
        self.has_evicted = False

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def _read(self, keys: Sequence[bytes]) -> None:
        freq = self.freq
        for key in keys:
            count = freq.get(key)
            if count is not None:
                freq[key] = count + 1

    def _admit(self, key: bytes) -> None:
        ghost = self.ghost
        if key in ghost:
            del ghost[key]
            self.main[key] = None
        elif not self.has_evicted and len(self.small) >= self.small_capacity:
            self.main[key] = None
        else:
            self.small[key] = None
        self.freq[key] = 0

    def eviction_order(self) -> list[bytes]:
        freq = self.freq
        small_once = [k for k in self.small if freq[k] < MOVE_TO_MAIN]
        small_more = [k for k in self.small if freq[k] >= MOVE_TO_MAIN]
        main = sorted(self.main, key=freq.__getitem__)  # stable: FIFO order within a count
        return small_once + sorted(main + small_more, key=lambda k: min(freq[k], MAX_FREQ))

    def adopt(self, keys: Sequence[bytes]) -> None:
        # The coldest small-queue's worth joins S (the next to be judged), the rest M.
        cut = max(0, len(keys) - self.small_capacity)
        for key in keys[:cut]:
            self.main[key] = None
            self.freq[key] = 0
        for key in keys[cut:]:
            self.small[key] = None
            self.freq[key] = 0

    def remove(self, key: bytes) -> None:
        del self.freq[key]
        if key in self.small:
            del self.small[key]
        else:
            del self.main[key]

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        slot_of, ref = self.table.slot_of, self.table.ref
        small, main, ghost, freq = self.small, self.main, self.ghost, self.freq
        journal: list[tuple[int, bytes, int]] = []
        victims: list[bytes] = []
        # Keys passed over (pinned, writing, protected) in this call, per queue: once
        # every key left in a queue was passed over, nothing there can go.
        small_stuck: set[bytes] = set()
        main_stuck: set[bytes] = set()
        while len(victims) < n:
            small_open = len(small_stuck) < len(small)
            main_open = len(main_stuck) < len(main)
            if main_open and (len(main) > self.main_capacity or not small_open):
                key = next(iter(main))
                count = freq[key]
                main.move_to_end(key)
                if ref[slot_of[key]] != 0 or key in protected:
                    journal.append((_M_BACK, key, count))
                    main_stuck.add(key)
                    continue
                if count > 0:
                    freq[key] = min(count, MAX_FREQ) - 1
                    journal.append((_M_BACK, key, count))
                    continue
                del main[key]
                del freq[key]
                journal.append((_M_OUT, key, count))
                victims.append(key)
                continue
            if small_open:
                key = next(iter(small))
                if ref[slot_of[key]] != 0 or key in protected:
                    small.move_to_end(key)
                    journal.append((_S_BACK, key, 0))
                    small_stuck.add(key)
                    continue
                del small[key]
                count = freq[key]
                if count >= MOVE_TO_MAIN:
                    main[key] = None
                    freq[key] = 0
                    journal.append((_S_TO_M, key, count))
                    continue
                ghost[key] = None
                del freq[key]
                journal.append((_S_TO_G, key, count))
                victims.append(key)
                continue
            self._undo(journal)
            return None
        for _ in range(len(ghost) - self.ghost_capacity):
            ghost.popitem(last=False)
        self.has_evicted = True
        return victims

    def _undo(self, journal: list[tuple[int, bytes, int]]) -> None:
        small, main, ghost, freq = self.small, self.main, self.ghost, self.freq
        for op, key, count in reversed(journal):
            if op == _S_BACK:
                small.move_to_end(key, last=False)
            elif op == _S_TO_M:
                del main[key]
                small[key] = None
                small.move_to_end(key, last=False)
                freq[key] = count
            elif op == _S_TO_G:
                del ghost[key]
                small[key] = None
                small.move_to_end(key, last=False)
                freq[key] = count
            elif op == _M_BACK:
                main.move_to_end(key, last=False)
                freq[key] = count
            else:  # _M_OUT
                main[key] = None
                main.move_to_end(key, last=False)
                freq[key] = count

    def clear(self) -> None:
        for part in (self.small, self.main, self.ghost):
            part.clear()
        self.freq.clear()
        self.has_evicted = False
