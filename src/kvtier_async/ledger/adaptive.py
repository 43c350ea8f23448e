"""The ``adaptive`` eviction policy: several policies run side by side on a sample of the
traffic, and the cache follows the one that hits most there, switching while it runs.

Theory of operation
-------------------
No policy wins on every workload: on a chat's trace recency wins (the next turn comes back
soon), where one-time blocks dominate a filter against them wins (`s3fifo`, `sieve`,
`tinylfu`), where many requests fork from one head a credit for reuse wins (`reuse`); and
each has its failure (`reuse` sends every one-block request's block to its cold list, LRU
lets a scan flush a hot set). Which one holds for the traffic at hand is measured, not
guessed:

- *Miniature caches* (Waldspurger et al., "Cache Modeling and Optimization using Miniature
  Simulations", ATC'17, after SHARDS's spatial sampling). A key is *sampled* when the low
  ``k`` bits of a CRC-32 of its bytes are zero (one key in ``2**k``); each of `CANDIDATES`
  runs a shadow cache of ``capacity >> k`` slots that sees the sampled keys of every
  request and nothing else. ``k`` is the largest that leaves `MIN_SHADOW_SLOTS` slots (at
  most `MAX_SAMPLE_SHIFT`): on the conversation trace, miniatures of about 2,300 slots rank
  the policies as the full caches do, while 570 slots cannot tell `reuse` from `lru`. A
  shadow replays a request as the ledger's caller does: it looks the sampled keys up head
  first, counts as hits those before its first miss, loads them and stores the rest. The
  shadows hold keys only, no data.
- *Scores over recent traffic.* Each shadow capacity's worth of sampled reads ends an
  *epoch*; each shadow keeps its hits of the latest `WINDOW_EPOCHS` epochs, its score.
- *Switching without a stop, on evidence only.* A switch costs hits: the new policy starts
  from the old one's order with none of its history (counts, ghosts). So a candidate takes
  over only when its lead over the live policy is both large and no accident: over the
  epochs both were scored on (at least `LEAD_EPOCHS`), its mean lead per epoch is above
  `SWITCH_MARGIN` of the live policy's hits and above `SWITCH_Z` standard errors of the
  per-epoch differences (a paired test: the shadows saw the same sampled reads). The live
  policy then hands its held keys, coldest first, to a fresh instance of the candidate
  (`KeyedPolicy.adopt`, or fresh inserts), which serves from then on. Pins, writes and
  running requests carry on (a request's policy state is tagged with the live policy's
  generation, so the new policy never reads the old one's). This paired test replaced a
  rule of five epochs in a row ahead by the margin, which switched on Mooncake's synthetic
  trace at 10% on a lead of noise (0.986x the better of vLLM's LRU and ARC; no switch:
  0.998x).

The numbers are fixed, not fitted to a trace. The first live policy is `reuse`: at or above
0.99x the better of vLLM's LRU and ARC on every trace it was judged on, so the cache starts
from a good policy and leaves it only on evidence.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any, Final
from zlib import crc32

from .arc import ARCPolicy
from .keyed_policy import KeyedPolicy
from .lru import LRUPolicy
from .policy import CachePolicy, RequestAccess, SlotTable
from .reuse_policy import ReusePolicy
from .s3fifo import S3FIFOPolicy
from .sieve import SievePolicy
from .tinylfu import TinyLFUPolicy

__all__ = ["AdaptivePolicy"]

CANDIDATES: Final[dict[str, type[CachePolicy]]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "reuse": ReusePolicy,
    "s3fifo": S3FIFOPolicy,
    "sieve": SievePolicy,
    "tinylfu": TinyLFUPolicy,
}
FIRST: Final = "reuse"
MIN_SHADOW_SLOTS: Final = 2048
MAX_SAMPLE_SHIFT: Final = 5  # a 32nd of the keys at most
EPOCH_CAPACITIES: Final = 1.0
SWITCH_MARGIN: Final = 0.03
LEAD_EPOCHS: Final = 5  # the fewest epochs a lead is judged on
WINDOW_EPOCHS: Final = 10  # the epochs a lead is judged on, at most (the latest)
SWITCH_Z: Final = 3.0  # how many standard errors the mean lead per epoch must clear


def _eviction_order(policy: CachePolicy) -> list[bytes]:
    """``policy``'s held keys, coldest first."""
    order = getattr(policy, "eviction_order", None)
    if order is None:
        raise TypeError(f"{type(policy).__name__} cannot hand over its keys")
    return list(order())


