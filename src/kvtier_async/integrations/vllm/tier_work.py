"""The connector's tier side: the tiers, the runner, the engine thread, the CPU region.

`ConnectorScheduler` (`.scheduler`) keeps the requests and the device jobs; this keeps
what moves blocks between the CPU tier and the secondary tiers, built from the cache's
`kvtier_async.assembly.Parts`: the `TaskRunner` between the tiering ledger and the engine,
the `ThreadedEngine` that runs the tier jobs, and the CPU region the tiers read and write
(the scheduler's own view of it: every worker's row of a slot). The scheduler calls
`drain` and `submit` each step, `wait_idle` after a step that scheduled nothing, `flush`
in ``reset_cache`` and `close` at ``shutdown``.

Cascades are not what a request waits for: they wait in the ledger (pinned) until other
tier work goes out (a lookup or a promotion: the loop is woken anyway), the oldest waited
``cascade_hold_s`` (20 ms), or ``cascade_hold_blocks`` (64) are queued. Each wake of the
loop costs the scheduler thread a system call and its loop thread a turn with the GIL; in
the sched benchmark, handing cascades out at most every 20 ms took about a tenth off our
added step time with an fs tier, and the blocks still reach the tier within a few steps.

Secondary tiers run on an `Engine` inside a `ThreadedEngine`. The ledger decides, the
engine executes, this thread applies: a `TaskRunner` turns the ledger's tasks into jobs
(one per kind and tier each step) and applies what ``poll`` returns at the start of
``get_num_new_matched_tokens`` and ``build_connector_meta`` and at the end of
``update_connector_output`` (`TaskRunner.collect`), with the blocks each tier deleted on
its own meanwhile (damaged, GC: removal events); the device jobs the workers report are
applied by the same runner (`TaskRunner.apply_copy`). An error while applying is logged,
never raised into vLLM. Only `TierWork.flush` (``reset_cache``) and `TierWork.close`
(``shutdown``) wait.

Idle steps. While a request waits for a tier (its lookup or promotion out), vLLM's engine
core schedules nothing and steps again at once, holding the GIL but for the interpreter's
switch interval (5 ms), which the tier engine's threads need several times per job: in a
real engine a lookup took 30 ms and a promotion of 7.5 MB 40-60 ms, almost all of it waiting
for the GIL. So a step that scheduled no token, with tier work out, ends with a wait for the
tier's results (`ThreadedEngine.wait`, GIL released, ``idle_wait_s`` = 2 ms at most; a
result ends it at once). A step with work to do never waits; a request that arrives during
an idle wait is scheduled that much later.

Flush. `flush` ends every tier job (`ThreadedEngine.flush`, ``wait_timeout_s`` at most,
the cascades still queued in the ledger included): a cascade reads a CPU slot and a promotion
writes one, and a reset frees them all. A job that cannot be made to end in time is left
running, with a warning naming it, and `flush` answers False (the reset is refused).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier_async._log import get_logger
from kvtier_async.assembly import Parts
from kvtier_async.engine import Engine, ThreadedEngine
from kvtier_async.ledger import JobKind, LedgerStatistics
from kvtier_async.memory import SharedRegion, close_region
from kvtier_async.metrics import TierMetrics, tier_metrics

from .config import ConnectorConfig
from .layout import OffloadLayout

__all__ = ["TierWork"]

log = get_logger(__name__)


class TierWork:
    """The tier side of one connector scheduler (see the module docstring)."""

    #: How long cascades may wait to be handed out with other work (seconds), and how
    #: many blocks of them may wait (see the module docstring).
    cascade_hold_s = 0.02
    cascade_hold_blocks = 64
    #: How long a step that scheduled nothing waits for tier results (seconds).
    idle_wait_s = 0.002

    def __init__(self, parts: Parts, layout: OffloadLayout, config: ConnectorConfig) -> None:
        self.layout = layout
        self.config = config
        self.ledger = parts.ledger
        self.tiers = parts.tiers
        self.runner = parts.runner(batch=True)
        self._cascades_since: float | None = None  # when the oldest queued cascade was
        self._region: SharedRegion | None = None
        self.threaded: ThreadedEngine | None = self._start(parts)

    def _start(self, parts: Parts) -> ThreadedEngine:
        """The tier engine on its loop thread; started even with no tier (one code path:
        idle, it is a thread parked on a socket, and the per-step cost of driving it is
        measured whatever the configuration)."""
        layout, tiers = self.layout, parts.tiers
        block_view = self._block_view() if tiers else _no_block_view

        def make() -> Engine:
            return parts.engine(block_view)

        threaded = ThreadedEngine(make).__enter__()
        log.info(
            "kvtier connector engine started",
            tiers=[t.name for t in tiers],
            slots=layout.num_slots,
            instance=layout.instance_id,
        )
        return threaded

    def _block_view(self) -> Callable[[int], memoryview]:
        """Slot memory for the tiers: the CPU region, every worker's row of a slot."""
        layout = self.layout
        self._region = SharedRegion(
            layout.instance_id,
            layout.num_slots,
            layout.slot_bytes,
            num_workers=layout.num_workers,
            worker_rank=0,
            directory=self.config.region_dir,
            wait_timeout_s=self.config.wait_timeout_s,
            role="scheduler",  # a place taken twice (another engine, the same id) is refused
            token=layout.token,
        )
        rows = self._region.rows.cast("B")
        span = layout.row_bytes * layout.num_workers

        def block_view(slot: int) -> memoryview:
            return rows[slot * span : (slot + 1) * span]

        return block_view

    # --- each step ----------------------------------------------------------------------

    def drain(self) -> None:
        """Apply the tier results that came back (see the module docstring)."""
        threaded, runner = self.threaded, self.runner
        if threaded is None or not runner.has_pending_work():  # nothing out: nothing back
            return
        results = threaded.poll()
        if results:
            runner.collect(results)

    def submit(self) -> None:
        """The deferred tier jobs, and jobs for the tasks the ledger decided since; the
        cascades wait (see the module docstring) unless something else goes now, or the
        oldest has waited `cascade_hold_s`, or `cascade_hold_blocks` are queued."""
        threaded = self.threaded
        if threaded is None or not self.tiers:
            return  # no tier: no tier job, ever
        ledger = self.ledger
        cascades = ledger.has_urgent_work()
        queued = ledger.queued_cascades
        if queued:
            now = time.monotonic()
            if self._cascades_since is None:
                self._cascades_since = now
            cascades = (
                cascades
                or now - self._cascades_since >= self.cascade_hold_s
                or queued >= self.cascade_hold_blocks
            )
            if cascades:
                self._cascades_since = None
        jobs = self.runner.take_jobs(cascades=cascades)
        if jobs:
            threaded.submit(jobs, wake=False)
            threaded.wake()

    def wait_idle(self) -> None:
        """A step that scheduled nothing, with tier work out: wait for its results
        (`idle_wait_s` at most) instead of spinning (see the module docstring)."""
        threaded = self.threaded
        if threaded is not None and self.tiers and self.runner.has_pending_work():
            threaded.wait(self.idle_wait_s)

    def copy_done(self, is_store: bool, keys: Sequence[bytes], ok: bool, job_id: int) -> None:
        """A device job every worker reported: the ledger applies it (`TaskRunner.apply_copy`)."""
        kind = JobKind.STORE if is_store else JobKind.LOAD
        self.runner.apply_copy(kind, keys, (ok,) * len(keys), job_id=job_id)

    def has_pending_work(self) -> bool:
        threaded = self.threaded
        return bool(
            self.runner.has_pending_work()
            or self.ledger.has_pending_work()
            or (threaded is not None and threaded.has_pending_work())
        )

    def statistics(self) -> tuple[LedgerStatistics, list[TierMetrics]]:
        """The CPU ledger's slots and each tier's figures (fed from the engine's thread:
        plain counters, each exact)."""
        threaded = self.threaded
        engine = threaded.engine if threaded is not None else None
        depths = engine.queue_depths() if engine is not None else []
        return self.ledger.primary.statistics(), tier_metrics(self.tiers, depths)

    # --- waits: a reset, the shutdown -----------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """End every tier job (see the module docstring), cascades queued in the ledger
        included, within ``timeout`` (default ``wait_timeout_s``); False if some are still
        running."""
        threaded = self.threaded
        if threaded is None:
            return True
        timeout = self.config.wait_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        runner = self.runner
        self.drain()
        while self.ledger.has_pending_work():
            runner.take_jobs()  # a flush takes jobs not handed over yet
            jobs = runner.in_flight()
            if not jobs:
                break
            left = max(0.0, deadline - time.monotonic())
            abandoned = threaded.flush(jobs, left, grace_s=min(1.0, timeout))
            self.drain()
            if not abandoned:
                continue
            out = {job.job_id for job in runner.in_flight()}
            running = [task for job in abandoned if job.job_id in out for task in job.tasks]
            log.warning(
                "reset_cache: tier jobs abandoned at the deadline",
                jobs=len(abandoned),
                still_running=[(t.kind.value, t.tier, len(t.keys)) for t in running],
                timeout_s=timeout,
            )
            if running:
                log.warning("reset_cache refused: tier jobs still touch the CPU tier")
                return False
        return True

    def close(self) -> None:
        """Hand the cascades still queued to the tiers and wait for the tier jobs out, for
        ``close_timeout_s`` at most (blocks stored in the CPU tier reach the files and the
        object store, where the next engine finds them), then stop the tier engine and
        close the region. Never raises into vLLM's shutdown."""
        if self.threaded is not None:
            try:
                if self.tiers and not self.flush(self.config.close_timeout_s):
                    log.warning(
                        "shutdown: tier jobs abandoned", timeout_s=self.config.close_timeout_s
                    )
            except Exception as exc:  # never raised into vLLM's shutdown
                log.warning("shutdown: the last tier jobs failed", error=repr(exc))
            self.threaded.close()  # then dropped: its engine holds views of the region
            self.threaded = None
        region, self._region = self._region, None
        if region is not None:
            close_region(region)


def _no_block_view(slot: int) -> memoryview:
    raise RuntimeError("no secondary tier: no slot memory is needed")
