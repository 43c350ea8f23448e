"""Eviction policies of the primary ledger: LRU, ARC, or your own by module path.

Theory of operation
-------------------
A policy orders the keys the ledger holds and picks victims; the ledger owns slots and
reference counts and shares them read-only through a `SlotTable`, so a policy can skip
pinned (``ref > 0``) and writing (``ref == -1``) keys without being told about each pin.

Recency is kept in *groups*. Every call that carries keys in prefix order (head -> tail)
names a group: one per request while it runs, or a fresh one per call. A group moves to the
most-recent end whenever it is used, and inside a group keys keep their prefix order. A
victim scan walks groups from the least recent and, inside a group, from the tail, so of
blocks used together by one request the tail goes first: a block is worthless once an
earlier block of its prefix is gone. This costs O(1) per touched key and O(victims +
skipped) per eviction; vLLM 0.33's LRU gets the same order from a lazily invalidated heap.

``evict`` is all-or-nothing: it returns the victims and forgets them, or returns None and
changes nothing.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "SlotTable",
    "make_policy",
]


class SlotTable:
    """The ledger's key -> slot map and per-slot reference counts, shared with its policy."""

    __slots__ = ("ref", "slot_of")

    def __init__(self, num_slots: int) -> None:
        self.slot_of: dict[bytes, int] = {}
        self.ref: list[int] = [0] * num_slots


class GroupedRecency:
    """Keys in recency groups (least recent group first, prefix order inside a group)."""

    __slots__ = ("_group_of", "_groups")

    def __init__(self) -> None:
        self._groups: OrderedDict[int, dict[bytes, None]] = OrderedDict()
        self._group_of: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, key: object) -> bool:
        return key in self._group_of

    def put(self, keys: Sequence[bytes], gid: int) -> None:
        """Move ``keys`` (present or not) to the end of group ``gid``, made most recent."""
        if not keys:
            return
        members = self._groups.get(gid)
        if members is None:
            members = self._groups[gid] = {}
        else:
            self._groups.move_to_end(gid)
        group_of = self._group_of
        for key in keys:
            old = group_of.get(key)
            if old == gid:
                continue
            if old is not None:
                self._drop_from_group(key, old)
            group_of[key] = gid
            members[key] = None

    def discard(self, key: bytes) -> bool:
        gid = self._group_of.pop(key, None)
        if gid is None:
            return False
        self._drop_from_group(key, gid)
        return True

    def _drop_from_group(self, key: bytes, gid: int) -> None:
        members = self._groups[gid]
        del members[key]
        if not members:
            del self._groups[gid]

    def coldest_first(self) -> Iterator[bytes]:
        """Keys from the least recent group on; tail before head inside a group."""
        for members in self._groups.values():
            yield from reversed(members)

    def clear(self) -> None:
        self._groups.clear()
        self._group_of.clear()


class CachePolicy(ABC):
    """What the ledger asks of a policy. Preconditions (guaranteed by the ledger): keys
    passed to `insert` are not held yet; keys passed to `remove` are held."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        self.capacity = capacity
        self.table = table

    @abstractmethod
    def insert(self, keys: Sequence[bytes], gid: int) -> None:
        """New keys (being written, head -> tail) join the cache as part of group ``gid``."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget a key (a failed write)."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes], gid: int) -> None:
        """Keys (head -> tail, held or not) were used by group ``gid``."""

    @abstractmethod
    def evict(
        self, n: int, protected: Collection[bytes], incoming: Sequence[bytes]
    ) -> list[bytes] | None:
        """Pick and forget ``n`` evictable keys not in ``protected``, to make room for
        ``incoming`` (about to be inserted); or return None and change nothing."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, adaptive state included."""


