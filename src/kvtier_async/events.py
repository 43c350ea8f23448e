"""KV events: where blocks are, for whoever tracks prefixes (a router, a dashboard).

The same three events as vLLM 0.33's KV-event stream (``vllm.distributed.kv_events``), with
vLLM's medium strings (``"CPU"`` for the CPU tier, ``"STORAGE"`` for a secondary tier):

- `BlockStored`: blocks became readable in a medium (a store reached the CPU tier, a cascade
  reached a secondary tier, a promotion brought a block back to the CPU tier);
- `BlockRemoved`: blocks left a medium (evicted from the CPU tier, or deleted by a secondary
  tier: its own GC, or a block that failed verification);
- `AllBlocksCleared`: the CPU tier was reset (the secondary tiers keep their blocks).

An event lists block hashes (an offload key without its 4-byte group index) of one KV-cache
group, like vLLM's; ``tier`` names the secondary tier for ``STORAGE`` events (vLLM calls it
``ownership``). A block written and evicted between two deliveries still gets both events.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvtier_async.ledger import Medium, OffloadingEvent, get_group_idx, split_offload_key

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "to_kv_events"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    group_idx: int
    medium: str
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    group_idx: int
    medium: str
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str = Medium.CPU.value


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def to_kv_events(events: Iterable[OffloadingEvent]) -> Iterator[KVEvent]:
    """The ledger's events as KV events, one per (event, KV-cache group); failed writes'
    bookkeeping removals (``metadata_only``) are not announced, as in vLLM; a reset's
    removal of every key is one `AllBlocksCleared`."""
    for event in events:
        if event.metadata_only:
            continue
        if event.cleared:
            yield AllBlocksCleared(event.medium.value)
            continue
        cls = BlockRemoved if event.removed else BlockStored
        by_group: dict[int, list[bytes]] = {}
        for key in event.keys:
            by_group.setdefault(get_group_idx(key), []).append(split_offload_key(key)[0])
        for group, hashes in by_group.items():
            yield cls(tuple(hashes), group, event.medium.value, event.tier)
