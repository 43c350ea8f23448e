"""The demo: a chat workload whose loaded bytes are checked, through every default tier."""

from __future__ import annotations

import anyio
import pytest

from kvtier_async import demo
from kvtier_async.cli import main


def test_demo_reuses_prompts_and_promotes_from_the_secondary_tier() -> None:
    config = demo.default_config(None)
    config["num_slots"] = 64  # small: old turns must come back by promotion
    report = anyio.run(lambda: demo.run_demo(config, conversations=8, turns=3))
    assert report.turns == 24
    assert report.verified_blocks > 0 and report.reused_tokens > 0
    assert report.stats is not None
    counters = report.stats.tiers[0].counts
    assert counters.promoted > 0 and counters.cascaded > 0
    assert report.stats.ledger.writing == 0 and report.stats.ledger.pinned == 0
    text = demo.render_report(report)
    assert "prompt tokens not recomputed" in text and "memory" in text
    columns = text.splitlines()[0].split()[1:]  # "bytes moved" reads as "bytes", "moved"
    explained = [line.split()[0] for line in demo.COLUMNS if line[2:3].strip()]
    assert set(columns) - {"moved"} == set(explained)  # each column explained under the table


def test_block_keys_chain_like_prefix_hashes() -> None:
    a = demo.block_keys(list(range(64)))
    b = demo.block_keys([*range(48), *range(100, 116)])
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]


def test_the_cli_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--conversations", "4", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert "tier" in out and "cpu" in out and "verified byte for byte" in out
