"""`kvtier bench fleet`'s accounting, without a fleet: the CPU a role's process session used,
and the records made from the cases' outcomes (the fleet itself runs in ``nox -s
bench_fleet``)."""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest

from kvtier_async.bench import fleet

BURN = """
import sys, time
while time.process_time() < 0.3:
    pass
print(time.process_time(), flush=True)
sys.stdin.read()
"""


def test_a_session_s_cpu_is_read_from_proc() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", BURN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            own = float(child.stdout.readline())  # the child's own count, once it has burnt
            seen = fleet._sessions_cpu_s([child.pid])[child.pid]
        finally:
            child.stdin.close()  # its read ends: it exits
            child.wait(timeout=60)
    assert own >= 0.3
    assert seen >= own - 0.05  # clock ticks: 10 ms each
    assert fleet._sessions_cpu_s([child.pid]) == {
        child.pid: 0.0
    }  # no process is left in the session


def _outcome(case: str, router_s: float | None, requests: int = 10) -> fleet.Outcome:
    cpu = {"engine a": 5.0, "s3": 1.0, "client": 0.5}
    if router_s is not None:
        cpu["router"] = router_s
    return fleet.Outcome(
        case,
        [0.05] * requests,
        1000.0,
        400.0,
        30.0,
        10.0,
        collections.Counter({"-": requests}),
        collections.Counter(),
        cpu,
        20.0,
    )


def test_the_router_s_cpu_per_request_is_compared_with_cache_aware_s() -> None:
    outcomes = {
        "single": [_outcome("single", None)],
        "round-robin": [_outcome("round-robin", 0.1)],
        "cache-aware": [_outcome("cache-aware", 0.1), _outcome("cache-aware", 0.1)],
        "kvtier": [_outcome("kvtier", 0.4), _outcome("kvtier", 0.6)],
    }
    records = {r.case: r for r in fleet._records(outcomes)}
    ours = records["kvtier: the router's CPU per request"]
    assert ours.ours == pytest.approx(1.0 / 20)  # 1 s over both rounds' 20 requests
    assert ours.reference == pytest.approx(0.2 / 20)
    assert ours.ratio == pytest.approx(0.2)  # less is better: ours 5x cache_aware's
    assert "single: the router's CPU per request" not in records  # no router there


def test_the_cpu_line_gives_each_role_its_share_of_the_host() -> None:
    line = fleet._cpu_line(_outcome("kvtier", 2.0))
    assert line.startswith("CPU in 20 s of replay on ")
    assert "engines 5.0 s" in line and "router 2.0 s" in line and "s3 1.0 s" in line
