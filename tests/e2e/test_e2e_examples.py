"""``examples/vllm_cpu_offline.py`` runs as a user runs it, on vLLM's CPU build."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine_kit import engine_env

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_offline_example_serves_the_prompt_from_the_fs_tier(
    tiny_model: Path, tmp_path: Path
) -> None:
    command = [
        sys.executable, str(EXAMPLES / "vllm_cpu_offline.py"),
        "--model", str(tiny_model), "--root", str(tmp_path / "fs"),
    ]  # fmt: skip
    # vLLM's default engine: the EngineCore in a process of its own.
    env = engine_env(multiprocess=True)
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-6000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    computed = re.fullmatch(r"\S+ s, (\d+) prompt tokens, (\d+) cached, (\d+) from the connector",
                            lines["computed"])  # fmt: skip
    served = re.fullmatch(r"\S+ s, (\d+) prompt tokens, (\d+) cached, (\d+) from the connector",
                          lines["from the fs tier"])  # fmt: skip
    assert computed is not None and served is not None, done.stdout
    prompt, cached, hits = map(int, served.groups())
    assert computed.group(2) == "0"
    assert cached == hits == (prompt - 1) // 128 * 128 > 0
    assert lines["same output"] == "True"
    assert any((tmp_path / "fs").rglob("*.bin"))
