"""The ``kvtier`` command line: argument errors, output streams, and the benchmark registry."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

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
    missed = throughput_record("fake", case, "hit_rate", 0.5, reference=1.0, target=1.0)
    return [record, missed] if FAIL_ONE else [record]


FAIL_ONE = False


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
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtier {__version__}"


@pytest.mark.usefixtures("fake_bench")
def test_bench_prints_a_table_and_sends_progress_and_logs_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["-v", "bench"]) == 0  # no NAME: every registered benchmark
    out, err = capsys.readouterr()
    assert out.splitlines()[2].split() == [
        "fake", "full", "ops_per_s", "10", "5", "2.00x", "1.50x", "yes",
    ]  # fmt: skip
    assert "bench fake: running" in err
    assert "fake: halfway" in err
    assert "fake ran" in err
    assert "quick=False" in err


@pytest.mark.usefixtures("fake_bench")
def test_logs_are_quiet_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fake"]) == 0
    err = capsys.readouterr().err
    assert "fake: halfway" in err  # progress
    assert "fake ran" not in err  # an INFO log line: only with -v


@pytest.mark.usefixtures("fake_bench")
def test_bench_json_quick_has_no_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fake", "--json", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["case"] for line in lines] == ["quick"]
    assert json.loads(lines[0])["meets"] is None  # a quick sample cannot support one
    assert json.loads(lines[0])["ratio"] == 2.0  # the figures are still there


@pytest.mark.usefixtures("fake_bench")
def test_a_quick_table_says_so_and_shows_no_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fake", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("quick run:")
    assert lines[3].split()[-1] == "-"


@pytest.mark.usefixtures("fake_bench")
def test_check_exits_1_on_a_missed_target(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["bench", "fake", "--check"]) == 0  # every target met
    monkeypatch.setattr(sys.modules[__name__], "FAIL_ONE", True)
    assert main(["bench", "fake", "--check"]) == 1
    assert "bench --check: fake full hit_rate: 0.50x, target 1.00x" in capsys.readouterr().err
    assert main(["bench", "fake"]) == 0  # without --check, a miss is only reported


@pytest.mark.usefixtures("fake_bench")
def test_check_refuses_a_quick_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "fake", "--check", "--quick"])
    assert exit_info.value.code == 2
    assert "--check judges targets" in capsys.readouterr().err


@pytest.mark.usefixtures("fake_bench")
def test_plot_writes_one_png_per_benchmark(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    assert main(["bench", "fake", "--plot", str(tmp_path / "figs")]) == 0
    figure = tmp_path / "figs" / "fake.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.stat().st_mode & 0o777 == 0o600


@pytest.mark.usefixtures("fake_bench")
def test_main_removes_the_log_handler_it_added() -> None:
    before = list(logging.getLogger().handlers)
    main(["bench", "fake", "--json"])
    assert logging.getLogger().handlers == before


def test_bench_gpu_runs_without_the_s3_stack() -> None:
    """The GPU machine has no aiobotocore, botocore or aiohttp (see ci/gpu-check): the command
    line must start there and run `kvtier bench gpu`, which needs none of them."""
    blocked = ["aiohttp", "aiobotocore", "aioboto3", "botocore", "boto3", "moto"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None  # import fails, as if absent\n"
        "from kvtier_async.cli import main\n"
        "sys.exit(main(['bench', 'gpu', '--quick']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "gpu" in done.stdout + done.stderr
