"""KVTierConnector inside vLLM 0.33's real Scheduler, loaded through kv_connector_module_path,
with its worker role driven in the V2 runner's order by a fake model that checks every KV
byte it reads (cache hits and loads alike)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import vllm_harness as vh
from vllm_harness import OURS, random_tokens, shared_prefix_requests

pytestmark = pytest.mark.vllm
pytest_plugins = ["conftest_s3"]

TRACE = shared_prefix_requests(seed=7, num_requests=40)
SMALL_GPU: dict[str, Any] = {"num_gpu_blocks": 48, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    pytest.importorskip("vllm")
    vh.load()


def ours(**extra: Any) -> dict[str, Any]:
    config = {**OURS["extra_config"], **extra}
    if "secondary_tiers" in extra:
        config["spec_name"] = "TieringOffloadingSpec"
    return {**OURS, "extra_config": config}


def evict_gpu_prefix_cache(h: Any, seed: int = 1) -> None:
    """Run unrelated requests until every GPU block has been reallocated."""
    rng = random.Random(seed)
    for i in range(-(-h.num_gpu_blocks // 8) + 1):
        h.add_request(f"filler-{seed}-{i}", random_tokens(rng, 8 * 16 + 3), max_tokens=2)
        h.run_until_done()


def ledger(h: Any) -> Any:
    return h.connector.scheduler.ledger


@pytest.fixture(scope="module")
def baseline() -> dict[str, list[int]]:
    with vh.VllmHarness(**SMALL_GPU) as h:
        h.drive(TRACE, per_step=2)
        return dict(h.stats.outputs)


@pytest.mark.parametrize("copies", ["inline", "engine"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_trace_with_preemptions_gives_the_same_tokens_and_leaks_nothing(
    baseline: dict[str, list[int]], async_scheduling: bool, copies: str
) -> None:
    config = ours(worker_copies=copies)
    with vh.VllmHarness(**SMALL_GPU, **config, async_scheduling=async_scheduling) as h:
        h.drive(TRACE, per_step=2)
        assert h.stats.outputs == baseline
        assert h.stats.preemptions > 0
        assert h.stats.external_hit_tokens > 0
        assert h.model.tokens_checked > 0
        h.assert_no_leaks()
        stats = ledger(h).primary.statistics()
        assert stats.pinned == 0 and stats.writing == 0


def test_shared_prefix_loads_the_bytes_the_model_wrote() -> None:
    rng = random.Random(0)
    prefix = random_tokens(rng, 100)
    with vh.VllmHarness(num_gpu_blocks=40, **OURS) as h:
        h.add_request("first", [*prefix, 5, 6, 7], max_tokens=4)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        checked = h.model.tokens_checked
        h.add_request("second", [*prefix, 9, 9, 9, 9], max_tokens=4)
        h.run_until_done()
        assert h.stats.external_hit_tokens == 96  # 6 full blocks of the shared prefix
        assert h.model.tokens_checked - checked >= 96 * 2  # read back, byte for byte
        h.assert_no_leaks()


def test_block_size_factor_and_an_unaligned_start() -> None:
    """Offloaded blocks of 2 GPU blocks. The GPU prefix cache holds the first GPU block of the
    prefix again, so the load starts in the middle of the first offloaded block."""
    rng = random.Random(3)
    prefix = random_tokens(rng, 130)
    with vh.VllmHarness(num_gpu_blocks=40, **ours(block_size=32)) as h:
        h.add_request("first", [*prefix, 1, 2], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        h.add_request("warm", prefix[:19], max_tokens=1)  # caches GPU block 0 only
        h.run_until_done()
        assert h.stats.external_hit_tokens == 0
        h.add_request("second", [*prefix, 3, 4], max_tokens=2)
        h.run_until_done()
        # 4 offloaded blocks of 32 tokens, less the 16 tokens the GPU cache still had
        assert h.stats.local_hit_tokens >= 16
        assert h.stats.external_hit_tokens == 128 - 16
        h.assert_no_leaks()


def test_promotion_from_fs_after_the_cpu_tier_evicted_them(tmp_path: Path) -> None:
    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    rng = random.Random(5)
    prefix = random_tokens(rng, 100)
    # A CPU tier of 8 offloaded blocks (2 layers x K|V x 16 tokens x 2 heads x 16 x fp16 =
    # 4 KiB each): the fillers push the prefix out of it.
    config = ours(secondary_tiers=[fs], cpu_bytes_to_use=8 * 4096)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        assert ledger(h).counters[0].cascaded >= 6
        h.add_request("second", [*prefix, 6], max_tokens=2)
        h.run_until_done()
        assert h.stats.external_hit_tokens == 96
        assert ledger(h).counters[0].promoted >= 6
        h.assert_no_leaks()


class _Waiting:
    """What ``get_num_new_matched_tokens`` reads of a waiting request."""

    def __init__(self, req_id: str, block_hashes: list[bytes]) -> None:
        self.request_id = req_id
        self.block_hashes = block_hashes
        self.num_tokens = 16 * len(block_hashes) + 5


def test_a_request_asked_again_keeps_its_pins_unless_more_arrived() -> None:
    """vLLM asks a waiting request again each step it cannot schedule it: the hits it holds
    pins for are answered again without a walk; a block stored after them meanwhile makes
    the answer grow, as a fresh walk does."""
    from kvtier_async.ledger import make_offload_key

    with vh.VllmHarness(num_gpu_blocks=40, **OURS) as h:
        scheduler, led = h.connector.scheduler, ledger(h)
        hashes = [bytes([i + 1]) * 32 for i in range(6)]
        keys = [make_offload_key(x, 0) for x in hashes]

        def store(*index: int) -> None:
            out = led.prepare_store([keys[i] for i in index], "writer")
            led.complete_store(out.keys_to_store)

        store(0, 1, 2)
        request = _Waiting("waiting", hashes)
        ref = led.primary.ref_count
        assert scheduler.get_num_new_matched_tokens(request, 0) == (48, True)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (48, True)
        assert [ref(k) for k in keys[:3]] == [1, 1, 1]  # pinned once
        store(3)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (64, True)
        assert [ref(k) for k in keys[:4]] == [1, 1, 1, 1]
        assert scheduler.get_num_new_matched_tokens(request, 16) == (48, True)  # 1 local
        assert [ref(k) for k in keys[:4]] == [0, 1, 1, 1]
        scheduler.request_finished(request)
        assert [ref(k) for k in keys[:4]] == [0, 0, 0, 0]
        scheduler._finish("waiting")
        led.request_finished("writer")


def test_a_request_asked_again_while_its_walk_waits_is_not_walked_again(
    tmp_path: Path,
) -> None:
    """A request whose walk waits on a key (a tier has not answered) is answered "ask
    again" without a walk until the key is no longer pending or a tier result arrived that
    could change what a walk does; then it is walked again."""
    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    with vh.VllmHarness(num_gpu_blocks=40, **ours(secondary_tiers=[fs])) as h:
        scheduler, led = h.connector.scheduler, ledger(h)
        walks: list[int] = []
        walk = led.walk_prefix

        def counted(req: Any, groups: Any) -> Any:
            walks.append(1)
            return walk(req, groups)

        led.walk_prefix = counted
        request = _Waiting("waiting", [bytes([i + 1]) * 32 for i in range(4)])
        for _ in range(3):  # nothing is handed to the engine here: no answer can come
            assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
        assert len(walks) == 1
        [lookup] = led.take_tasks()  # as the engine would: the tier has the first two
        assert len(lookup.keys) == 4
        led.apply(lookup.task_id, [True, True, False, False])
        assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)  # promoting
        assert len(walks) == 2
        assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
        assert len(walks) == 2  # the promotion has not ended
        [promote] = led.take_tasks()
        led.apply(promote.task_id, [True, True])
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, True)
        assert len(walks) == 3
        scheduler.request_finished(request)
        scheduler._finish("waiting")


def test_cascades_wait_for_other_tier_work_or_their_hold(tmp_path: Path) -> None:
    """A cascade is not what a request waits for: it stays queued (pinned) until a lookup or
    promotion goes out anyway, or its hold passes, or enough blocks wait; never lost."""
    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    rng = random.Random(9)
    with vh.VllmHarness(num_gpu_blocks=40, **ours(secondary_tiers=[fs])) as h:
        scheduler = h.connector.scheduler
        scheduler.tier_work.cascade_hold_s = 3600.0  # never by time in this test
        scheduler.tier_work.cascade_hold_blocks = 1000
        counters = ledger(h).counters[0]
        h.add_request("first", random_tokens(rng, 100), max_tokens=2)
        steps = 0
        while ledger(h).queued_cascades < 6:  # its stores end (its lookup went out first)
            assert steps < 100_000 and counters.cascaded == 0
            h.step()
            steps += 1
        for _ in range(10):  # nothing else goes out: they stay queued
            h.step()
        assert ledger(h).queued_cascades == 6 and counters.cascaded == 0
        assert h.has_work()  # held work keeps vLLM stepping (has_pending_push_work)
        h.add_request("second", random_tokens(rng, 40), max_tokens=2)  # its lookup goes out
        while counters.cascaded < 6:  # and the cascades with it
            assert steps < 100_000
            h.step()
            steps += 1
        scheduler.tier_work.cascade_hold_blocks = 2  # second's 2 blocks go once both wait
        h.run_until_done()
        assert counters.cascaded == 8 and ledger(h).queued_cascades == 0
        scheduler.tier_work.cascade_hold_s = 0.0  # third's go at once
        h.add_request("third", random_tokens(rng, 100), max_tokens=2)
        h.run_until_done()
        assert counters.cascaded == 14
        h.assert_no_leaks()


def test_a_damaged_fs_block_is_not_loaded_and_its_removal_is_announced(tmp_path: Path) -> None:
    """A block file of the prefix rots in the fs tier. The promotion that reads it fails
    verification and the tier deletes it; the scheduler applies that removal with the
    promotion's result: the ledger announces it (a STORAGE removal, vLLM's BlockRemoved) and
    the request loads only the blocks before it (the rest is recomputed)."""
    from kvtier_async.ledger import make_offload_key
    from kvtier_async.tiers.blockfile import block_relpath
    from kvtier_async.tiers.fs import FsTier

    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    prefix = random_tokens(random.Random(13), 100)
    config = ours(secondary_tiers=[fs], cpu_bytes_to_use=8 * 4096)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        scheduler = h.connector.scheduler
        (tier,) = scheduler.tier_work.threaded.engine.tiers
        assert isinstance(tier, FsTier)
        events: list[Any] = []
        take_events = scheduler.ledger.take_events

        def recorded() -> list[Any]:
            taken = take_events()
            events.extend(taken)
            return taken

        scheduler.ledger.take_events = recorded  # what vLLM's scheduler takes, each step
        h.connector._publish_events = True  # as with KV events on in vLLM
        scheduler.ledger.events_enabled = True
        first = h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        assert ledger(h).counters[0].cascaded >= 6
        damaged = make_offload_key(bytes(first.block_hashes[2]), 0)
        path = Path(tier.root_dir) / block_relpath(tier.ctx, damaged)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF  # one byte of the KV payload
        path.write_bytes(data)
        h.add_request("second", [*prefix, 6], max_tokens=2)
        h.run_until_done()
        assert h.stats.external_hit_tokens == 2 * 16  # the blocks before the damaged one
        assert tier.statistics().removed_damaged == 1
        assert path.read_bytes() != data  # deleted; stored again when it was recomputed
        removals = [e for e in events if e.removed and e.tier == tier.name]
        assert [e.keys for e in removals] == [[damaged]]
        assert tier.take_removed() == []  # the scheduler took it
        h.assert_no_leaks()


def store_then_restart(tier: dict[str, Any], model: Path, seed: int) -> None:
    """A request's prefix is cascaded to ``tier``; a new scheduler and worker (a new, empty
    CPU tier) on the same tier load all 6 of its blocks from there."""
    prefix = random_tokens(random.Random(seed), 100)
    config = ours(secondary_tiers=[tier])
    with vh.VllmHarness(num_gpu_blocks=40, model_dir=model, **config) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        assert ledger(h).counters[0].cascaded >= 6
    with vh.VllmHarness(num_gpu_blocks=40, model_dir=model, **config) as h:
        h.add_request("second", [*prefix, 6], max_tokens=2)
        h.run_until_done()
        assert h.stats.external_hit_tokens == 96
        h.assert_no_leaks()


def test_restart_on_the_same_fs_root(tmp_path: Path) -> None:
    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    store_then_restart(fs, vh.write_model_dir(tmp_path / "model"), seed=6)


def test_a_request_waiting_on_a_lookup_is_answered_without_a_walk(tmp_path: Path) -> None:
    """A request whose walk waits on the fs tier's lookup is asked again every step. While
    nothing that could change its walk happened (the lookup held here), the answer is "ask
    again" without walking its keys; once the lookup answers, the next ask walks, and the
    request loads every block as it would have."""
    import threading

    import anyio.to_thread

    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    model = vh.write_model_dir(tmp_path / "model")
    prefix = random_tokens(random.Random(14), 100)
    config = ours(secondary_tiers=[fs])
    with vh.VllmHarness(num_gpu_blocks=40, model_dir=model, **config) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        assert ledger(h).counters[0].cascaded >= 6
    release = threading.Event()
    with vh.VllmHarness(num_gpu_blocks=40, model_dir=model, **config) as h:
        scheduler = h.connector.scheduler
        (tier,) = scheduler.tier_work.threaded.engine.tiers
        lookup = tier.lookup

        async def held_lookup(keys: Any) -> list[bool]:
            assert await anyio.to_thread.run_sync(release.wait, 30.0), "never released"
            return await lookup(keys)

        tier.lookup = held_lookup
        walks: list[Any] = []
        walk = scheduler.ledger.walk_prefix

        def counted(*args: Any) -> Any:
            walks.append(args)
            return walk(*args)

        scheduler.ledger.walk_prefix = counted
        try:
            h.add_request("second", [*prefix, 6], max_tokens=2)
            for _ in range(4):
                h.step()
            assert len(walks) == 1  # the first ask; the three after it skipped the walk
            assert h.connector.scheduler._reqs["second"].waiting_on is not None
        finally:
            release.set()
        h.run_until_done()
        assert len(walks) > 1  # the answer changed the walk: walked again
        assert h.stats.external_hit_tokens == 96  # all 6 blocks, promoted from the files
        h.assert_no_leaks()


def test_a_step_that_scheduled_nothing_waits_for_the_tier_and_a_busy_one_does_not(
    tmp_path: Path,
) -> None:
    """While a request waits on the fs tier's lookup (held here), a step that scheduled no
    token ends with a bounded wait for the tier's result (GIL released) instead of
    spinning; a step that scheduled tokens never waits."""
    import threading

    import anyio.to_thread

    fs = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    model = vh.write_model_dir(tmp_path / "model")
    rng = random.Random(15)
    prefix = random_tokens(rng, 100)
    config = ours(secondary_tiers=[fs])
    with vh.VllmHarness(num_gpu_blocks=40, model_dir=model, **config) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
    release = threading.Event()
    with vh.VllmHarness(num_gpu_blocks=80, model_dir=model, **config) as h:
        scheduler = h.connector.scheduler
        threaded = scheduler.tier_work.threaded
        (tier,) = threaded.engine.tiers
        lookup = tier.lookup

        async def held_lookup(keys: Any) -> list[bool]:
            assert await anyio.to_thread.run_sync(release.wait, 30.0), "never released"
            return await lookup(keys)

        tier.lookup = held_lookup
        waits: list[float] = []
        wait = threaded.wait

        def recorded(timeout_s: float) -> bool:
            waits.append(timeout_s)
            return bool(wait(timeout_s))

        threaded.wait = recorded
        try:
            h.add_request("second", [*prefix, 6], max_tokens=2)
            idle = [h.step().scheduled for _ in range(3)]
            assert all(out.total_num_scheduled_tokens == 0 for out in idle)
            assert waits == [scheduler.tier_work.idle_wait_s] * 3
            waits.clear()
            # Less than a block: no key to look up (a key would queue behind the held lookup).
            h.add_request("busy", random_tokens(rng, 12), max_tokens=8)
            steps = []  # (tokens scheduled, waited) per step
            for _ in range(4):
                waits.clear()
                out = h.step().scheduled
                steps.append((out.total_num_scheduled_tokens if out else 0, bool(waits)))
            assert any(tokens for tokens, _ in steps), steps
            assert all(not waited for tokens, waited in steps if tokens)
        finally:
            release.set()
        h.run_until_done()
        assert h.stats.external_hit_tokens == 96  # all 6 blocks, promoted from the files
        h.assert_no_leaks()


def test_s3_tier_on_the_loopback_server(moto_s3: Any, s3_bucket: str, tmp_path: Path) -> None:
    # moto answers from this process's threads, beside a scheduler that busy-steps: the
    # default 1 s lookup deadline can pass on a loaded machine, and a late lookup is a miss.
    # This test is about what the tier holds, so its deadlines are generous.
    obj = moto_s3.tier_config(s3_bucket, timeout_s=30.0, lookup_timeout_s=10.0)
    store_then_restart(obj, vh.write_model_dir(tmp_path / "model"), seed=8)


def test_reset_cache_clears_the_cpu_tier() -> None:
    rng = random.Random(9)
    prefix = random_tokens(rng, 100)
    with vh.VllmHarness(num_gpu_blocks=40, **OURS) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        assert ledger(h).primary.statistics().used >= 6
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        assert ledger(h).primary.statistics().used == 0
        h.add_request("second", [*prefix, 6], max_tokens=2)
        h.run_until_done()
        assert h.stats.external_hit_tokens == 0  # nothing left to load: recomputed
        h.assert_no_leaks()


def hits_after_a_reset_at_a_requests_end(kwargs: dict[str, Any], prefix: list[int]) -> int:
    """A request ends; the cache is reset before the next step (which would have handed its
    end to the connector in ``finished_req_ids``, as after ``LLM.generate`` returns); later,
    with vLLM's GPU prefix cache evicted, a request with the same prefix: the tokens the
    connector supplied it."""
    with vh.VllmHarness(num_gpu_blocks=40, **kwargs) as h:
        h.add_request("first", [*prefix, 5], max_tokens=2)
        while h.stats.finished < 1:
            h.step()
        assert h.scheduler.reset_prefix_cache(reset_connector=True)
        h.run_until_done()  # the step that reports "first" as finished
        evict_gpu_prefix_cache(h)
        h.add_request("second", [*prefix, 6], max_tokens=2)
        h.run_until_done()
        h.assert_no_leaks()
        return int(h.stats.external_hit_tokens)


def test_a_request_that_ended_before_a_reset_stores_nothing_after_it() -> None:
    """As vLLM's OffloadingConnector: the reset drops a request that ended before it, so
    its blocks are not stored in the new generation (they were: served from the CPU tier
    a request that the reset should have left to recompute, or to promote)."""
    prefix = random_tokens(random.Random(21), 100)
    theirs = hits_after_a_reset_at_a_requests_end(vh.VLLM_OFFLOADING, prefix)
    ours = hits_after_a_reset_at_a_requests_end(OURS, prefix)
    assert theirs == ours == 0


def failing_loads(h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    router = h.worker_connector.worker._router
    transfer, execute = router.transfer, router.execute

    def check(src: Any) -> None:
        if src.medium.value == "CPU":  # every load fails; stores work
            raise OSError("injected load failure")

    async def failing_transfer(src: Any, dst: Any) -> Any:
        check(src)
        return await transfer(src, dst)

    def failing_execute(src: Any, dst: Any) -> Any:
        check(src)
        return execute(src, dst)

    monkeypatch.setattr(router, "transfer", failing_transfer)
    monkeypatch.setattr(router, "execute", failing_execute)


def test_a_failed_load_is_recomputed_not_wrong(
    monkeypatch: pytest.MonkeyPatch, baseline: dict[str, list[int]]
) -> None:
    with vh.VllmHarness(**SMALL_GPU, **OURS, kv_load_failure_policy="recompute") as h:
        failing_loads(h, monkeypatch)
        h.drive(TRACE, per_step=2)
        assert h.stats.outputs == baseline  # the fake model checked every byte it read
        h.assert_no_leaks()
        assert ledger(h).primary.statistics().pinned == 0


def test_a_failed_load_fails_the_request_under_the_fail_policy(
    monkeypatch: pytest.MonkeyPatch, baseline: dict[str, list[int]]
) -> None:
    with vh.VllmHarness(**SMALL_GPU, **OURS) as h:
        failing_loads(h, monkeypatch)
        h.drive(TRACE, per_step=2)
        finished = {r: t for r, t in h.stats.outputs.items() if len(t) == len(baseline[r])}
        assert len(finished) < len(baseline)  # some requests were failed, none got wrong KV
        assert all(baseline[r] == t for r, t in finished.items())
        h.assert_no_leaks()


def test_under_multiconnector_next_to_a_pd_connector(tmp_path: Path) -> None:
    """vLLM's MultiConnector with ours first and vLLM's ExampleConnector (a P/D-style
    connector that saves every request's KV to shared storage) second."""
    children = [
        {
            "kv_connector": OURS["connector"],
            "kv_connector_module_path": OURS["connector_module_path"],
            "kv_role": "kv_both",
            "kv_connector_extra_config": OURS["extra_config"],
        },
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "pd")},
        },
    ]
    rng = random.Random(11)
    prefix = random_tokens(rng, 100)
    with vh.VllmHarness(
        num_gpu_blocks=40, connector="MultiConnector", extra_config={"connectors": children}
    ) as h:
        h.add_request("first", [*prefix, 5, 6, 7], max_tokens=4)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        h.add_request("second", [*prefix, 9, 9, 9, 9], max_tokens=4)
        h.run_until_done()
        assert h.stats.external_hit_tokens >= 96  # loaded, and checked byte for byte
        h.assert_no_leaks()


