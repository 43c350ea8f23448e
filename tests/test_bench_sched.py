"""The sched benchmark's records, from synthetic runs (the harness runs are in the vLLM
tests): one set of rows per case, ratios oriented as the report wants, and no verdict from a
quick run."""

from __future__ import annotations

from kvtier_async.bench import sched


def run_of(step_us: float, hits: int, steps: int = 10) -> sched._Run:
    return sched._Run([step_us * 1e-6] * steps, steps, hits, 0, 0, {})


def runs() -> dict[str, list[sched._Run]]:
    out = {"none": [run_of(100.0, 0)]}
    for case in sched.CASES:
        out[f"vllm {case}"] = [run_of(200.0, 1000)]  # adds 100 us
        out[f"ours {case}"] = [run_of(140.0, 1100)]  # adds 40 us
    return out


def test_every_case_has_its_rows_and_a_verdict() -> None:
    records = sched._records(runs(), quick=False, say=lambda _msg: None)
    assert [r.case for r in records] == [case for case in sched.CASES for _ in range(3)]
    added = [r for r in records if r.metric == "added step time"]
    assert all(abs(r.ratio - 2.5) < 1e-6 and r.meets for r in added)  # type: ignore[operator]
    hits = [r for r in records if r.metric == "external hit tokens"]
    assert all(abs(r.ratio - 1.1) < 1e-6 and r.meets for r in hits)  # type: ignore[operator]
    assert all(r.meets is None for r in records if r.metric == "step time")


def test_the_worker_threads_case_is_judged_against_vllms_lru_cpu_run() -> None:
    out = runs()
    out[f"ours {sched.THREADS_CASE}"] = [run_of(180.0, 1000)]  # adds 80 us: 0.8x of vLLM's
    records = sched._records(out, quick=False, say=lambda _msg: None)
    added = [r for r in records if r.case == sched.THREADS_CASE and r.metric == "added step time"]
    assert len(added) == 1
    assert abs(added[0].reference - 100.0) < 1e-6  # type: ignore[operator]
    assert abs(added[0].ratio - 1.25) < 1e-6  # type: ignore[operator]
    assert added[0].meets is False  # the target is 0.7x: a ratio of 1/0.7


def test_a_quick_run_gives_figures_but_no_verdict() -> None:
    records = sched._records(runs(), quick=True, say=lambda _msg: None)
    assert records and all(r.meets is None for r in records)
    assert all(r.ratio is not None for r in records)
