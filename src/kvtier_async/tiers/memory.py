"""A memory secondary tier: a dict of bytes with configurable latency and failure injection.

It implements the same contract as the fs and S3 tiers and serves as the example tier, the
demo's second level and the engine tests' controllable tier. Its hooks for tests:

- ``gate``: when set to an unset `anyio.Event`, every store/load/lookup waits for it after
  announcing itself on ``entered`` (an `anyio.Event` set when a call starts waiting), so a
  test can cancel at that await point without sleeping;
- ``fail_keys``: keys whose store and load fail.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, Literal

import anyio
from pydantic import Field

from .base import SecondaryTier, TierConfig, TierContext, TierStatistics

__all__ = ["MemoryTier", "MemoryTierConfig", "from_config"]


DEFAULT_WORKERS: Final = 2  # read and write workers each


class MemoryTier(SecondaryTier):
    kind = "memory"

    def __init__(
        self,
        name: str,
        ctx: TierContext,
        *,
        read_workers: int = DEFAULT_WORKERS,
        write_workers: int = DEFAULT_WORKERS,
        latency_s: float = 0.0,
        lookup_latency_s: float = 0.0,
        fail_rate: float = 0.0,
        capacity_bytes: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(name, ctx, read_workers, write_workers)
        self.latency_s = latency_s
        self.lookup_latency_s = lookup_latency_s
        self.fail_rate = fail_rate
        self.capacity_bytes = capacity_bytes
        self.fail_keys: set[bytes] = set()
        self.gate: anyio.Event | None = None
        self.entered = anyio.Event()
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._size = 0
        self._random = random.Random(seed)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    async def _wait(self, delay: float) -> None:
        if self.gate is not None:
            self.entered.set()
            await self.gate.wait()
        if delay:
            await anyio.sleep(delay)

    def _fails(self, key: bytes) -> bool:
        return key in self.fail_keys or (
            self.fail_rate > 0 and self._random.random() < self.fail_rate
        )

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        await self._wait(self.lookup_latency_s)
        return [key in self._data for key in keys]

    async def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        await self._wait(self.latency_s)
        return [self._store_one(key, block) for key, block in zip(keys, blocks)]

    def _store_one(self, key: bytes, block: memoryview) -> bool:
        if self._fails(key):
            return False
        if key in self._data:
            self._data.move_to_end(key)
            self.counters.present += 1
            return True
        self._data[key] = bytes(block)
        self._size += len(block)
        self.counters.written += 1
        self._evict()
        return True

    def _evict(self) -> None:
        while self.capacity_bytes is not None and self._size > self.capacity_bytes and self._data:
            _, value = self._data.popitem(last=False)
            self._size -= len(value)

    async def load(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        await self._wait(self.latency_s)
        return [self._load_one(key, block) for key, block in zip(keys, blocks)]

    def _load_one(self, key: bytes, block: memoryview) -> bool:
        value = self._data.get(key)
        if value is None or len(value) != len(block) or self._fails(key):
            self._data.pop(key, None)
            return False
        block[:] = value
        self._data.move_to_end(key)
        return True

    def statistics(self) -> TierStatistics:
        return TierStatistics(
            self.name,
            self.kind,
            detail=f"{len(self._data)} blocks in memory",
            used_bytes=self._size,
            max_bytes=self.capacity_bytes,
        )


class MemoryTierConfig(TierConfig):
    """``{"type": "memory", ...}``: a tier in this process's memory, for tests and demos,
    with an injected latency and failure rate."""

    type: Literal["memory"] = "memory"
    latency_s: float = Field(0.0, ge=0.0, le=60.0, allow_inf_nan=False)
    lookup_latency_s: float = Field(0.0, ge=0.0, le=60.0, allow_inf_nan=False)
    fail_rate: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    capacity_bytes: int | None = Field(None, ge=1)
    n_read_workers: int = Field(DEFAULT_WORKERS, ge=1, le=256)
    n_write_workers: int = Field(DEFAULT_WORKERS, ge=1, le=256)
    seed: int = Field(0, ge=0)


def from_config(config: MemoryTierConfig, name: str, ctx: TierContext) -> MemoryTier:
    """Build a `MemoryTier` from its validated config."""
    return MemoryTier(
        name,
        ctx,
        read_workers=config.n_read_workers,
        write_workers=config.n_write_workers,
        latency_s=config.latency_s,
        lookup_latency_s=config.lookup_latency_s,
        fail_rate=config.fail_rate,
        capacity_bytes=config.capacity_bytes,
        seed=config.seed,
    )
