"""One way to build a cache's parts from a validated config, for both faces.

`TieredKVCache` (the async API) and the vLLM connector's scheduler side both call
`assemble`: the secondary tiers from ``secondary_tiers`` (each named by its config's path in
errors), the CPU tier's ledger with the config's policy, store threshold and tracker, and
the tiering ledger over them; then `Parts.runner` and `Parts.engine` for the owner's half
and the engine. What differs between the faces is what each passes: the async API runs
its device copies in the engine (``device=``) and applies results as they are delivered;
the connector batches its tier jobs (``batch=True``) and runs the engine on a thread of its
own (`kvtier_async.engine.ThreadedEngine`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier_async import defaults
from kvtier_async.engine import Engine, Executor, JobResult, TaskRunner
from kvtier_async.engine.engine import BlockView
from kvtier_async.ledger import PrimaryLedger, TieringLedger
from kvtier_async.settings import CommonConfig
from kvtier_async.tiers.base import SecondaryTier, TierContext, make_tier

__all__ = ["Parts", "assemble"]


@dataclass(frozen=True, eq=False)
class Parts:
    """A cache's tiers and ledger, built by `assemble`, not yet opened."""

    config: CommonConfig
    tiers: list[SecondaryTier]
    ledger: TieringLedger

    def runner(
        self,
        *,
        batch: bool = False,
        on_applied: Callable[[], None] | None = None,
    ) -> TaskRunner:
        """The owner's half: ledger tasks out as jobs, results back (`TaskRunner`)."""
        return TaskRunner(self.ledger, self.tiers, batch=batch, on_applied=on_applied)

    def engine(
        self,
        block_view: BlockView,
        *,
        device: Executor | None = None,
        device_workers: int = defaults.DEVICE_WORKERS,
        on_result: Callable[[JobResult], None] | None = None,
    ) -> Engine:
        """The engine over the tiers, with the config's ``queue_depth`` per lane."""
        return Engine(
            self.tiers,
            block_view,
            device=device,
            device_workers=device_workers,
            queue_depth=self.config.queue_depth,
            on_result=on_result,
        )


def assemble(config: CommonConfig, num_slots: int, ctx: TierContext) -> Parts:
    """The tiers and ledgers of a cache of ``num_slots`` CPU slots, as ``config`` says;
    ``ctx`` is what every tier is told about the blocks (their size, the model, the
    instance). Opens nothing: the tiers open when their engine is entered."""
    tiers = [make_tier(tier, ctx) for tier in config.secondary_tiers]
    primary = PrimaryLedger(
        num_slots,
        policy=config.eviction_policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
    )
    ledger = TieringLedger(
        primary,
        [tier.name for tier in tiers],
        store_policy=config.store_policy,
        counters=[tier.counters for tier in tiers],  # one set per tier, fed by both
    )
    return Parts(config, tiers, ledger)
