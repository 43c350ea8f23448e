"""examples/: each one runs as a user would run it, with small sizes.

The asyncio example is also tested the way an asyncio application tests itself: with
pytest-asyncio, its coroutines awaited on pytest-asyncio's event loop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    sys.path.insert(0, str(EXAMPLES))  # as when run from there: examples import each other
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def run_example(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.asyncio
async def test_the_asyncio_server_reuses_and_verifies_blocks(tmp_path: Path) -> None:
    server = load_example("asyncio_server")
    report = tmp_path / "report.json"
    await server.main(str(tmp_path / "root"), requests=60, concurrency=4, report=str(report))
    summary = json.loads(report.read_text())
    assert summary["blocks"] == 60 * 20  # (256 + 64) tokens: 20 blocks each
    assert summary["reused"] > summary["blocks"] // 2  # shared system prompts come back
    assert summary["promoted"]["disk"] > 0  # evicted from the CPU tier, promoted from fs
    blocks = list((tmp_path / "root").rglob("*.bin"))
    assert blocks and all(p.stat().st_mode & 0o777 == 0o600 for p in blocks)


@pytest.mark.asyncio
async def test_serve_one_returns_what_it_stored(tmp_path: Path) -> None:
    server = load_example("asyncio_server")
    from kvtier_async.api import TieredKVCache

    config = {"block_bytes": server.BLOCK_BYTES, "num_slots": 32}
    prompt = list(range(100))
    async with TieredKVCache(config) as cache:
        assert await server.serve_one(cache, "a", prompt) == (0, 6, False)
        assert await server.serve_one(cache, "b", prompt) == (6, 0, False)  # byte for byte


def test_the_asyncio_server_runs_as_a_script(tmp_path: Path) -> None:
    out = run_example(str(EXAMPLES / "asyncio_server.py"), "--requests", "40", cwd=tmp_path)
    assert "40 requests, 800 blocks" in out and "promoted from disk" in out
    assert (tmp_path / "kvtier-example-root").is_dir()


def test_the_trio_example_runs(tmp_path: Path) -> None:
    out = run_example(str(EXAMPLES / "trio_embedding.py"), "--requests", "40", cwd=tmp_path)
    assert "trio: 40 requests" in out


@pytest.mark.parametrize("name", ["vllm_fs.json", "vllm_s3.json"])
def test_the_vllm_configs_parse_and_carry_no_secret(name: str) -> None:
    from kvtier_async.integrations.vllm.config import ConnectorConfig

    transfer: dict[str, Any] = json.loads((EXAMPLES / name).read_text())
    extra = transfer["kv_connector_extra_config"]
    config = ConnectorConfig.from_extra_config(extra)
    assert config.spec_name == "TieringOffloadingSpec"
    for tier in extra["secondary_tiers"]:
        assert not {"access_key", "secret_key", "session_token"} & set(tier)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["vllm_fs.json", "vllm_s3.json"])
def test_the_vllm_configs_are_valid_kv_transfer_configs(name: str) -> None:
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(**json.loads((EXAMPLES / name).read_text()))
    assert transfer.kv_connector == "KVTierConnector"
    assert transfer.kv_connector_module_path == "kvtier_async.vllm"


def test_the_serve_script_passes_the_config_to_vllm(tmp_path: Path) -> None:
    fake = tmp_path / "vllm"  # a stand-in `vllm` on PATH that prints its arguments
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    config = EXAMPLES / "vllm_s3.json"
    done = subprocess.run(
        [str(EXAMPLES / "vllm_serve.sh"), str(config), "some/model"],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    args = done.stdout.splitlines()
    assert args[:3] == ["serve", "some/model", "--kv-transfer-config"]
    assert json.loads("\n".join(args[3:])) == json.loads(config.read_text())


def test_the_inspect_and_gc_script_runs_on_the_servers_root(tmp_path: Path) -> None:
    script = str(EXAMPLES / "inspect_and_gc.sh")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this venv's kvtier
    missing = subprocess.run([script], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    assert missing.returncode == 2 and "kvtier-example-root: no such directory" in missing.stderr
    run_example(str(EXAMPLES / "asyncio_server.py"), "--requests", "60", cwd=tmp_path)
    done = subprocess.run([script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "\n$ kvtier inspect kvtier-example-root\nkvtier-example-root: 1 model namespace, " in out
    assert "model example-model  digest " in out and "config: block_bytes=16384 " in out
    assert " 0 damaged, 0 vanished, 0 unreadable;" in out
    assert "verify: " in done.stderr and "(100%)" in done.stderr  # the progress lines
    assert "(all models): " in out and "; limit 4.0 MiB\nwould delete " in out
    assert "\nleft " in out and out.count("would leave") == 1
    report = json.loads(
        out.split("$ kvtier inspect --json kvtier-example-root\n")[1].split("\n$")[0]
    )
    assert 0 < report["bytes"] <= 4 << 20
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kvtier-example-root").rglob("*.bin"))
    assert on_disk == report["bytes"]
    assert "\n$ kvtier regions\n/dev/shm: " in out


@pytest.mark.anyio
async def test_the_prometheus_example_serves_what_the_cache_did(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    example = load_example("prometheus")
    root = tmp_path / "root"
    text = await example.main(str(root), 20)
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    files = len(list(root.rglob("*.bin")))
    assert files > 0
    assert got[("kvtier_tier_cascades_total", (("tier", "disk"),))] == files
    assert got[("kvtier_tier_promotions_total", (("tier", "disk"),))] > 0  # evicted, then back
    hits = got[("kvtier_tier_hits_total", (("tier", "disk"),))]
    misses = got[("kvtier_tier_misses_total", (("tier", "disk"),))]
    assert hits + misses == got[("kvtier_tier_lookups_total", (("tier", "disk"),))]


def test_the_prometheus_example_runs_as_a_script(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    out = run_example(str(EXAMPLES / "prometheus.py"), "--requests", "12", cwd=tmp_path)
    assert "scraped http://127.0.0.1:" in out
    assert 'kvtier_tier_cascades_total{tier="disk"}' in out
    assert "CPU tier: 24/24 slots used" in out and "disk (fs): hits" in out  # str(stats)