_NO_STATE = RequestAccess()  # for the shadows' policies that keep nothing per request


class _Shadow:
    """A miniature cache: a policy over a key set of its own, no pins, no data."""

    __slots__ = (
        "finishes",
        "free",
        "history",
        "hits",
        "name",
        "policy",
        "positions",
        "store_misses",
        "table",
    )

    def __init__(self, name: str, cls: type[CachePolicy], capacity: int) -> None:
        self.name = name
        self.table = SlotTable(capacity)
        self.free = list(range(capacity - 1, -1, -1))
        self.policy = cls(capacity, self.table)
        self.hits = 0
        self.history: deque[int] = deque(maxlen=WINDOW_EPOCHS)  # hits per epoch, latest last
        # What the policy needs of a replay: request positions and state (LRU), the
        # store-miss hook, the end of each request (all but the literature's).
        self.positions = isinstance(self.policy, LRUPolicy)
        self.store_misses = self.policy.observes_store_misses
        self.finishes = not isinstance(self.policy, KeyedPolicy)

    def request(self, keys: list[bytes]) -> None:
        slot_of, policy = self.table.slot_of, self.policy
        hits = 0
        for key in keys:
            if key not in slot_of:
                break
            hits += 1
        self.hits += hits
        if self.positions:
            req = RequestAccess()
            req.seen = dict(zip(keys, range(1, len(keys) + 1)))
            req.next_position = len(keys) + 1
            req.last_position = len(keys)
        else:
            req = _NO_STATE
        # As the ledger's caller does: load the hits, then store the rest.
        if hits:
            policy.on_request_access(keys[:hits], req)
        if hits == len(keys):
            if self.finishes:
                policy.on_request_finished(keys, (), keys, req)
            return
        reused = [key for key in keys[hits:] if key in slot_of]
        missing = [key for key in keys[hits:] if key not in slot_of] if reused else keys[hits:]
        if self.store_misses:
            policy.on_store_miss(missing, req)
        policy.on_request_access(keys[hits:], req)
        free = self.free
        deficit = len(missing) - len(free)
        if deficit > 0:
            victims = policy.evict(deficit, set(keys))
            if victims is None:
                missing = []
            else:
                for key in victims:
                    free.append(slot_of.pop(key))
        if missing:
            for key in missing:
                slot_of[key] = free.pop()
            policy.insert(missing, req)
        if self.finishes:
            policy.on_request_finished(keys, set(missing), {*keys[:hits], *reused}, req)

    def touch(self, keys: list[bytes]) -> None:
        self.policy.touch(keys)


def _significant_lead(candidate: deque[int], live: deque[int]) -> float:
    """The candidate's mean lead in hits per epoch over the live policy's, in the epochs both
    were both scored on (the latest `WINDOW_EPOCHS`: every shadow's window has the same
    epochs), when it is a lead worth a switch; else 0.

    Worth a switch: judged on at least `LEAD_EPOCHS` epochs, above `SWITCH_MARGIN` of the
    live policy's mean, and above `SWITCH_Z` standard errors of the per-epoch differences
    (a paired test: both shadows saw the same reads, so an epoch's difference is the
    policies', not the traffic's). A lead of a few noisy epochs is not one."""
    n = len(live)
    if n < LEAD_EPOCHS:
        return 0.0
    diffs = [c - v for c, v in zip(candidate, live, strict=True)]
    mean = sum(diffs) / n
    if mean <= SWITCH_MARGIN * sum(live) / n:
        return 0.0
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    if mean <= SWITCH_Z * math.sqrt(variance / n):
        return 0.0
    return mean


