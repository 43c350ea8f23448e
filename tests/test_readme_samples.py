"""The README's sample outputs are what the commands print now (issue 24, item 8):
``tools/readme_samples.py --check`` runs them and compares; and that check tells a changed
count or line from what varies between runs (timestamps, pids, rates)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "readme_samples", ROOT / "tools" / "readme_samples.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


samples_tool = _tool()


def _bodies(readme: str) -> dict[str, str]:
    return {name: match["body"] for name, match in samples_tool.blocks(readme).items()}


def test_the_readme_samples_are_what_the_commands_print_now() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "readme_samples.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_each_sample_is_marked_once() -> None:
    assert set(_bodies(README)) == set(samples_tool.SAMPLES)
    marker = "<!-- sample: stats"
    with pytest.raises(ValueError, match="stats"):
        samples_tool.blocks(README.replace(marker, "<!-- not a sample"))
    with pytest.raises(ValueError, match="unknown"):
        samples_tool.blocks(README.replace(marker, "<!-- sample: statistics"))


def test_a_changed_count_or_line_is_stale() -> None:
    now = _bodies(README)
    assert samples_tool.stale(README, now) == {}
    row = re.search(r"\n  r0 +(\d+) ", now["operations"])  # inspect's blocks of rank 0
    assert row is not None
    bigger = row[0].replace(row[1], str(int(row[1]) + 1))  # one block more
    changed = {**now, "operations": now["operations"].replace(row[0], bigger)}
    diff = samples_tool.stale(README, changed)
    assert list(diff) == ["operations"]
    assert f"\n-{row[0][1:]}" in diff["operations"] and f"\n+{bigger[1:]}" in diff["operations"]
    longer = {**now, "stats": now["stats"] + "a new line\n"}
    assert list(samples_tool.stale(README, longer)) == ["stats"]
    shape = {**now, "doctor": now["doctor"].replace("  (", " (", 1)}
    assert list(samples_tool.stale(README, shape)) == ["doctor"]


def test_what_varies_between_runs_is_not_stale() -> None:
    now = _bodies(README)
    ops = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "2031-01-02 03:04:05", now["operations"])
    ops = re.sub(r"pid \d+", "pid 4242", ops)
    ops = re.sub(r"kvtier-\d+-[0-9a-f]{8}", "kvtier-4242-0badcafe", ops)
    ops = re.sub(r"\d+ blocks/s, [\d.]+ MB/s", "1 blocks/s, 0.1 MB/s", ops)
    ops = re.sub(r"in [\d.]+ s \([\d.]+ MB/s\)", "in 12.5 s (0.5 MB/s)", ops)
    bench = re.sub(r'"(ours|reference|ratio)": [\d.e+-]+', r'"\1": 1.5e-05', now["bench-json"])
    doctor = re.sub(r"crc32c=[\w+-]+", "crc32c=software", now["doctor"])
    varied = {**now, "operations": ops, "bench-json": bench, "doctor": doctor}
    assert all(varied[name] != now[name] for name in ("operations", "bench-json", "doctor"))
    assert samples_tool.stale(README, varied) == {}


def test_write_replaces_only_the_stale_samples() -> None:
    now = _bodies(README)
    changed = {**now, "stats": "CPU tier: nothing\n"}
    written = samples_tool.rewrite(README, changed, {"stats"})
    assert _bodies(written) == changed
    assert written.replace("CPU tier: nothing\n", now["stats"]) == README


def test_check_exits_1_with_a_diff(capsys: pytest.CaptureFixture[str]) -> None:
    stale = {**_bodies(README), "stats": "CPU tier: nothing\n"}
    assert samples_tool.main(["--check"], make=lambda: stale) == 1
    out = capsys.readouterr().out
    assert "+CPU tier: nothing" in out and "stale samples stats" in out
    assert samples_tool.main(["--check"], make=lambda: _bodies(README)) == 0
