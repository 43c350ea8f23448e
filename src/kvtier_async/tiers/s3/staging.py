"""Blocks a lookup fetched, kept for the load that follows: the obj tier's GET-as-lookup.

A lookup that HEADs a key and a load that GETs it cost two requests per block, each a round
trip and about a millisecond of client CPU (aiobotocore). So the obj tier's lookup GETs the
object instead: its answer is the verified block itself, staged here, and the promotion that
a hit starts (the next step) copies it into the slot with no request at all. One request per
block instead of two, and a corrupt object is found (and deleted) before it counts as a hit.

`Staging` is bounded: at most ``limit_bytes // block_bytes`` payload buffers exist at once,
reused, so its memory never grows past ``limit_bytes``. `acquire` hands out a free buffer,
allocates one while under the bound, or else evicts the least recently staged block (unread:
counted in ``evicted``); None when every buffer is held by a fetch in flight (the lookup
then HEADs). Objects are immutable under their key (a block's name is its content's hash, and
every staged payload verified), so a staged block never goes stale; it is dropped only by
eviction, by `take` or by `clear`. Not thread-safe: the tier runs on one event loop.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Staging"]


class Staging:
    """Verified block payloads by key, at most ``limit_bytes`` of buffers (see the module)."""

    def __init__(self, limit_bytes: int, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.capacity = max(0, limit_bytes) // block_bytes  # buffers, staged or in use
        self._staged: OrderedDict[bytes, bytearray] = OrderedDict()
        self._free: list[bytearray] = []
        self._allocated = 0
        self.staged = 0  # blocks staged by lookups
        self.served = 0  # loads served from a staged block
        self.evicted = 0  # staged blocks dropped unread to make room

    def __len__(self) -> int:
        return len(self._staged)

    def __contains__(self, key: bytes) -> bool:
        return key in self._staged

    @property
    def allocated_bytes(self) -> int:
        """Bytes of payload buffers that exist (never more than ``capacity`` buffers)."""
        return self._allocated * self.block_bytes

    @property
    def in_use(self) -> int:
        """Buffers handed out by `acquire` or `take` and not given back yet."""
        return self._allocated - len(self._free) - len(self._staged)

    def acquire(self) -> bytearray | None:
        """A payload buffer for a fetch, or None when all ``capacity`` are in flight."""
        if self._free:
            return self._free.pop()
        if self._allocated < self.capacity:
            self._allocated += 1
            return bytearray(self.block_bytes)
        if self._staged:
            self.evicted += 1
            return self._staged.popitem(last=False)[1]
        return None

    def release(self, buffer: bytearray) -> None:
        """Give back a buffer from `acquire` or `take`."""
        self._free.append(buffer)

    def stage(self, key: bytes, buffer: bytearray) -> None:
        """Keep ``buffer`` (a verified payload from `acquire`) as ``key``'s block."""
        old = self._staged.pop(key, None)
        if old is not None:
            self._free.append(old)
        self._staged[key] = buffer
        self.staged += 1

    def touch(self, key: bytes) -> bool:
        """Whether ``key`` is staged; if so it becomes the most recently staged."""
        if key not in self._staged:
            return False
        self._staged.move_to_end(key)
        return True

    def take(self, key: bytes) -> bytearray | None:
        """``key``'s staged payload, no longer staged (`release` it after use), or None."""
        buffer = self._staged.pop(key, None)
        if buffer is not None:
            self.served += 1
        return buffer

    def clear(self) -> None:
        """Drop every staged block and free buffer (the tier closed)."""
        self._staged.clear()
        self._free.clear()
        self._allocated = 0