def report_trace(h: Any, prefix: list[int]) -> list[tuple[int, bool, bool]]:
    """Per step of a store-then-load scenario: (step, whether the worker reported finished
    jobs, whether it reported a finished load)."""
    trace: list[tuple[int, bool, bool]] = []

    def run() -> None:
        while h.has_work():
            result = h.step()
            out = result.output.kv_connector_output if result.output is not None else None
            meta = out.kv_connector_worker_meta if out is not None else None
            recving = bool(out is not None and out.finished_recving)
            trace.append((h.stats.steps, meta is not None, recving))

    h.add_request("first", [*prefix, 5], max_tokens=3)
    run()
    evict_gpu_prefix_cache(h)
    trace.append((-1, False, False))
    h.add_request("second", [*prefix, 6], max_tokens=3)
    run()
    return trace


def test_reports_come_as_late_as_vllms_with_a_report_delay() -> None:
    """The sched benchmark's fairness: ours (inline copies, outputs held back one step)
    reports every store and load in the same step as vLLM's OffloadingConnector over
    FakeOffloadingWorker (one step after submission), and supplies the same hits."""
    prefix = random_tokens(random.Random(12), 100)
    traces, hits = [], []
    for kwargs in (vh.VLLM_OFFLOADING, {**OURS, "worker_report_delay_steps": 1}):
        with vh.VllmHarness(num_gpu_blocks=40, **kwargs) as h:
            traces.append(report_trace(h, prefix))
            hits.append(h.stats.external_hit_tokens)
            h.assert_no_leaks()
    assert any(reported for _, reported, _ in traces[0])
    assert traces[0] == traces[1]
    assert hits[0] == hits[1] == 96


