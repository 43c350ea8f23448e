"""The ``reuse`` eviction policy (``eviction_policy: "reuse"``): recency, with credit for
every request that came back to a key, more where requests fork. Built for real traffic:
judged on a published production trace (Mooncake's conversation workload) as well as on the
generated ones (`kvtier_async.bench.ledger`).

Theory of operation
-------------------
What the conversation trace shows (``docs/benchmarks.md``):

- *Recency first.* A block that comes back mostly comes back soon (a chat's next turn), and
  LRU beats ARC and ``prefix`` there: their frequent list holds on to what no one reads any
  more, and their adaptive target moves too slowly for an hour of traffic.
- *But reuse predicts reuse.* 24% of the blocks read once are read again; 42% of those read
  twice, 50% of those read three times, 65% of those read five times. A block's count of
  requests is worth time in the cache: more than the first read, not forever.
- *A prompt's last block rarely returns* (99% never): it is the partial block the next turn's
  prompt replaces with a full one.

The generated document traces add: a head that many requests fork from (a document, a
system prompt) is worth far more per read than a chat's chain, which one line of requests
walks and which ends when the chat does.

So each key has a *count*: the requests that read or stored it (one per request), kept for a
while after the key is evicted (ghosts, as ARC's: a block stored again soon after it went
keeps its history; about the last one to two capacities' worth of evicted keys). Each placement
ticks a clock and stamps the key; the policy evicts the key with the smallest
``stamp + credit``, where a count of 1 has no credit, a key of a chain
``credit_capacities * capacity * sqrt(c - 1)`` (``c`` capped at ``max_chain_count``) and a
shared key ``shared_credit_capacities * capacity * (c - 1)`` (``c`` capped at
``max_count``). A request places each of its keys about twice (when it
reaches it and when it ends), so a chain key read twice stays about one capacity's worth of
requests' keys longer than one read once. The credit is bounded: a head no one reads any
more goes in the end, with no aging pass.

*Shared* is seen as ``prefix`` sees it: a key remembers the key first seen after it
(``_next``); a request that walks past it and goes on with another key forks there, and that
key and every key of the request above it are shared. One exception: a prompt's last key
that the request only stored goes to the *cold* list (evicted before any other) and is not
remembered as a successor, so the next turn of a chat, which replaces that partial block, is
no fork.

Keys are placed tail first (a request's head ends most recent, as vLLM's LRU does), so a
prefix is cut from its tail, not its middle. Hooks: `insert` places new keys with the count
their ghost remembers plus one; `on_request_access` refreshes the held keys a request reaches
(its own store does not evict the chain it just loaded), except credited keys not yet due:
those come after every key without credit already; `on_request_finished` finds the
fork, counts the keys the request reused and places its held keys again (the keys it only
stored keep their places from `insert`, which is where a fresh placement would put them);
`touch` (outside any request) counts and refreshes.

Structure and costs: keys without credit (a count of 1) in ``_recent``, an insertion-ordered
dict whose order is stamp order; credited keys in a heap by ``stamp + credit``, stale entries
skipped when popped (and the heap rebuilt when they are half of it); the cold list. O(1) per
key a call names, O(log n) for a credited one. Eviction takes the cold list first, then
``_recent``'s oldest keys while they come before the heap's top (the usual case: one scan),
else merges the two: O((victims + skipped) * log n). Like every policy here it skips pinned,
writing and protected keys and is all or nothing. The ghosts are two plain dicts, not one
ordered list: victims go into the newer in one call, and when it holds ``capacity`` keys it
becomes the older and the older is dropped whole, so no victim pays for trimming the list
(2.6% fewer instructions for the conversation trace's replay at 10% than an ordered list of
``capacity`` ghosts, and the same hit rates or better but for docmix at 25%: see
``docs/benchmarks.md``).

Taken from: vLLM's LRU; LRFU's and LRU-K's point that recency and frequency are one scale,
not two lists (ARC, ``prefix``); ARC's ghosts for the history of evicted keys; ``prefix``'s
(and SGLang's radix tree's) forks for what is shared; S3-FIFO's lesson, and this trace's,
that one-time blocks should go first (the cold list).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence

from .policy import CachePolicy, RequestAccess, SlotTable

__all__ = ["ReusePolicy"]


class ReusePolicy(CachePolicy):
    """Recency with credit for reuse, more for shared keys, a cold list for one-time tails
    (see the module docstring)."""

    observes_store_misses = False  # a returning key's ghost is read when it is stored again
    #: a chain key's counts above this count as this
    max_chain_count = 5
    #: a shared key's counts above this count as this
    max_count = 64
    #: a chain key's unit of credit, in placements: ``credit_capacities * capacity``
    credit_capacities = 2.0
    #: a shared key's unit of credit: ``shared_credit_capacities * capacity``
    shared_credit_capacities = 4.0

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        room = max(1, capacity)
        chain, shared = self.credit_capacities * room, self.shared_credit_capacities * room
        #: what count ``c`` adds to a key's stamp: ``_chain_credit[c]`` for a key of a
        #: chain, ``_shared_credit[c]`` for a shared one (index 0: unused)
        self._chain_credit = [0] + [
            int(chain * math.sqrt(c - 1)) for c in range(1, self.max_chain_count + 1)
        ]
        self._shared_credit = [0] + [int(shared * (c - 1)) for c in range(1, self.max_count + 1)]
        self._count: dict[bytes, int] = {}  # held key -> its count (uncapped)
        self._next: dict[bytes, bytes] = {}  # held chain key -> the key first seen after it
        self._shared: set[bytes] = set()  # held keys where requests forked, and above
        self._recent: OrderedDict[bytes, int] = OrderedDict()  # no credit: key -> stamp
        self._due: dict[bytes, int] = {}  # credited key -> stamp + credit
        self._heap: list[tuple[int, bytes]] = []  # (due, key), stale entries included
        self._cold: OrderedDict[bytes, None] = OrderedDict()  # held, evicted first
        # evicted key -> its count, in two generations: once the newer holds ``capacity``
        # keys (checked after each eviction), it becomes the older one, and the older one
        # is dropped whole
        self._ghost: dict[bytes, int] = {}
        self._old_ghost: dict[bytes, int] = {}
        self._clock = 0

    def clear(self) -> None:
        for part in (self._count, self._next, self._shared, self._recent, self._due):
            part.clear()
        self._heap.clear()
        self._cold.clear()
        self._ghost.clear()
        self._old_ghost.clear()
        self._clock = 0

    # --- placement -----------------------------------------------------------------------

    def _place_all(
        self,
        keys: Sequence[bytes],
        counted: Collection[bytes],
        end: int,
        forks: bool = False,
        kept: Collection[bytes] = (),
        unspent_stay: bool = False,
    ) -> None:
        """Place the held ``keys[: end + 1]`` again, tail first (the head ends most recent):
        each gets a fresh stamp, and those in ``counted`` count once more. A key without
        credit goes to the recent end of ``_recent``, a credited one into the heap at
        ``stamp + credit``. With ``unspent_stay``, a credited key not yet due keeps its
        place (the clock ticks for it all the same).

        With ``forks`` (a finished request's keys, head -> tail), the key where the keys
        leave the chain first seen past it (or the first shared key) and every held key
        above it become shared; below it, keys in ``kept`` keep their places (the clock
        ticks for them all the same)."""
        counts, after, shared, recent, due_of, heap = (
            self._count,
            self._next,
            self._shared,
            self._recent,
            self._due,
            self._heap,
        )
        chain_credit, shared_credit = self._chain_credit, self._shared_credit
        top_chain, top_shared = self.max_chain_count, self.max_count
        cold, clock, push = self._cold, self._clock, heapq.heappush
        forked = False  # once true, every held key from here to the head is shared
        following: bytes | None = None
        if forks and kept:
            # the usual end of a request: the keys it stored, a run at its tail, all held
            # and new to every chain (no successor yet, none shared): each keeps its place
            # and gets the next as its successor; in C, without the walk below
            run = list(itertools.takewhile(kept.__contains__, reversed(keys[: end + 1])))
            if (
                run
                and all(map(counts.__contains__, run))
                and shared.isdisjoint(run)
                and after.keys().isdisjoint(run[1:])
            ):
                after.update(zip(run[1:], run))
                clock += len(run)
                following = run[-1]
                end -= len(run)
        for index in range(end, -1, -1):
            key = keys[index]
            count = counts.get(key)
            if count is None:  # not held
                following = key
                continue
            if forks and not forked:
                if key in shared or (
                    following is not None and after.setdefault(key, following) != following
                ):
                    forked = True
                elif key in kept:
                    clock += 1
                    following = key
                    continue
                following = key
            if key in counted:
                count = counts[key] = count + 1
            if forked:
                shared.add(key)
            clock += 1
            if unspent_stay and due_of.get(key, 0) > clock:
                continue
            if key in shared:
                credit = shared_credit[count if count < top_shared else top_shared]
            else:
                credit = chain_credit[count if count < top_chain else top_chain]
            if credit:  # a count never falls and a key stays shared: credited for good
                if key not in due_of and recent.pop(key, None) is None:
                    cold.pop(key, None)
                due_of[key] = clock + credit
                push(heap, (clock + credit, key))
            else:
                if recent.pop(key, None) is None:
                    cold.pop(key, None)
                recent[key] = clock
        self._clock = clock
        if len(heap) > 2 * len(due_of) + 64:  # mostly stale entries: rebuild
            self._heap = [(due, key) for key, due in due_of.items()]
            heapq.heapify(self._heap)

    def count(self, key: bytes) -> int:
        """``key``'s count: the requests that read or stored it (0: not held)."""
        return self._count.get(key, 0)

    def ghost_count(self, key: bytes) -> int:
        """The count an evicted ``key``'s ghost remembers (0: none; for inspection and
        tests)."""
        return self._ghost.get(key) or self._old_ghost.get(key, 0)

    def num_ghosts(self) -> int:
        """How many evicted keys' counts are remembered: at most ``2 * capacity`` plus one
        eviction's victims; at least the last ``capacity`` evicted (once that many were) but
        those stored again since."""
        return len(self._ghost) + len(self._old_ghost)

    def eviction_order(self) -> list[bytes]:
        """Every held key, the next victim first, pins and protection aside (for inspection
        and tests)."""
        timed = [(stamp, key) for key, stamp in self._recent.items()]
        timed += [(due, key) for key, due in self._due.items()]
        return [*self._cold, *(key for _, key in sorted(timed))]

    # --- hooks ---------------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        """New keys (never cold, shared or credited yet): placed tail first, each counted
        once more than its ghost remembers."""
        counts, ghost, old = self._count, self._ghost, self._old_ghost
        # the usual case: all new, a count of 1, no credit
        if ghost.keys().isdisjoint(keys) and old.keys().isdisjoint(keys):
            clock = self._clock
            self._clock = clock + len(keys)
            counts.update(dict.fromkeys(keys, 1))
            self._recent.update(zip(reversed(keys), range(clock + 1, clock + 1 + len(keys))))
            return
        for key in keys:
            seen = ghost.pop(key, None)
            counts[key] = (old.pop(key, 0) if seen is None else seen) + 1
        self._place_all(keys, (), len(keys) - 1)

    def remove(self, key: bytes) -> None:
        del self._count[key]
        self._next.pop(key, None)
        self._shared.discard(key)
        if self._due.pop(key, None) is None and self._recent.pop(key, None) is None:
            del self._cold[key]

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keys used outside any request: each held one counts once more and is refreshed
        (once, however often ``keys`` names it)."""
        once = list(dict.fromkeys(keys))
        self._place_all(once, set(once), len(once) - 1)

    def on_request_access(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        """Held keys a request reaches are refreshed now (tail first), so that its own store
        does not evict the chain it just loaded; they count when it ends. A credited key
        not yet due keeps its due: it comes after every key without credit, which the
        store evicts first (and it is placed again when the request ends)."""
        if not self._count.keys().isdisjoint(keys):  # (a store's keys: none held yet)
            self._place_all(keys, (), len(keys) - 1, unspent_stay=True)

    def on_request_finished(
        self,
        order: Sequence[bytes],
        inserted: Collection[bytes],
        reused: Collection[bytes],
        req: RequestAccess,
    ) -> None:
        """Find where the request forked from the chain its keys were first seen in (its
        keys from there up are shared), count the keys it reused (the ledger's ``reused``
        excludes those it stored: `insert` counted them), refresh every held key of it tail
        first; its last key, if it only stored it and the key has no history, goes to the
        cold list."""
        if not order:
            return
        end = len(order) - 1
        last = order[end]
        # a prompt's last block, only stored now: most likely the partial block the next
        # turn replaces, so it is not the chain's successor (the next turn is no fork)
        tail_cold = last in inserted and last not in reused and self._count.get(last) == 1
        if tail_cold:
            end -= 1
            self._clock += 1  # (it keeps its place from `insert` until it goes cold below)
        # the keys it only stored keep the places `insert` gave them (tail first, after
        # every key placed before): as a fresh placement now would leave them, unless
        # another request's keys were placed in between
        self._place_all(order, reused, end, forks=True, kept=inserted)
        if tail_cold:  # (already cold when another request stored it again and ended first)
            self._recent.pop(last, None)
            self._cold[last] = None

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        slot_of, ref = self.table.slot_of, self.table.ref
        victims: list[bytes] = []
        for key in self._cold:
            if ref[slot_of[key]] == 0 and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        taken: list[tuple[int, bytes]] = []  # live heap entries popped: victims and skipped
        if len(victims) < n and not self._take_recent(victims, n, protected):
            self._take_merged(victims, n, protected, taken)
        chosen = victims if len(victims) == n else []
        if taken:
            keep = set(chosen)
            for entry in taken:
                if entry[1] not in keep:
                    heapq.heappush(self._heap, entry)
        if not chosen:
            return None
        counts, ghost, after = self._count, self._ghost, self._next
        cold, recent, due_of = self._cold, self._recent, self._due
        ghost.update(zip(victims, map(counts.pop, victims)))
        for key in victims:
            after.pop(key, None)
            if recent.pop(key, None) is None and due_of.pop(key, None) is None:
                del cold[key]
        if self._shared:
            self._shared.difference_update(victims)
        if len(ghost) >= self.capacity:  # a new generation
            self._old_ghost, self._ghost = ghost, {}
        return victims

    def _take_recent(self, victims: list[bytes], n: int, protected: Collection[bytes]) -> bool:
        """The usual case: ``_recent``'s oldest evictable keys fill ``victims`` up to ``n``
        before the heap's top is due. Whether they did (if not, ``victims`` is as it was)."""
        heap, due_of = self._heap, self._due
        while heap and due_of.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # stale
        limit, limit_key = heap[0] if heap else (self._clock + 1, b"")  # (above every stamp)
        slot_of, ref = self.table.slot_of, self.table.ref
        before = len(victims)
        for key, stamp in self._recent.items():
            if stamp >= limit and (stamp > limit or key > limit_key):
                break  # the heap's turn
            if ref[slot_of[key]] == 0 and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    return True
        del victims[before:]
        return False

    def _take_merged(
        self,
        victims: list[bytes],
        n: int,
        protected: Collection[bytes],
        taken: list[tuple[int, bytes]],
    ) -> None:
        """Fill ``victims`` up to ``n`` (or as far as they go) from ``_recent`` (by stamp)
        and the heap (by due) merged, evictable keys only; the live heap entries popped go
        to ``taken``."""
        heap, due_of = self._heap, self._due
        slot_of, ref = self.table.slot_of, self.table.ref
        candidates = (
            (stamp, key)
            for key, stamp in self._recent.items()
            if ref[slot_of[key]] == 0 and key not in protected
        )
        low = next(candidates, None)
        high: tuple[int, bytes] | None = None
        while len(victims) < n:
            while high is None and heap:
                entry = heapq.heappop(heap)
                key = entry[1]
                if due_of.get(key) != entry[0]:
                    continue  # stale
                taken.append(entry)
                if ref[slot_of[key]] == 0 and key not in protected:
                    high = entry
            if high is not None and (low is None or high < low):
                victims.append(high[1])
                high = None
            elif low is not None:
                victims.append(low[1])
                low = next(candidates, None)
            else:
                return
