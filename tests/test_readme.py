"""The README's code runs as pasted (issue 24, item 8): every ``python`` block is run as a
script of its own in an empty directory, in a fresh interpreter, and must exit 0; the
README's two commands are the ones `.ci/run` runs (nox installed once)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def test_the_readme_has_python_blocks() -> None:
    assert BLOCKS, "no ```python block in README.md"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_python_block_runs_as_pasted(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"readme_{index}.py"
    script.write_text(BLOCKS[index])
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README block {index} failed:\n{done.stderr[-3000:]}"


def test_the_readme_commands_are_what_ci_runs() -> None:
    """The test command word for word; the demo's nox part (nox is installed by then)."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    found = re.findall(r"^python3 -m pip install nox && (python3 -m nox .*)$", README, re.M)
    assert len(found) == 2, found
    tests, demo = sorted(found, key=lambda command: "demo" in command)
    assert f"python3 -m pip install nox && {tests}" in ci
    assert demo in ci