def test_sync_loads_as_vllms_connector_makes_them() -> None:
    """With ``sync_load_budget_bytes``, a hit that fits the step's budget is loaded within
    the step (``load_kv_async`` False): its request runs in the step that admitted it, and
    no ``finished_recving`` is reported for it, as with vLLM's OffloadingConnector: the same
    steps, the same hits, a step fewer than the asynchronous load. (When each worker reports
    the job differs: the harness holds our worker's output back a step to match vLLM's
    asynchronous jobs, which a sync job is not.)"""
    prefix = random_tokens(random.Random(12), 100)
    budget = {"sync_load_budget_bytes": 1 << 20}
    theirs = {
        **vh.VLLM_OFFLOADING,
        "extra_config": {**vh.VLLM_OFFLOADING["extra_config"], **budget},
    }
    mine = {**ours(**budget), "worker_report_delay_steps": 1}
    traces, hits = [], []
    for kwargs in (theirs, mine):
        with vh.VllmHarness(num_gpu_blocks=40, **kwargs) as h:
            traces.append([(step, recving) for step, _, recving in report_trace(h, prefix)])
            hits.append(h.stats.external_hit_tokens)
            h.assert_no_leaks()
    assert traces[0] == traces[1]
    assert hits[0] == hits[1] == 96
    assert not any(recving for _, recving in traces[1])  # the load was a sync one
    with vh.VllmHarness(num_gpu_blocks=40, **OURS, worker_report_delay_steps=1) as h:
        asynchronous = report_trace(h, prefix)
    assert any(recving for _, _, recving in asynchronous)
    assert len(traces[1]) < len(asynchronous)  # the step a sync load saves


def test_a_second_engine_with_the_same_instance_id_is_refused() -> None:
    """Two engines never share a CPU region by accident: a second engine configured with
    the first one's ``instance_id`` is refused (its token differs) and the first one keeps
    serving its own bytes."""
    from kvtier_async.memory import RegionClaimedError

    config = ours(instance_id=f"same-{random.getrandbits(48):x}")
    prefix = random_tokens(random.Random(11), 100)
    with vh.VllmHarness(num_gpu_blocks=40, **config) as h:
        second = {"num_gpu_blocks": 40, **config}
        with pytest.raises(RegionClaimedError) as caught, vh.VllmHarness(**second):
            pass
        assert repr(config["extra_config"]["instance_id"]) in str(caught.value)
        h.add_request("first", [*prefix, 5], max_tokens=2)
        h.run_until_done()
        evict_gpu_prefix_cache(h)
        h.add_request("again", [*prefix, 6], max_tokens=2)
        h.run_until_done()  # the fake model checks every byte it loads
        assert h.stats.external_hit_tokens == 96
        h.assert_no_leaks()
