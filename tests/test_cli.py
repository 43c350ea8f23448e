"""The ``kvtier`` command line: argument errors, output streams, and the benchmark registry."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from collections.abc import Callable

import pytest

from kvtier_async import __version__, bench
from kvtier_async._log import get_logger
from kvtier_async.bench.report import BenchRecord, throughput_record
from kvtier_async.cli import main

FAKE_MODULE = "kvtier_test_fake_bench"


def fake_run(
    *, quick: bool = False, progress: Callable[[str], None] | None = None
) -> list[BenchRecord]:
    """A benchmark that measures nothing, reports progress, and logs one line."""
    if progress is not None:
        progress("fake: halfway")
    get_logger("kvtier_async.bench.fake").info("fake ran", quick=quick)
    case = "quick" if quick else "full"
    record = throughput_record("fake", case, "ops_per_s", 10.0, reference=5.0, target=1.5)
    return [record]


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register `fake_run` as the only benchmark, named ``fake``."""
    module = types.ModuleType(FAKE_MODULE)
    module.run = fake_run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, FAKE_MODULE, module)
    monkeypatch.setattr(bench, "BENCHMARKS", {"fake": f"{FAKE_MODULE}:run"})


def test_unknown_benchmark_exits_2_naming_the_valid_ones() -> None:
    command = [sys.executable, "-m", "kvtier_async.cli", "bench", "nope"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "unknown benchmark 'nope'" in done.stderr
    assert f"valid names: {', '.join(bench.BENCHMARKS)}" in done.stderr
    assert done.stdout == ""


def test_unknown_benchmark_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "ledger", "nope"])
    assert exit_info.value.code == 2
    assert "valid names: ledger" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__


@pytest.mark.usefixtures("fake_bench")
def test_bench_prints_a_table_and_sends_progress_and_logs_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench"]) == 0  # no NAME: every registered benchmark
    out, err = capsys.readouterr()
    assert out.splitlines()[2].split() == [
        "fake", "full", "ops_per_s", "10", "5", "2.00x", "1.50x", "yes",
    ]  # fmt: skip
    assert "bench fake: running" in err
    assert "fake: halfway" in err
    assert "fake ran" in err
    assert "quick=False" in err


@pytest.mark.usefixtures("fake_bench")
def test_bench_json_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fake", "--json", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["case"] for line in lines] == ["quick"]
    assert json.loads(lines[0])["meets"] is True


@pytest.mark.usefixtures("fake_bench")
def test_main_removes_the_log_handler_it_added() -> None:
    before = list(logging.getLogger().handlers)
    main(["bench", "fake", "--json"])
    assert logging.getLogger().handlers == before
