"""`TierBackend`: what the engine needs of a secondary tier, as a structural protocol.

The engine sits below the tiers (ledger <- engine <- tiers/transfer <- api/integrations), so
it names the calls it makes here and never imports `kvtier_async.tiers`. Every
`kvtier_async.tiers.base.SecondaryTier` satisfies this protocol; the contract a tier must
honour (call order, concurrency, cancellation) is written there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier_async.ledger import TierCounters

__all__ = ["TierBackend"]


class TierBackend(Protocol):
    """A secondary tier as the engine drives it: opened, closed, and three batched calls."""

    name: str
    read_workers: int
    write_workers: int
    counters: TierCounters  # the tier's counter set: its lanes add bytes and seconds

    @property
    def kind(self) -> str: ...

    async def open(self) -> None: ...

    async def aclose(self) -> None: ...

    async def lookup(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]: ...

    async def load(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]: ...

    def take_removed(self) -> list[bytes]: ...
