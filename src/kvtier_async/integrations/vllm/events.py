"""The ledger's events as vLLM 0.33 KV events, through vLLM's own translation.

vLLM's OffloadingConnector turns its manager's `OffloadingEvent`s into KV events with
`OffloadingEventsTracker` (``kv_connector/v1/offloading/events.py``); so do we, with the
tracker in its default mode (no self-describing payloads): a `BlockStored` per stored key
(its block hash, its KV-cache group, ``block_size`` 0, no token ids), a `BlockRemoved` per
group of removed keys, vLLM's medium strings (``"CPU"``, ``"STORAGE"``) and the secondary
tier's name as ``ownership``. A failed write's bookkeeping removal is not announced. A
reset of the CPU tier (a ``cleared`` event) is one `AllBlocksCleared`; the tracker forgets
what it held, as vLLM's scheduler resets it in ``reset_cache``. On a vLLM whose events have
no ``metadata_only`` (0.32, whose manager records nothing for a failed write), those
bookkeeping removals are dropped here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.kv_offload.base import Medium as VllmMedium
from vllm.v1.kv_offload.base import OffloadingEvent as VllmEvent
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, OffloadKey

from kvtier_async.ledger import OffloadingEvent

from ._compat import HAS_METADATA_ONLY

__all__ = ["VllmEvents", "events_to_vllm"]


class VllmEvents:
    """Translates batches of ledger events into vLLM KV events, in order."""

    def __init__(self) -> None:
        config = OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=False
        )
        self.tracker = OffloadingEventsTracker(config)

    def translate(self, events: Iterable[OffloadingEvent]) -> list[Any]:
        out: list[Any] = []
        batch: list[VllmEvent] = []
        for event in events:
            if not event.cleared:
                if HAS_METADATA_ONLY or not event.metadata_only:
                    batch.append(_as_vllm(event))
                continue
            out += self.tracker.take_events(batch)
            batch = []
            self.tracker.reset()
            out.append(AllBlocksCleared())
        out += self.tracker.take_events(batch)
        return out


def _as_vllm(event: OffloadingEvent) -> VllmEvent:
    extra: dict[str, Any] = {"metadata_only": event.metadata_only} if HAS_METADATA_ONLY else {}
    return VllmEvent(
        keys=[OffloadKey(key) for key in event.keys],
        medium=VllmMedium[event.medium.name],
        removed=event.removed,
        ownership=event.tier,
        **extra,
    )


def events_to_vllm(events: Iterable[OffloadingEvent]) -> list[Any]:
    """One batch of ledger events as vLLM KV events (see the module docstring)."""
    return VllmEvents().translate(events)
