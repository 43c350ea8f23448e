"""The task runner: results are applied by the ledger's owner, once, and a failure to apply
one is logged and stops nothing (the async API's task group, a scheduler thread)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import pytest

from kvtier_async.api import TieredKVCache
from kvtier_async.engine import Engine, Job, JobResult, TaskRunner, ThreadedEngine
from kvtier_async.ledger import JobKind, LedgerError, PrimaryLedger, TieringLedger, make_offload_key
from kvtier_async.tiers.base import TierContext
from kvtier_async.tiers.memory import MemoryTier

BLOCK = 4096
FAILED = "applying a job result to the ledger failed"


def ks(*ids: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(8, "big"), 0) for i in ids]


def blocks(*ids: int) -> list[np.ndarray]:
    return [np.full(BLOCK, i, dtype=np.uint8) for i in ids]


def config() -> dict[str, Any]:
    return {"block_bytes": BLOCK, "num_slots": 8, "secondary_tiers": [{"type": "memory"}]}


def failing_once(ledger: TieringLedger, kind: JobKind) -> list[int]:
    """Make ``ledger.apply`` raise `LedgerError` after it applied the first task of ``kind``
    (a bug after the state changed); returns the ids of the tasks it failed."""
    apply, failed = ledger.apply, []

    def broken(task_id: int, ok: Sequence[bool]) -> None:
        task_kind = next(t.kind for t in ledger.outstanding() if t.task_id == task_id)
        apply(task_id, ok)
        if task_kind is kind and not failed:
            failed.append(task_id)
            raise LedgerError(f"injected failure applying task {task_id}")

    ledger.apply = broken  # type: ignore[method-assign]
    return failed


def failure_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(FAILED)]


@pytest.mark.anyio
async def test_a_failing_apply_is_logged_and_the_cache_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvtier_async.engine.runner"):
        async with TieredKVCache(config()) as cache:
            failed = failing_once(cache.ledger, JobKind.CASCADE)
            assert (await cache.store(ks(1, 2), blocks(1, 2))).stored == ks(1, 2)
            with anyio.fail_after(10):
                await cache.drain()  # the cascade's result failed to apply
            assert len(failed) == 1
            # the cache, its engine and its owner task go on: another cascade, a round trip
            assert (await cache.store(ks(3), blocks(3))).stored == ks(3)
            with anyio.fail_after(10):
                await cache.drain()
                await cache.reset()
                assert await cache.lookup(ks(1, 2, 3)) == 3  # promoted from the tier
            out = blocks(0, 0, 0)
            assert await cache.load(ks(1, 2, 3), out) == 3
            assert [int(b[0]) for b in out] == [1, 2, 3]
            assert not cache.has_pending_work()
    (line,) = failure_lines(caplog)
    assert "kind='cascade'" in line and f"task={failed[0]}" in line and "injected" in line


@pytest.mark.anyio
async def test_results_are_applied_by_the_owner_never_in_a_lane_worker() -> None:
    async with TieredKVCache(config()) as cache:
        ledger, where = cache.ledger, []
        apply, complete_store = ledger.apply, ledger.complete_store

        def spy_apply(task_id: int, ok: Sequence[bool]) -> None:
            where.append(anyio.get_current_task().name)
            apply(task_id, ok)

        def spy_store(keys: Any, success: bool = True) -> list[bytes]:
            where.append(anyio.get_current_task().name)
            return complete_store(keys, success)

        ledger.apply = spy_apply  # type: ignore[method-assign]
        ledger.complete_store = spy_store  # type: ignore[method-assign]
        await cache.store(ks(1, 2), blocks(1, 2))
        await cache.drain()
        await cache.reset()
        assert await cache.lookup(ks(1, 2)) == 2
    assert len(where) >= 4  # the store, its cascade, a lookup, a promotion
    assert not [name for name in where if "run_worker" in name], where


def test_a_failing_apply_does_not_reach_a_scheduler_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The vLLM scheduler's pattern (`collect` what `poll` returns): the error is logged
    with its task, the other tasks of the batch are applied, and the next step works."""
    tier = MemoryTier("mem", TierContext(block_bytes=BLOCK))
    memory = [bytearray(BLOCK) for _ in range(8)]
    ledger = TieringLedger(PrimaryLedger(8), ["mem"])
    runner = TaskRunner(ledger, [tier], batch=True)

    def make() -> Engine:
        return Engine([tier], lambda slot: memoryview(memory[slot]))

    def step(threaded: ThreadedEngine) -> None:
        threaded.submit(runner.take_jobs())
        threaded.drain(timeout_s=10)
        runner.collect(threaded.poll())

    for req in ("a", "b"):  # two requests' stores: two cascade tasks in one batched job
        out = ledger.prepare_store(ks(1) if req == "a" else ks(2), req)
        assert out is not None
        ledger.complete_store(out.keys_to_store)
    with (
        caplog.at_level(logging.ERROR, logger="kvtier_async.engine.runner"),
        ThreadedEngine(make) as threaded,
    ):
        failed = failing_once(ledger, JobKind.CASCADE)
        jobs = runner.take_jobs()
        assert len(jobs) == 1 and len(jobs[0].tasks) == 2
        threaded.submit(jobs)
        threaded.drain(timeout_s=10)
        runner.collect(threaded.poll())  # does not raise
        assert not ledger.outstanding() and not runner.has_pending_work()
        assert ledger.counters[0].cascaded == 2 and len(tier) == 2
        ledger.reset()
        for _ in range(3):  # lookup, promotion, then a hit
            ledger.walk_prefix("r", [ks(1, 2)])
            step(threaded)
        assert ledger.walk_prefix("r", [ks(1, 2)]) == (2, False)
    (line,) = failure_lines(caplog)
    assert f"task={failed[0]}" in line


def test_a_copy_result_releases_what_its_job_held() -> None:
    """`apply_copy` as the vLLM scheduler uses it for the workers' reports, and `abandon`
    for a job never queued: the ledger's reservations end either way."""
    ledger = TieringLedger(PrimaryLedger(4), [])
    runner = TaskRunner(ledger, [])
    out = ledger.prepare_store(ks(1, 2), "r")
    assert out is not None
    runner.apply_copy(JobKind.STORE, ks(1, 2), (True, False))
    assert ledger.primary.statistics().writing == 0
    assert ledger.primary.slot_of(ks(1)[0]) is not None
    assert ledger.primary.slot_of(ks(2)[0]) is None
    ledger.prepare_load(ks(1))
    runner.abandon([Job(JobKind.LOAD, tuple(ks(1)))], OSError("never queued"))
    assert ledger.primary.statistics().pinned == 0


def test_a_result_carries_its_tasks_back() -> None:
    ledger = TieringLedger(PrimaryLedger(4), ["a", "b"])
    out = ledger.prepare_store(ks(1), "r")
    assert out is not None
    ledger.complete_store(out.keys_to_store)
    runner = TaskRunner(ledger, [], batch=True)
    jobs = runner.take_jobs()
    assert [(j.kind, j.tier) for j in jobs] == [(JobKind.CASCADE, 0), (JobKind.CASCADE, 1)]
    result = JobResult.failure(jobs[0], OSError("x"))
    assert result.tasks == jobs[0].tasks and result.tasks[0].task_id in {
        t.task_id for t in ledger.outstanding()
    }
    assert JobResult.cancelled_result(jobs[1]).error.result.job_id == jobs[1].job_id  # type: ignore[union-attr]
