"""``kvtier plan --trace``: hit rate against capacity per policy, inside its two bounds."""

from __future__ import annotations

import json
import random
import stat
from pathlib import Path

import pytest

from kvtier_async.cli import main
from kvtier_async.ops.plan import DEFAULT_POLICIES, NEAR, make_plan, parse_capacities, render_plan
from kvtier_async.ops.traces import read_trace


def chat_trace(path: Path, sessions: int = 40, turns: int = 5, seed: int = 3) -> Path:
    """Multi-turn chats in kvtier's format: each turn is the last one's blocks plus new ones;
    a shared system prompt heads every session."""
    rng = random.Random(seed)
    lines, history, fresh = [], {s: [0, 1] for s in range(sessions)}, 2
    for _ in range(sessions * turns):
        s = rng.randrange(sessions)
        history[s] = history[s] + list(range(fresh, fresh + rng.randint(1, 4)))
        fresh += len(history[s])
        lines.append(json.dumps({"request_id": f"s{s}", "keys": history[s]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_policy_lies_between_its_bounds(tmp_path: Path) -> None:
    source = read_trace(chat_trace(tmp_path / "chat.jsonl"))
    plan = make_plan(source, capacities=["5%", "20%", "100%"], block_bytes=1 << 20)
    assert [p.blocks for p in plan.points] == sorted(p.blocks for p in plan.points)
    assert plan.points[-1].blocks == plan.distinct_blocks
    assert 0 < plan.infinite < 1
    for point in plan.points:
        assert set(point.hit_rates) == set(DEFAULT_POLICIES)
        assert {"sieve", "s3fifo", "tinylfu", "adaptive"} <= set(DEFAULT_POLICIES)
        assert point.cpu_bytes == point.blocks << 20
        for policy, rate in point.hit_rates.items():
            assert 0 <= rate <= point.belady + 1e-12, (point.blocks, policy)
        assert point.belady <= plan.infinite + 1e-12
    full = plan.points[-1]  # room for every block: every policy is the infinite cache
    assert all(rate == pytest.approx(plan.infinite) for rate in full.hit_rates.values())
    small = plan.points[0]
    assert max(small.hit_rates.values()) < plan.infinite  # it does evict there
    knee = plan.knee()
    assert knee is not None and plan.best(knee)[1] >= NEAR * plan.infinite


def test_the_table_and_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = chat_trace(tmp_path / "chat.jsonl")
    plot = tmp_path / "out" / "plan.png"
    argv = ["plan", "--trace", str(trace), "--capacities", "5%,60", "--policies", "lru,arc"]
    assert main([*argv, "--block-bytes", "64K", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [p["blocks"] for p in document["points"]][-1] == 60
    assert set(document["points"][0]["hit_rates"]) == {"lru", "arc"}
    assert document["points"][-1]["cpu_bytes"] == 60 * 65536
    assert document["distinct_blocks"] > 60 and document["format"] == "kvtier"
    pytest.importorskip("matplotlib")
    assert main([*argv, "--plot", str(plot)]) == 0
    out, err = capsys.readouterr()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(plot.stat().st_mode) == 0o600
    assert "plan: 1/2:" in err and "plan: 2/2:" in err  # progress, on stderr
    table = render_plan(make_plan(read_trace(trace), capacities=["10%"]), str)
    assert table.splitlines()[1].split() == [
        "blocks", "%", "of", "distinct", *DEFAULT_POLICIES, "belady", "best", "best/infinite",
    ]  # fmt: skip
    assert "give --block-bytes" in table and "lru" in out


def test_bad_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = chat_trace(tmp_path / "chat.jsonl")
    assert main(["plan", "--trace", str(trace), "--policies", "fifo"]) == 2
    assert "--policies: must be one of" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "a", "keys": [1, 2]}\n{"request_id": "b", "keys": "x"}\n')
    assert main(["plan", "--trace", str(bad)]) == 2
    assert ":2" in capsys.readouterr().err  # the line
    assert main(["plan", "--trace", str(tmp_path / "none.jsonl")]) == 2
    with pytest.raises(SystemExit):
        main(["plan", "--trace", str(trace), "--capacities", "0%"])
    for text, problem in (("", "comma-separated"), ("5%,x", "'x'"), ("150%", "at most 100%")):
        with pytest.raises(ValueError, match=problem):
            parse_capacities(text)