class LRUPolicy(CachePolicy):
    """Least recently used first, tail before head within a request's blocks."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self._order = GroupedRecency()

    def insert(self, keys: Sequence[bytes], gid: int) -> None:
        self._order.put(keys, gid)

    def remove(self, key: bytes) -> None:
        self._order.discard(key)

    def touch(self, keys: Sequence[bytes], gid: int) -> None:
        held = self.table.slot_of
        self._order.put([key for key in keys if key in held], gid)

    def evict(
        self, n: int, protected: Collection[bytes], incoming: Sequence[bytes]
    ) -> list[bytes] | None:
        if n <= 0:
            return []
        victims = _pick(self._order.coldest_first(), n, protected, self.table)
        if victims is None:
            return None
        for key in victims:
            self._order.discard(key)
        return victims

    def clear(self) -> None:
        self._order.clear()


def _pick(
    candidates: Iterator[bytes], n: int, protected: Collection[bytes], table: SlotTable
) -> list[bytes] | None:
    """The first ``n`` evictable, unprotected candidates, or None if there are fewer."""
    slot_of, ref = table.slot_of, table.ref
    victims: list[bytes] = []
    for key in candidates:
        if ref[slot_of[key]] == 0 and key not in protected:
            victims.append(key)
            if len(victims) == n:
                return victims
    return None


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache: T1 (seen once) and T2 (reused) with ghost lists B1/B2
    whose hits move the target size of T1; ghosts are capped at the capacity."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self.target_t1 = 0.0
        self.t1 = GroupedRecency()
        self.t2 = GroupedRecency()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, keys: Sequence[bytes], gid: int) -> None:
        b1, b2 = self.b1, self.b2
        if b1 or b2:
            for key in keys:
                b1.pop(key, None)
                b2.pop(key, None)
        self.t1.put(keys, gid)

    def remove(self, key: bytes) -> None:
        if not self.t1.discard(key):
            self.t2.discard(key)

    def touch(self, keys: Sequence[bytes], gid: int) -> None:
        t1, t2 = self.t1, self.t2
        slot_of, ref = self.table.slot_of, self.table.ref
        to_t1: list[bytes] = []
        to_t2: list[bytes] = []
        for key in keys:
            slot = slot_of.get(key)
            if slot is None:
                self.target_t1 = self._adapted(self.target_t1, key, commit=True)
            elif key not in t1:
                to_t2.append(key)
            elif ref[slot] < 0:
                to_t1.append(key)  # still being written: not a second use, stays in T1
            else:
                t1.discard(key)
                to_t2.append(key)
        t1.put(to_t1, gid)
        t2.put(to_t2, gid)

    def _adapted(self, target: float, key: bytes, *, commit: bool) -> float:
        """Target T1 size after a ghost hit on ``key`` (B1 hit: favour recency)."""
        b1, b2 = self.b1, self.b2
        if key in b1:
            target = min(target + max(1.0, len(b2) / len(b1)), float(self.capacity))
            if commit:
                b1.move_to_end(key)
        elif key in b2:
            target = max(target - max(1.0, len(b1) / len(b2)), 0.0)
            if commit:
                b2.move_to_end(key)
        return target

    def evict(
        self, n: int, protected: Collection[bytes], incoming: Sequence[bytes]
    ) -> list[bytes] | None:
        target = self.target_t1
        for key in incoming:
            target = self._adapted(target, key, commit=False)
        victims = self._select(n, protected, int(target))
        if victims is None:
            return None
        self.target_t1 = target
        for key, from_t1 in victims:
            (self.t1 if from_t1 else self.t2).discard(key)
            (self.b1 if from_t1 else self.b2)[key] = None
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return [key for key, _ in victims]

    def _select(
        self, n: int, protected: Collection[bytes], target: int
    ) -> list[tuple[bytes, bool]] | None:
        t1_iter = self._candidates(self.t1, protected)
        t2_iter = self._candidates(self.t2, protected)
        t1_size = len(self.t1)
        victims: list[tuple[bytes, bool]] = []
        while len(victims) < n:
            key = next(t1_iter, None) if t1_size >= target else None
            from_t1 = key is not None
            if key is None:
                key = next(t2_iter, None)
            if key is None:
                key = next(t1_iter, None)
                from_t1 = True
            if key is None:
                return None
            t1_size -= from_t1
            victims.append((key, from_t1))
        return victims

    def _candidates(self, order: GroupedRecency, protected: Collection[bytes]) -> Iterator[bytes]:
        slot_of, ref = self.table.slot_of, self.table.ref
        for key in order.coldest_first():
            if ref[slot_of[key]] == 0 and key not in protected:
                yield key

    def clear(self) -> None:
        self.target_t1 = 0.0
        for order in (self.t1, self.t2):
            order.clear()
        self.b1.clear()
        self.b2.clear()


_BUILTIN: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int, table: SlotTable) -> CachePolicy:
    """Build a policy by name (``lru``, ``arc``) or by ``package.module:ClassName``."""
    cls = _BUILTIN.get(name)
    if cls is None:
        cls = _import_policy(name)
    return cls(capacity, table)


def _import_policy(path: str) -> type[CachePolicy]:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"eviction_policy must be one of {sorted(_BUILTIN)} or 'package.module:ClassName', "
            f"got {path!r}"
        )
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ValueError(f"eviction_policy {path!r} does not name a CachePolicy subclass")
    return cls
