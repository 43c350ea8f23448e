"""The fault suite's own parts (``nox -s faults`` runs the suite): its verdicts fail on what
they must, its checks see a wrong byte, and one quick scenario runs end to end."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from faults._common import Row, child_env, content, empty_block, key_of, wrong_bytes
from faults._table import HEADER, failures, render


def test_a_row_fails_on_each_of_its_limits() -> None:
    assert Row("fine", trials=3, longest_s=1.0, bound_s=2.0).failures() == []
    assert Row("skipped", skipped="no tmpfs here").failures() == []
    cases = {
        "wrong": Row("wrong", wrong_bytes=1),
        "lost": Row("lost", durable_lost=1),
        "blocked": Row("blocked", longest_s=2.5, longest_call="drain", bound_s=2.0),
        "slow recovery": Row("slow recovery", recovery_s=9.0, recovery_bound_s=8.0),
        "check": Row("check", problems=["the damaged file is still there"]),
    }
    for name, row in cases.items():
        (failure,) = row.failures()
        assert failure.startswith(f"{name}: ")
    assert "drain blocked 2.50 s, bound 2.00 s" in cases["blocked"].failures()[0]
    assert len(failures(list(cases.values()))) == len(cases)


def test_rows_survive_json_with_an_unbounded_call() -> None:
    row = Row("x", trials=2, longest_s=0.5, notes=["n"])
    again = Row.from_json(row.to_json())
    assert again == row and math.isinf(again.bound_s)


def test_the_table_marks_failures_and_skips() -> None:
    rows = [
        Row("good", trials=4, longest_s=0.25, bound_s=5.0, recovery_s=1.5, recovery_bound_s=8),
        Row("bad", trials=1, wrong_bytes=7),
        Row("absent", skipped="cannot mount a tmpfs here"),
    ]
    table = render(rows, seed=1, seconds=2.0).splitlines()
    assert table[0] == HEADER
    assert table[2] == "| good | 4 | 0 | 0 | 0.25 (5) | 1.50 (8) |"
    assert table[3] == "| bad **FAILED** | 1 | 7 | 0 | 0.00 | - |"
    assert table[4] == "| absent | **SKIPPED: cannot mount a tmpfs here** | - | - | - | - |"


def test_a_block_is_known_by_its_key_and_a_wrong_byte_is_counted() -> None:
    key = key_of("seed", 3)
    block = content(key, 4096).copy()
    assert np.array_equal(block, content(key_of("seed", 3), 4096))
    assert not np.array_equal(block, content(key_of("seed", 4), 4096))
    assert wrong_bytes(key, block) == 0
    block[100] ^= 1
    block[4095] ^= 0x80
    assert wrong_bytes(key, block) == 2
    assert wrong_bytes(key, empty_block(4096)) > 4000


@pytest.mark.slow
def test_a_scenario_runs_end_to_end(tmp_path: Path) -> None:
    """``python -m faults fs-damage``: a table with its row, written where asked, exit 0."""
    table = tmp_path / "table.md"
    done = subprocess.run(
        [sys.executable, "-m", "faults", "fs-damage", "--table-out", str(table),
         "--logs", str(tmp_path / "logs")],
        env=child_env(), capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    written = table.read_text()
    assert written.splitlines()[0] == HEADER
    assert "| fs: file damage, 20 kinds x disk and tmpfs | 40 | 0 | 0 |" in written
    assert written in done.stdout
    assert sorted(os.listdir(tmp_path / "logs")) == ["fs-damage.json", "fs-damage.log"]
