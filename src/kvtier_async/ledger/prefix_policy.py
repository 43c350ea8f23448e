"""A prefix-aware eviction policy (``eviction_policy: "prefix"``): not vLLM's, past it.

Theory of operation
-------------------
KV blocks are not independent: a block is a hit only if every block before it in its prompt
is one too, and a head that several requests share is worth more than one request's tail.
The ledger already sees that structure through vLLM 0.33's calls (no ``touch`` needed): each
request's keys in prefix order, which of them it reused and which it stored, and when it
ends. This policy keeps ARC's shape (two lists, a ghost list each, an adaptive target) but
splits the keys by *how* they are reused rather than by how often:

- **Private** keys (list P): a chain one line of requests walks, such as a chat session whose
  every turn extends the previous prompt, or a document's tail past every fork. Their future
  is recency: P is an LRU list.
- **Shared** keys (list S): a head from which requests fork, such as a system prompt or a
  document that many questions follow. Their future is frequency: S is ordered by a decayed,
  capped count of the requests that reused the key (LFU with history and aging), then by
  recency.

*Sharing is seen in the prefix tree.* A private key remembers the key that followed it in the
first request that walked past it (``_next``). When a request walks past it and continues
with a *different* key, the two requests fork there: that key and every key of the request
above it become shared (an ancestor of a shared key is shared: both requests passed through
it). A chat turn continues exactly where the previous turn stopped, so a session's keys never
fork and stay private however many turns reuse them; the system prompt above them forks into
every session and is shared. Keys come in private and move to S only on that evidence, which
a request leaves when it finishes (or come back to S from S's ghost list).

*Counts.* A shared key counts one per request that reuses it, and one when it is stored again
after an eviction while its ghost remembers its count (history, as in LFU with history and
TinyLFU; a private ghost gives nothing, so a returning chat session is recency again). Counts
halve every ``epoch_capacities * capacity`` insertions (aging: a head nobody reads any more
sinks) and stop at ``2 ** max_octaves`` per epoch (TinyLFU's small counters: a hot head needs
no more, and loses its lead within a few epochs once it cools). The halving is not a pass over
the keys: a key keeps ``score = log2(sum of 2**epoch over its counted accesses)``, which
orders keys exactly as halving every count at each epoch would, at O(1) per access. S groups
keys by ``floor(score * levels_per_octave)``, each group in recency order (a key at its cap
keeps its place: the hottest group is the last to give a victim anyway).

*Leaves before ancestors* (the rule of SGLang's radix cache). A request's keys are refreshed
tail first, so in P a head is more recent than its tail; in S a key's score is raised to at
least the scores below it in the request. A shared prefix is not cut in the middle while its
tail stays.

*Adaptivity* (ARC's). ``target_private`` is the size P should have: a key stored again while
its P ghost is remembered grows it by ``max(1, |S ghosts| / |P ghosts|)``, one from S's
ghosts shrinks it the same way (ARC's B1 and B2 hits). Eviction takes P's least recent key
while P is at least its target, else S's lowest, least recent key, else the other list's;
like every policy here it skips pinned, writing and protected keys and is all or nothing.
Each ghost list holds at most ``capacity`` keys.

Signals, by hook: `insert` puts new keys at P's recent end (tail first) or, from a ghost,
back where the ghost says; `on_request_access` refreshes the private keys a request reaches,
so that its own store does not evict the chain it just loaded; `on_request_finished` does the
rest (forks, sharing, counts, order) in one walk of the request's keys, tail first; `touch`
(outside any request) refreshes and counts.

Costs: O(1) per key a call names; a finish walks the request's keys once, and a key of S
whose count is at its cap costs a lookup; eviction walks P from its cold end and S's levels
in order (a few dozen), O(victims + skipped); an eviction that P alone answers (P stays at
or above its target) is one scan of P's cold end.

Taken from: ARC (Megiddo & Modha; vLLM's ``ARCCachePolicy``) for the lists, ghosts and
adaptive target, split by sharing instead of reuse (by reuse, every block of a long chat is
"frequent"); LFU with history and TinyLFU's capped, halved counters, only where frequency
predicts; SGLang's radix cache for leaves first, without its heap over the leaves (refresh
order and a score floor give it at O(1)); S3-FIFO's lesson that most new blocks are never read
again (new keys start in P, the list that gives victims first). LMCache's policies (LRU, LFU,
FIFO, MRU, S3-FIFO, cost-aware) rank chunks one by one, blind to their prefix.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from .arc import arc_choose
from .policy import CachePolicy, RequestAccess, SlotTable

__all__ = ["PrefixPolicy"]


class PrefixPolicy(CachePolicy):
    """Private chains by recency, shared heads by decayed frequency, ARC's adaptive split
    between the two (see the module docstring)."""

    observes_store_misses = False  # a returning key's ghost is read when it is stored again
    #: S's levels: steps of ``1 / levels_per_octave`` in ``log2(count)``
    levels_per_octave = 8
    #: counts halve every ``epoch_capacities * capacity`` insertions
    epoch_capacities = 4
    #: a count stops growing at ``2 ** max_octaves`` (within an epoch)
    max_octaves = 4.0

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        self._private: OrderedDict[bytes, None] = OrderedDict()
        self._score: dict[bytes, float] = {}  # shared key -> log2(decayed count) + epoch
        self._buckets: dict[float, OrderedDict[bytes, None]] = {}  # level -> LRU list
        self._next: dict[bytes, bytes] = {}  # private key -> the key first seen after it
        self._ghost_private: OrderedDict[bytes, bytes | None] = OrderedDict()  # -> its _next
        self._ghost_shared: OrderedDict[bytes, float] = OrderedDict()  # -> its score
        self._per_octave = self.levels_per_octave
        self._epoch_len = self.epoch_capacities * max(1, capacity)
        self.clear()

    def clear(self) -> None:
        self._private.clear()
        self._score.clear()
        self._buckets.clear()
        self._next.clear()
        self._ghost_private.clear()
        self._ghost_shared.clear()
        self.target_private = 0.0
        self._inserted = 0  # insertions in this epoch
        self._epoch = 0

    # --- S: shared keys by level ---------------------------------------------------------

    def _place(self, key: bytes, score: float, old: float | None = None) -> None:
        """Put ``key`` at ``score`` (at the recent end of its bucket); ``old``: the score it
        has now, if it is in S."""
        per_octave, buckets = self._per_octave, self._buckets
        level = score * per_octave // 1.0
        if old is not None:
            old_level = old * per_octave // 1.0
            bucket = buckets[old_level]
            if old_level == level:
                bucket.move_to_end(key)
                self._score[key] = score
                return
            del bucket[key]
            if not bucket:
                del buckets[old_level]
        target = buckets.get(level)
        if target is None:
            target = buckets[level] = OrderedDict()
        target[key] = None
        self._score[key] = score

    def _unplace(self, key: bytes) -> float:
        score = self._score.pop(key)
        level = score * self._per_octave // 1.0
        bucket = self._buckets[level]
        del bucket[key]
        if not bucket:
            del self._buckets[level]
        return score

    def _credit(self, score: float) -> float:
        """``score`` after one more access now: ``log2(2**score + 2**epoch)``, unless the
        count is at its cap."""
        above = score - self._epoch
        if above >= self.max_octaves:
            return score
        return self._epoch + math.log2(2.0**above + 1.0)

    @property
    def shared_keys(self) -> list[bytes]:
        """S's keys, the next victim first (for inspection and tests)."""
        return [key for level in sorted(self._buckets) for key in self._buckets[level]]

    @property
    def private_keys(self) -> list[bytes]:
        """P's keys, the least recent first (for inspection and tests)."""
        return list(self._private)

    # --- hooks ---------------------------------------------------------------------------

    def insert(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        private, ghost_private, ghost_shared = (
            self._private,
            self._ghost_private,
            self._ghost_shared,
        )
        self._age(len(keys))
        if not (ghost_private.keys() & keys or ghost_shared.keys() & keys):
            private.update(dict.fromkeys(reversed(keys)))  # the head ends most recent
            return
        returned: set[bytes] | None = req.policy_state  # keys back from a ghost
        for key in reversed(keys):
            if key in ghost_private:
                self._adapt(grow=True)
                after = ghost_private.pop(key)
                if after is not None:
                    self._next[key] = after
                private[key] = None
            elif key in ghost_shared:
                self._adapt(grow=False)
                self._place(key, self._credit(ghost_shared.pop(key)))
            else:
                private[key] = None
                continue
            if returned is None:
                returned = req.policy_state = set()
            returned.add(key)

    def _adapt(self, grow: bool) -> None:
        """A key stored again while its ghost is remembered (ARC's B1 / B2 hit)."""
        private, shared = len(self._ghost_private), len(self._ghost_shared)
        if grow:
            delta = max(1.0, shared / private)
            self.target_private = min(self.target_private + delta, float(self.capacity))
        else:
            delta = max(1.0, private / shared)
            self.target_private = max(self.target_private - delta, 0.0)

    def _age(self, inserted: int) -> None:
        self._inserted += inserted
        if self._inserted >= self._epoch_len:
            self._epoch += self._inserted // self._epoch_len
            self._inserted %= self._epoch_len

    def remove(self, key: bytes) -> None:
        if key in self._private:
            del self._private[key]
            self._next.pop(key, None)
        else:
            self._unplace(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keys used outside any request: refreshed, and a shared one counts the use."""
        private, score = self._private, self._score
        for key in reversed(keys):
            if key in private:
                private.move_to_end(key)
            else:
                old = score.get(key)
                if old is not None:
                    self._place(key, self._credit(old), old)

    def on_request_access(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        """Private keys a request reaches are refreshed now (tail first), so that its own
        store does not evict the chain it just loaded; shared ones count when it ends."""
        private = self._private
        for key in reversed(keys):
            if key in private:
                private.move_to_end(key)

    def on_request_finished(
        self,
        order: Sequence[bytes],
        inserted: Collection[bytes],
        reused: Collection[bytes],
        req: RequestAccess,
    ) -> None:
        """Tail first (the head ends most recent): refresh the private tail of the
        request; from the deepest key where it diverges (or the deepest shared key) up,
        every held key is shared: count the request on those it reused, and keep each
        one's score at least its descendants'."""
        returned: Collection[bytes] = req.policy_state or ()
        req.policy_state = None
        shared_from = self._refresh_private_tail(order)
        if shared_from >= 0:
            self._count_shared_head(order, shared_from, reused, returned)

    def _refresh_private_tail(self, order: Sequence[bytes]) -> int:
        """Refresh ``order``'s held keys tail first and note the key after each, up to the
        first that is shared or where ``order`` diverges from the first request seen past
        it; that key's index, or -1."""
        private, score, after = self._private, self._score, self._next
        following: bytes | None = None
        for index in range(len(order) - 1, -1, -1):
            key = order[index]
            if key in private:
                if following is not None and after.setdefault(key, following) != following:
                    return index
                private.move_to_end(key)
            elif key in score:
                return index
            following = key
        return -1

    def _count_shared_head(
        self,
        order: Sequence[bytes],
        last: int,
        reused: Collection[bytes],
        returned: Collection[bytes],
    ) -> None:
        """Share ``order[: last + 1]``'s held keys, tail first: credit the reused ones (and
        private ones stored again from a ghost), raise each score to its descendants'."""
        private, score, after, buckets = self._private, self._score, self._next, self._buckets
        per_octave, epoch, log2 = self._per_octave, float(self._epoch), math.log2
        cap = self.max_octaves
        floor = -1.0  # the highest score below, in this request
        for key in reversed(order[: last + 1]):
            old = score.get(key)
            if old is None:
                if key not in private:
                    continue
                del private[key]  # shared from now on
                after.pop(key, None)
                new = epoch + 1.0 if key in reused or key in returned else epoch
                if new < floor:
                    new = floor
                floor = new
                self._place(key, new)
                continue
            if old - epoch >= cap or key not in reused:
                if old >= floor:  # at its cap, or not reused: it stays where it is
                    floor = old
                    continue
                new = old
            else:
                new = epoch + log2(2.0 ** (old - epoch) + 1.0)
            if new < floor:
                new = floor
            else:
                floor = new
            score[key] = new
            level, old_level = new * per_octave // 1.0, old * per_octave // 1.0
            if level == old_level:
                buckets[level].move_to_end(key)
                continue
            bucket = buckets[old_level]
            del bucket[key]
            if not bucket:
                del buckets[old_level]
            moved_to = buckets.get(level)
            if moved_to is None:
                moved_to = buckets[level] = OrderedDict()
            moved_to[key] = None

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        """ARC's choice between P and S (`_evict_by_choice`), with a fast path for the usual
        case: P stays at or above its target after ``n`` victims, so `arc_choose` would take
        all ``n`` from P's cold end; they are taken there in one scan, without its
        iterators."""
        private = self._private
        if n <= 0 or len(private) - n + 1 < int(self.target_private):
            return self._evict_by_choice(n, protected)
        slot_of, ref = self.table.slot_of, self.table.ref
        victims: list[bytes] = []
        for key in private:
            if ref[slot_of[key]] == 0 and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return self._evict_by_choice(n, protected)  # P runs short: S gives the rest
        after, ghost = self._next, self._ghost_private
        for key in victims:
            del private[key]
            ghost[key] = after.pop(key, None)
        for _ in range(len(ghost) - self.capacity):  # S's ghost is unchanged: no trim
            ghost.popitem(last=False)
        return victims

    def _evict_by_choice(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        if n <= 0:
            return []
        victims = self._select(n, protected)
        if victims is None:
            return None
        private, after = self._private, self._next
        ghost_private, ghost_shared = self._ghost_private, self._ghost_shared
        for key, from_private in victims:
            if from_private:
                del private[key]
                ghost_private[key] = after.pop(key, None)
            else:
                ghost_shared[key] = self._unplace(key)
        for ghost in (ghost_private, ghost_shared):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return [key for key, _ in victims]

    def _select(self, n: int, protected: Collection[bytes]) -> list[tuple[bytes, bool]] | None:
        """ARC's choice (`arc_choose`) between P (recent) and S (frequent, by level)."""
        return arc_choose(
            self._evictable(self._private, protected),
            self._evictable(self._shared_order(), protected),
            len(self._private),
            int(self.target_private),
            n,
        )

    def _shared_order(self) -> Iterator[bytes]:
        buckets = self._buckets
        for level in sorted(buckets):
            yield from buckets[level]