class AdaptivePolicy(CachePolicy):
    """Follows the best of `CANDIDATES` on a sampled shadow of the traffic (module
    docstring). ``live`` names the policy serving now; ``switches`` lists the changes."""

    def __init__(self, capacity: int, table: SlotTable) -> None:
        super().__init__(capacity, table)
        shift = 0
        while shift < MAX_SAMPLE_SHIFT and capacity >> (shift + 1) >= MIN_SHADOW_SLOTS:
            shift += 1
        self.sample_shift = shift
        self._sample_mask = (1 << shift) - 1
        self._shadow_capacity = max(1, capacity >> shift)
        self._shadows = [
            _Shadow(name, cls, self._shadow_capacity) for name, cls in CANDIDATES.items()
        ]
        self._epoch_reads = 0
        self._epoch_length = max(1, int(EPOCH_CAPACITIES * self._shadow_capacity))
        self.live = FIRST
        self._policy: CachePolicy = CANDIDATES[FIRST](capacity, table)
        self.observes_store_misses = self._policy.observes_store_misses
        self._generation = 0
        self.switches: list[tuple[int, str]] = []  # (epoch, policy switched to)
        self.epochs = 0

    # --- sampling and scoring ---------------------------------------------------------------

    def _sampled(self, keys: Sequence[bytes]) -> list[bytes]:
        if self.sample_shift == 0:
            return list(keys)
        mask = self._sample_mask
        return [key for key in keys if not crc32(key) & mask]

    def _observe(self, keys: Sequence[bytes]) -> None:
        sampled = self._sampled(keys)
        if not sampled:
            return
        for shadow in self._shadows:
            shadow.request(sampled)
        self._epoch_reads += len(sampled)
        if self._epoch_reads >= self._epoch_length:
            self._end_epoch()

    def _end_epoch(self) -> None:
        self._epoch_reads = 0
        self.epochs += 1
        for shadow in self._shadows:
            shadow.history.append(shadow.hits)
            shadow.hits = 0
        live = next(s for s in self._shadows if s.name == self.live)
        best, best_lead = None, 0.0
        for shadow in self._shadows:
            if shadow is live:
                continue
            lead = _significant_lead(shadow.history, live.history)
            if lead > best_lead:
                best, best_lead = shadow, lead
        if best is not None:
            self._switch(best.name)

    def _switch(self, name: str) -> None:
        order = _eviction_order(self._policy)
        policy = CANDIDATES[name](self.capacity, self.table)
        if isinstance(policy, KeyedPolicy):
            policy.adopt(order)
        else:
            fresh = RequestAccess()
            for key in order:
                policy.insert([key], fresh)
        self._policy = policy
        self.observes_store_misses = policy.observes_store_misses
        self.live = name
        self._generation += 1
        self.switches.append((self.epochs, name))

    def scores(self) -> dict[str, float]:
        """Each candidate's hits in the latest `WINDOW_EPOCHS` epochs (for inspection and tests)."""
        return {s.name: float(sum(s.history)) for s in self._shadows}

    # --- a request's policy state, tagged with the live policy's generation ---------------

    def _enter(self, req: RequestAccess) -> None:
        state: Any = req.policy_state
        if state is not None:
            generation, inner = state
            req.policy_state = inner if generation == self._generation else None

    def _leave(self, req: RequestAccess) -> None:
        if req.policy_state is not None:
            req.policy_state = (self._generation, req.policy_state)

    # --- the hooks: the live policy's, and the shadows' ------------------------------------

    def insert(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        self._enter(req)
        try:
            self._policy.insert(keys, req)
        finally:
            self._leave(req)

    def remove(self, key: bytes) -> None:
        self._policy.remove(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._policy.touch(keys)
        sampled = self._sampled(keys)
        if sampled:
            for shadow in self._shadows:
                shadow.touch(sampled)

    def on_store_miss(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        self._enter(req)
        try:
            self._policy.on_store_miss(keys, req)
        finally:
            self._leave(req)

    def on_request_access(self, keys: Sequence[bytes], req: RequestAccess) -> None:
        self._enter(req)
        try:
            self._policy.on_request_access(keys, req)
        finally:
            self._leave(req)

    def on_request_finished(
        self,
        order: Sequence[bytes],
        inserted: Collection[bytes],
        reused: Collection[bytes],
        req: RequestAccess,
    ) -> None:
        self._enter(req)
        try:
            self._policy.on_request_finished(order, inserted, reused, req)
        finally:
            req.policy_state = None
        self._observe(order)

    def evict(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        return self._policy.evict(n, protected)

    def clear(self) -> None:
        self._policy.clear()
        self._policy = CANDIDATES[FIRST](self.capacity, self.table)
        self.observes_store_misses = self._policy.observes_store_misses
        self.live = FIRST
        self._generation += 1
        for shadow in self._shadows:
            shadow.policy.clear()
            shadow.table.slot_of.clear()
            shadow.free = list(range(self._shadow_capacity - 1, -1, -1))
            shadow.hits = 0
            shadow.history.clear()
        self._epoch_reads = 0
