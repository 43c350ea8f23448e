"""W-TinyLFU (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission
Policy", ACM TOS 2017; Caffeine's eviction) as an eviction policy of the ledger
(``eviction_policy: "tinylfu"``).

A *window* LRU (1% of the capacity) in front of a *main* segmented LRU (its *probation*
segment, and a *protected* one of 80% of the main part), and a count-min sketch of how often
each key was read, hits and misses alike. A new key joins the window. When the window is
over its size, its least recent key is a *candidate* for the main part and duels the main
part's *victim* (probation's least recent key): the one the sketch counts fewer reads of is
evicted (the victim wins ties, as in Caffeine), the other stays, a candidate joining
probation's most recent end. A hit in the window or in protected makes the key its
segment's most recent; in probation, it moves the key to protected, whose least recent key
goes back to probation when protected is over its size. So a key read once rarely pushes out
a key read often: the sketch is the admission filter.

The sketch (`FrequencySketch`): 4 rows of 4-bit counters, ``width`` (a power of two at least
the capacity) each; a read adds one to the key's counter in each row (saturating at 15), a
key's estimate is the smallest of its four; after ``10 * capacity`` reads every counter is
halved (the paper's *reset*: old reads fade). The rows' indices come from a CRC-32 of the
key's bytes, so a run is the same in every process.

Keys pinned, being written or protected are passed over. All or nothing: every move of a
call is journalled and undone when too few keys can go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from zlib import crc32

from .keyed_policy import KeyedPolicy
from .policy import SlotTable

__all__ = ["FrequencySketch", "TinyLFUPolicy"]

WINDOW_RATIO = 0.01
PROTECTED_RATIO = 0.80
SAMPLE_FACTOR = 10  # reads per capacity between resets
_MIX = 0x9E3779B97F4A7C15
_MIX2 = 0xBF58476D1CE4E5B9
_M64 = (1 << 64) - 1
_HALVE = bytes(v >> 1 for v in range(256))


class FrequencySketch:
    """A count-min sketch of 4-bit counters with periodic halving (see the module docstring)."""

    __slots__ = ("additions", "sample_size", "shift", "table", "width")

    def __init__(self, capacity: int) -> None:
        width = 16
        while width < capacity:
            width *= 2
        self.width = width
        self.shift = 64 - (width.bit_length() - 1)  # a hash's top bits index a row
        self.table = bytearray(4 * width)
        self.sample_size = SAMPLE_FACTOR * max(1, capacity)
        self.additions = 0

    def _indices(self, key: bytes) -> tuple[int, int, int, int]:
        # Four rows' indices by double hashing on a 64-bit mix of the key's CRC-32.
        h1 = (crc32(key) * _MIX) & _M64
        h2 = (((h1 ^ (h1 >> 31)) * _MIX2) & _M64) | 1
        s, w = self.shift, self.width
        return (
            h1 >> s,
            w + (((h1 + h2) & _M64) >> s),
            2 * w + (((h1 + 2 * h2) & _M64) >> s),
            3 * w + (((h1 + 3 * h2) & _M64) >> s),
        )

    def add(self, key: bytes) -> None:
        table = self.table
        for i in self._indices(key):
            count = table[i]
            if count < 15:
                table[i] = count + 1
        self.additions += 1
        if self.additions >= self.sample_size:
            self.table = self.table.translate(_HALVE)
            self.additions //= 2

    def estimate(self, key: bytes) -> int:
        table = self.table
        return min(table[i] for i in self._indices(key))

    def clear(self) -> None:
        self.table = bytearray(len(self.table))
        self.additions = 0


# Journal entries: how to undo one move (see `TinyLFUPolicy._undo`).
_W_TO_P, _W_OUT, _W_BACK, _P_OUT, _P_BACK, _Q_OUT, _Q_BACK = range(7)


class TinyLFUPolicy(KeyedPolicy):
    """W-TinyLFU: window LRU, segmented main LRU, a frequency sketch (module docstring)."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self.window_capacity = max(1, int(WINDOW_RATIO * capacity))
        main = max(1, capacity - self.window_capacity)
        self.protected_capacity = max(1, int(PROTECTED_RATIO * main))
        self.window: OrderedDict[bytes, None] = OrderedDict()  # least recent first
        self.probation: OrderedDict[bytes, None] = OrderedDict()
        self.protected: OrderedDict[bytes, None] = OrderedDict()
        self.sketch = FrequencySketch(capacity)

    def __contains__(self, key: object) -> bool:
        return key in self.window or key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)

    def _read(self, keys: Sequence[bytes]) -> None:
        add = self.sketch.add
        window, probation, protected = self.window, self.probation, self.protected
        for key in keys:
            add(key)
            if key in window:
                window.move_to_end(key)
            elif key in protected:
                protected.move_to_end(key)
            elif key in probation:  # promoted
                del probation[key]
                protected[key] = None
                if len(protected) > self.protected_capacity:
                    demoted, _ = protected.popitem(last=False)
                    probation[demoted] = None

    def _admit(self, key: bytes) -> None:
        window = self.window
        window[key] = None
        if len(window) > self.window_capacity:  # the cache has room: no duel
            older, _ = window.popitem(last=False)
            self.probation[older] = None

    def eviction_order(self) -> list[bytes]:
        return [*self.probation, *self.protected, *self.window]

    def adopt(self, keys: Sequence[bytes]) -> None:
        # The warmest window's worth joins the window, the rest probation, in order.
        cut = max(0, len(keys) - self.window_capacity)
        for key in keys[:cut]:
            self.probation[key] = None
        for key in keys[cut:]:
            self.window[key] = None

    def remove(self, key: bytes) -> None:
        for segment in (self.window, self.probation, self.protected):
            if key in segment:
                del segment[key]
                return

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        slot_of, ref = self.table.slot_of, self.table.ref
        window, probation, guarded = self.window, self.probation, self.protected
        estimate = self.sketch.estimate
        journal: list[tuple[int, bytes]] = []
        victims: list[bytes] = []

        def stuck(key: bytes) -> bool:
            return ref[slot_of[key]] != 0 or key in protected

        def first(segment: OrderedDict[bytes, None], back: int) -> bytes | None:
            """The segment's least recent key that may go; the ones before it that may
            not go to its most recent end (journalled)."""
            for _ in range(len(segment)):
                key = next(iter(segment))
                if not stuck(key):
                    return key
                segment.move_to_end(key)
                journal.append((back, key))
            return None

        # The window's overflow once the ``n`` new keys join it: candidates for the main part.
        overflow = len(window) + n - self.window_capacity
        while len(victims) < n:
            candidate = first(window, _W_BACK) if overflow > 0 else None
            victim = first(probation, _P_BACK)
            if victim is None:
                victim = first(guarded, _Q_BACK)
                out_op = _Q_OUT
            else:
                out_op = _P_OUT
            if candidate is not None:
                overflow -= 1
                del window[candidate]
                if victim is not None and estimate(candidate) > estimate(victim):
                    probation[candidate] = None
                    journal.append((_W_TO_P, candidate))
                else:
                    journal.append((_W_OUT, candidate))
                    victims.append(candidate)
                    continue
            if victim is None:
                victim = first(window, _W_BACK)  # the main part has nothing to give
                out_op = _W_OUT
                if victim is None:
                    self._undo(journal)
                    return None
            segment = window if out_op == _W_OUT else probation if out_op == _P_OUT else guarded
            del segment[victim]
            journal.append((out_op, victim))
            victims.append(victim)
        # What is left of the overflow joins probation (the main part has room for it).
        while overflow > 0:
            candidate = first(window, _W_BACK)
            if candidate is None:
                break
            del window[candidate]
            probation[candidate] = None
            overflow -= 1
        return victims

    def _undo(self, journal: list[tuple[int, bytes]]) -> None:
        window, probation, guarded = self.window, self.probation, self.protected
        for op, key in reversed(journal):
            if op == _W_TO_P:
                del probation[key]
            segment = (
                window
                if op in (_W_TO_P, _W_OUT, _W_BACK)
                else probation
                if op in (_P_OUT, _P_BACK)
                else guarded
            )
            if key not in segment:
                segment[key] = None
            segment.move_to_end(key, last=False)

    def clear(self) -> None:
        for segment in (self.window, self.probation, self.protected):
            segment.clear()
        self.sketch.clear()
