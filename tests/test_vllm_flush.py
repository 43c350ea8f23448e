"""Flushes inside vLLM 0.33's real Scheduler: no stale bytes after a preemption or a reset.

A store reads GPU blocks that vLLM may hand to another request once the store's request is
preempted or finished; the scheduler then asks the workers to flush it (finish it before the
forward pass overwrites those blocks). These tests make that hard: copies run as engine
jobs (``worker_copies: "engine"``) behind a queue of depth 1, so most stores are deferred
("queue full, offer again") at least once, and slow secondary tiers keep cascades in
flight. Afterwards every block in the CPU tier and in every secondary tier (a slow memory
tier, fs, S3 on moto) is read back and compared with the bytes the fake model computed for
its key: a store that ran after the forward pass would have copied another request's K/V
under the old key, with a valid checksum.
"""

from __future__ import annotations

import mmap
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_harness as vh
from vllm_harness import OURS, shared_prefix_requests

pytestmark = pytest.mark.vllm
pytest_plugins = ["conftest_s3"]

# 48 GPU blocks of 16 tokens for 40 requests over 4 shared documents, each decoding 16-48
# tokens: the scheduler preempts (10-20 times, whenever tier lookups answer).
TRACE = shared_prefix_requests(seed=7, num_requests=40, max_tokens=(16, 48))
SMALL_GPU: dict[str, Any] = {"num_gpu_blocks": 48, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    pytest.importorskip("vllm")
    vh.load()


def flushing(tiers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """Our connector with engine copies behind a queue of depth 1, over ``tiers``."""
    config = {
        **OURS["extra_config"],
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": tiers,
        "worker_copies": "engine",
        "queue_depth": 1,
        **extra,
    }
    return {**OURS, "extra_config": config}


@pytest.fixture
def tiers(moto_s3: Any, s3_bucket: str, tmp_path: Path) -> list[dict[str, Any]]:
    return [
        {"type": "memory", "name": "slow", "latency_s": 0.003},
        {"type": "fs", "root_dir": str(tmp_path / "kv")},
        # Generous deadlines: moto shares this process (and its GIL) with the scheduler and
        # the fake model, and on a loaded machine a 1 s lookup can time out and open the
        # breaker (on a slow machine, a lookup once took over 10 s: the scheduler's thread
        # steps without a pause); this test is about stale bytes, not a slow endpoint.
        {**moto_s3.tier_config(s3_bucket), "timeout_s": 30.0, "lookup_timeout_s": 30.0},
    ]


# --- what every key should hold --------------------------------------------------------


def expected_slots(h: Any) -> dict[bytes, bytes]:
    """Offload key -> the slot bytes the fake model computed for it, for every full block
    of every request the harness saw: one page per layer, its bytes in address order (the
    layouts the harness resolves put a block's page in one run: LBHNC or LBNHC)."""
    from kvtier_async.ledger import make_offload_key

    assert h.layout in ("LBHNC", "LBNHC")
    layers = list(h.kv_caches)
    out: dict[bytes, bytes] = {}
    for request in h.requests.values():
        tokens = request.all_token_ids
        for index, block_hash in enumerate(request.block_hashes):
            key = make_offload_key(bytes(block_hash), 0)
            if key in out:
                continue
            begin, end = index * h.block_size, (index + 1) * h.block_size
            pages = []
            for layer, name in enumerate(layers):
                page = torch.empty_like(h.kv_caches[name][0])  # its strides too
                page[:] = h.expected_kv(tokens, begin, end, layer).transpose(0, 1)
                order = sorted(range(page.dim()), key=lambda d: -page.stride(d))
                physical = page.permute(order).contiguous()
                pages.append(physical.view(torch.int8).numpy().tobytes())
            out[key] = b"".join(pages)
    return out


def cpu_tier_blocks(h: Any) -> Iterator[tuple[bytes, bytes]]:
    """(key, slot bytes) of every readable key of the CPU tier."""
    primary = h.connector.scheduler.ledger.primary
    region = h.worker_connector.worker._region
    # Readable: ref count 0 (-1 is being written).
    readable = [key for key in primary.keys() if primary.ref_count(key) == 0]  # noqa: SIM118
    for key in readable:
        yield key, bytes(region.slot_view(primary.slot_of(key)))


def tier_blocks(h: Any, keys: list[bytes]) -> dict[str, dict[bytes, bytes]]:
    """Per secondary tier, the keys it holds among ``keys`` and their bytes, read back
    through the tier's own load (which verifies its checksum)."""
    scheduler = h.connector.scheduler
    engine = scheduler.tier_work.threaded.engine
    size = scheduler.layout.block_span_bytes
    row = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = memoryview(mmap.mmap(-1, row * len(keys)))
    blocks = [mapping[i * row : i * row + size] for i in range(len(keys))]
    out: dict[str, dict[bytes, bytes]] = {}
    try:
        for tier in engine.tiers:
            ok = scheduler.tier_work.threaded.call(tier.load, keys, blocks)
            out[tier.name] = {k: bytes(b) for k, b, good in zip(keys, blocks, ok) if good}
    finally:
        del blocks
        mapping.release()
    return out


def assert_every_block_holds_its_bytes(h: Any, *, min_cascaded: int) -> None:
    expected = expected_slots(h)
    slot_bytes = h.connector.scheduler.layout.slot_bytes
    in_cpu = dict(cpu_tier_blocks(h))
    assert in_cpu, "the CPU tier is empty: nothing was checked"
    for key, got in in_cpu.items():
        assert got[:slot_bytes] == expected[key], f"CPU tier: stale bytes under {key.hex()}"
    for name, held in tier_blocks(h, list(expected)).items():
        assert len(held) >= min_cascaded, f"{name}: only {len(held)} blocks"
        for key, got in held.items():
            assert got[:slot_bytes] == expected[key], f"{name}: stale bytes under {key.hex()}"


# --- the tests --------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemptions_with_stores_queued_leave_no_stale_bytes(
    tiers: list[dict[str, Any]], async_scheduling: bool
) -> None:
    with vh.VllmHarness(**SMALL_GPU, **flushing(tiers), async_scheduling=async_scheduling) as h:
        h.drive(TRACE, per_step=2)
        assert h.stats.preemptions > 0
        assert h.stats.external_hit_tokens > 0
        h.assert_no_leaks()
        assert_every_block_holds_its_bytes(h, min_cascaded=20)


def test_resets_with_stores_queued_leave_no_stale_bytes(tiers: list[dict[str, Any]]) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` every 5 steps or so: every running
    request is preempted, its stores flushed, the CPU tier cleared while stores and
    cascades are queued."""
    pending = list(TRACE)
    resets, last_reset = 0, 0
    with vh.VllmHarness(**SMALL_GPU, **flushing(tiers)) as h:
        steps = 0
        while pending or h.has_work():
            for _ in range(2):
                if pending:
                    h.add_request(*pending.pop(0))
            h.step()
            steps += 1
            if (
                steps - last_reset >= 5
                and stores_in_flight(h)
                and not holds_blocks_while_waiting(h)
            ):
                assert h.scheduler.reset_prefix_cache(
                    reset_running_requests=True, reset_connector=True
                )
                resets, last_reset = resets + 1, steps
        assert resets >= 3
        h.assert_no_leaks()
        assert_every_block_holds_its_bytes(h, min_cascaded=5)


def stores_in_flight(h: Any) -> bool:
    return any(job.is_store for job in h.connector.scheduler._jobs)


def holds_blocks_while_waiting(h: Any) -> bool:
    """Whether a request that is not running holds GPU blocks (one waiting for its load, or
    loaded and waiting to be scheduled): vLLM cannot reset the prefix cache then."""
    running = {request.request_id for request in h.scheduler.running}
    managers = h.scheduler.kv_cache_manager.coordinator.single_type_managers
    return any(
        blocks and req_id not in running
        for manager in managers
        for req_id, blocks in manager.req_to_blocks.items()
    )


def test_a_flush_past_its_deadline_abandons_stores_cleanly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Copies that never end before the deadline: the flush returns without raising, the
    stores it abandons are reported failed (their slots freed, nothing cascaded) and a
    warning names them; the run goes on and ends clean."""
    import threading

    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    config = flushing([fs], wait_timeout_s=0.05)
    with vh.VllmHarness(**SMALL_GPU, **config) as h:
        worker = h.worker_connector.worker
        router = worker._router
        transfer = router.transfer
        gate = threading.Event()

        async def slow_store(src: Any, dst: Any) -> Any:
            import anyio

            if src.medium.value == "GPU":  # a store: held until the gate opens
                await anyio.to_thread.run_sync(gate.wait, 10.0)
            return await transfer(src, dst)

        monkeypatch.setattr(router, "transfer", slow_store)
        ledger = h.connector.scheduler.ledger
        complete_store = ledger.complete_store
        failed: list[bytes] = []

        def spy(keys: Any, success: bool = True) -> Any:
            keys = list(keys)
            if not success:
                failed.extend(keys)
            return complete_store(keys, success)

        monkeypatch.setattr(ledger, "complete_store", spy)
        pending = list(TRACE)
        with caplog.at_level("WARNING"):
            while pending or h.has_work():
                for _ in range(2):
                    if pending:
                        h.add_request(*pending.pop(0))
                h.step()
                if h.stats.preemptions and abandoned_warnings(caplog):
                    gate.set()  # from now on copies end
        assert abandoned_warnings(caplog), "no flush ran past its deadline"
        assert failed, "no abandoned store was reported failed"
        h.assert_no_leaks()
        stats = ledger.primary.statistics()
        assert stats.pinned == 0 and stats.writing == 0
        assert_every_block_holds_its_bytes(h, min_cascaded=1)


def abandoned_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]


def step_until(h: Any, done: Any, timeout_s: float = 30.0) -> None:
    """Step until ``done()`` (tier work answers in the loop thread's time, not in steps)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not done after {timeout_s} s"
        h.step()


def cascading(h: Any) -> bool:
    """Whether a cascade (CPU tier -> secondary tier) is in flight."""
    from kvtier_async.ledger import JobKind

    return any(t.kind is JobKind.CASCADE for t in h.connector.scheduler.ledger.outstanding())


def test_a_reset_cancels_tier_jobs_that_do_not_end_in_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cascade stuck at its tier past ``wait_timeout_s``: the reset does not raise, it
    cancels the cascade (nothing reaches the tier), warns, and clears the CPU tier."""
    import anyio

    config = flushing([{"type": "memory", "name": "stuck"}], wait_timeout_s=0.2)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        scheduler = h.connector.scheduler
        tier = scheduler.tier_work.threaded.engine.tiers[0]
        gate = scheduler.tier_work.threaded.call(anyio.Event)
        store = tier.store

        async def gated_store(keys: Any, blocks: Any) -> Any:
            await gate.wait()
            return await store(keys, blocks)

        monkeypatch.setattr(tier, "store", gated_store)
        h.add_request("first", vh.random_tokens(random.Random(2), 100), max_tokens=2)
        step_until(h, lambda: cascading(h))  # a cascade waits at the gate
        with caplog.at_level("WARNING"):
            assert h.scheduler.reset_connector_cache()
        assert any("tier jobs abandoned" in r.getMessage() for r in caplog.records)
        assert scheduler.ledger.primary.statistics().used == 0
        assert scheduler.ledger.counters[0].cascade_failed > 0
        assert len(tier) == 0
        scheduler.tier_work.threaded.call(gate.set)
        h.add_request("second", vh.random_tokens(random.Random(4), 100), max_tokens=2)
        h.run_until_done()
        h.assert_no_leaks()
        assert_every_block_holds_its_bytes(h, min_cascaded=0)


def test_a_reset_is_refused_while_a_tier_job_cannot_be_stopped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cascade inside a call that cannot be interrupted (a thread) past the deadline: the
    reset answers False instead of raising, and changes nothing (the CPU slot the cascade
    reads stays allocated); once the call returned, a reset goes through."""
    import threading

    import anyio

    config = flushing([{"type": "memory", "name": "stuck"}], wait_timeout_s=0.2)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        scheduler = h.connector.scheduler
        tier = scheduler.tier_work.threaded.engine.tiers[0]
        release = threading.Event()
        store = tier.store

        async def stuck_store(keys: Any, blocks: Any) -> Any:
            await anyio.to_thread.run_sync(release.wait, 10.0)
            return await store(keys, blocks)

        monkeypatch.setattr(tier, "store", stuck_store)
        h.add_request("first", vh.random_tokens(random.Random(3), 100), max_tokens=2)
        step_until(h, lambda: cascading(h))
        used = scheduler.ledger.primary.statistics().used
        with caplog.at_level("WARNING"):
            assert h.scheduler.reset_connector_cache() is False
        assert any("reset_cache refused" in r.getMessage() for r in caplog.records)
        assert scheduler.ledger.primary.statistics().used == used > 0
        release.set()
        h.run_until_done()
        assert h.scheduler.reset_connector_cache()
        assert scheduler.ledger.primary.statistics().used == 0
        h.assert_no_leaks()
