"""A fleet on one shared tier (``nox -s fleet``): two ``vllm serve`` engines, ``rclone serve
s3``, the router with the prefix index, all started by the recipe a user runs,
``examples/fleet.sh`` (the package's ``fleet.sh``).

One fleet for the module, one scenario through it (each test asserts one property of what it
recorded, as in the rest of the e2e suite):

1. engine a computes prompt P; engine b, which never saw it, serves it from the shared fs
   root;
2. a computes S; S's files are deleted from the fs root; b serves S from the bucket;
3. the S3 server is paused (SIGSTOP) while a computes the long prompt L, so a's PUTs of L
   hang in flight; a's whole process group is killed (SIGKILL) mid-store; the server runs
   again; L's files are deleted from the fs root; b serves L (from whatever of it the bucket
   holds whole, the rest computed), and every object and file left verifies;
4. a is restarted by the recipe and serves P from the blocks it stored before it died;
5. through the router: P goes to an engine that holds it, and the index saw the restart.

Greedy outputs are compared with an engine without a connector; hits are vLLM's own
counters (``vllm:external_prefix_cache_hits_total``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _e2e import BLOCK_TOKENS

from kvtier_async.fleet import BlockHasher
from kvtier_async.tiny_model import prompt_ids

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.fleet,
    pytest.mark.timeout(1800),
]  # the scenario: minutes

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "fleet.sh"  # runs the package's recipe, as a user would
EXTERNAL = 'vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"}'
PROMPT_TOKENS = 'vllm:prompt_tokens_total{engine="0",model_name="tiny"}'
PROMPTS = {
    "P": prompt_ids(1, 600, seed=11)[0],
    "S": prompt_ids(1, 600, seed=12)[0],
    "L": prompt_ids(1, 3000, seed=13)[0],
}
MAX_TOKENS = 8
WAIT_S = 180.0
HASHER = BlockHasher(BLOCK_TOKENS)


def full(tokens: list[int]) -> int:
    """Tokens of a prompt a cache can hold: its full blocks but the last token's."""
    return (len(tokens) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it (checked now; loopback only)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65000:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def call(url: str, body: Any = None, timeout: float = 120.0) -> tuple[dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read().decode()
        headers = dict(response.headers)
    return headers, (json.loads(raw) if raw.startswith(("{", "[")) else raw)


class Fleet:
    def __init__(self, run: Path, env: dict[str, str]) -> None:
        self.run, self.env = run, env
        self.base = int(env["BASE_PORT"])

    def recipe(self, *args: str, timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(RECIPE), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def url(self, engine: str) -> str:
        return f"http://127.0.0.1:{self.base + 'ab'.index(engine) + 1}"

    @property
    def router(self) -> str:
        return f"http://127.0.0.1:{self.base}"

    def pid(self, name: str) -> int:
        return int((self.run / f"{name}.pid").read_text())

    def complete(self, where: str, prompt: str) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "prompt": PROMPTS[prompt],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        headers, out = call(f"{where}/v1/completions", body)
        return {"tokens": list(out["choices"][0]["token_ids"]), "headers": headers}

    def counters(self, engine: str) -> tuple[float, float]:
        """vLLM's prompt tokens and external prefix-cache hits on ``engine``, so far."""
        _, text = call(f"{self.url(engine)}/metrics")
        found = dict.fromkeys((PROMPT_TOKENS, EXTERNAL), 0.0)
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in found:
                found[name] = float(value)
        return found[PROMPT_TOKENS], found[EXTERNAL]

    def served(self, engine: str, prompt: str) -> dict[str, Any]:
        """``prompt`` on ``engine``: its tokens, and the external hits it counted."""
        tokens_before, hits_before = self.counters(engine)
        out = self.complete(self.url(engine), prompt)
        # vLLM folds a step's stats into /metrics when the next payload arrives: wait until
        # this request's prompt tokens are counted (its hits are counted with them).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            tokens, hits = self.counters(engine)
            if tokens - tokens_before >= len(PROMPTS[prompt]):
                return {**out, "external": hits - hits_before}
            time.sleep(0.5)  # a poll of a counter another process updates
        raise AssertionError(f"{engine}: {prompt}'s prompt tokens not counted in 60 s")

    def match(self, prompt: str) -> dict[str, Any]:
        return call(f"{self.router}/fleet/match", {"token_ids": PROMPTS[prompt]})[1]

    def wait_stored(self, prompt: str, tiers: tuple[str, ...]) -> dict[str, Any]:
        """Until the index says each of ``tiers`` holds the prompt's full blocks."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            m = self.match(prompt)
            if all(m["storage"].get(t, 0) >= full(PROMPTS[prompt]) for t in tiers):
                return m
            time.sleep(0.2)  # a poll of the index, which KV events feed
        raise AssertionError(f"{prompt} not in {tiers} after {WAIT_S} s: {self.match(prompt)}")

    def delete_files(self, prompt: str) -> int:
        """Remove the prompt's blocks from the shared fs root (the bucket keeps its copy)."""
        names = {f"{h.hex()}.bin" for h in HASHER.hashes(PROMPTS[prompt])}
        gone = 0
        for path in (self.run / "fs").rglob("*.bin"):
            if path.name in names:
                path.unlink()
                gone += 1
        return gone

    def verify(self, location: str) -> subprocess.CompletedProcess[str]:
        kvtier = str(Path(sys.executable).parent / "kvtier")
        args = [kvtier, "inspect", "--verify", "--json", location]
        if location.startswith("s3://"):
            args[3:3] = ["--endpoint", f"127.0.0.1:{self.env['S3_PORT']}"]
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def baseline(engine: Any) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from an engine without a connector."""
    op = {
        "op": "generate",
        "prompts": list(PROMPTS.values()),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }
    results = engine("fleet-baseline", [op])["results"]
    return dict(zip(PROMPTS, results[0]["token_ids"], strict=True))


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    run = tmp_path_factory.mktemp("fleet")
    base, replay, events, s3 = free_ports(3), free_ports(3), free_ports(1), free_ports(1)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MODEL": str(tiny_model),
        "FLEET_DIR": str(run),
        "BASE_PORT": str(base),
        "REPLAY_BASE": str(replay),
        "EVENTS_PORT": str(events),
        "S3_PORT": str(s3),
        "PYTHON": sys.executable,
    }
    fleet = Fleet(run, env)
    up = fleet.recipe("up")
    try:
        assert up.returncode == 0, f"{up.stderr}\n{_logs(run)}"
        creds = dict(line.split("=", 1) for line in (run / "s3.env").read_text().split())
        fleet.env.update(creds)  # for kvtier inspect s3://
        yield fleet
    finally:
        fleet.recipe("down", timeout=300)


def _logs(run: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in run.glob("*.log")
    )


@pytest.fixture(scope="module")
def scenario(fleet: Fleet) -> dict[str, Any]:
    record: dict[str, Any] = {}
    # 1. a computes P; b serves it from the shared fs root.
    record["P on a"] = fleet.served("a", "P")
    record["P stored"] = fleet.wait_stored("P", ("shared-fs", "shared-s3"))
    record["P on b"] = fleet.served("b", "P")
    # 2. a computes S; its files go; b serves it from the bucket.
    record["S on a"] = fleet.served("a", "S")
    fleet.wait_stored("S", ("shared-fs", "shared-s3"))
    record["S files deleted"] = fleet.delete_files("S")
    record["S on b"] = fleet.served("b", "S")
    # 3. a is killed while its PUTs of L hang on a paused S3 server.
    os.kill(fleet.pid("s3"), signal.SIGSTOP)
    try:
        record["L on a"] = fleet.complete(fleet.url("a"), "L")
        record["L in fs"] = fleet.wait_stored("L", ("shared-fs",))
        os.killpg(fleet.pid("a"), signal.SIGKILL)
    finally:
        os.kill(fleet.pid("s3"), signal.SIGCONT)
    record["L files deleted"] = fleet.delete_files("L")
    record["L on b"] = fleet.served("b", "L")
    record["verify fs"] = fleet.verify(str(fleet.run / "fs"))
    record["verify s3"] = fleet.verify("s3://kv")
    # 4. a, restarted, serves P from what it stored before it died.
    restart = fleet.recipe("engine", "a")
    assert restart.returncode == 0, f"{restart.stderr}\n{_logs(fleet.run)}"
    record["P on a again"] = fleet.served("a", "P")
    # 5. the router: P to an engine that holds it locally; the index's view of the restart.
    record["P via router"] = fleet.complete(fleet.router, "P")
    record["engines"] = call(f"{fleet.router}/fleet/engines")[1]
    return record


def test_another_engine_serves_a_prompt_from_the_shared_fs_root(
    scenario: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    assert scenario["P on a"]["tokens"] == baseline["P"]
    assert scenario["P on b"]["tokens"] == baseline["P"]
    assert scenario["P on b"]["external"] == full(PROMPTS["P"])  # every full block, from a


def test_the_index_saw_both_tiers_hold_the_prompt(scenario: dict[str, Any]) -> None:
    stored = scenario["P stored"]
    assert stored["storage"] == {"shared-fs": full(PROMPTS["P"]), "shared-s3": full(PROMPTS["P"])}
    assert stored["gpu"]["a"] >= full(PROMPTS["P"])


def test_another_engine_serves_a_prompt_from_the_bucket(
    scenario: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    assert scenario["S files deleted"] == full(PROMPTS["S"]) // BLOCK_TOKENS
    assert scenario["S on b"]["tokens"] == baseline["S"]
    assert scenario["S on b"]["external"] == full(PROMPTS["S"])


def test_an_engine_killed_mid_store_leaves_nothing_torn_to_serve(
    scenario: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    assert scenario["L on a"]["tokens"] == baseline["L"]
    # The fs copies were published before the kill; S3's hung in flight.
    assert scenario["L files deleted"] == full(PROMPTS["L"]) // BLOCK_TOKENS
    assert scenario["L on b"]["tokens"] == baseline["L"]
    assert scenario["L on b"]["external"] < full(PROMPTS["L"])  # the PUTs did not all land
    for name in ("verify fs", "verify s3"):
        done = scenario[name]
        assert done.returncode == 0, f"{name}: {done.stdout}\n{done.stderr}"
        report = json.loads(done.stdout)
        checked = report["verify"]
        assert checked["damaged"] == [] and checked["good"] == checked["checked"] > 0, checked


def test_a_restarted_engine_serves_its_own_stored_blocks(
    scenario: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    assert scenario["P on a again"]["tokens"] == baseline["P"]
    assert scenario["P on a again"]["external"] == full(PROMPTS["P"])


def test_the_router_routes_by_the_index_and_saw_the_restart(
    scenario: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    out = scenario["P via router"]
    assert out["tokens"] == baseline["P"]
    assert out["headers"]["x-kvtier-route"] == "local"
    index = {e["name"]: e for e in scenario["engines"]["index"]}
    # a's new publisher began its sequence again: the index dropped a's old blocks.
    assert index["a"]["restarts"] >= 1
    assert index["b"]["restarts"] == index["b"]["malformed"] == index["b"]["resyncs"] == 0


def test_the_recipe_stops_everything(fleet: Fleet, scenario: dict[str, Any]) -> None:
    down = fleet.recipe("down", timeout=300)
    assert down.returncode == 0, down.stderr
    for name in ("a", "b", "router", "s3"):
        assert not (fleet.run / f"{name}.pid").exists()
    alive = [n for n in ("a", "b") if _running(f"fleet-{n}")]
    assert alive == []


def _running(instance: str) -> bool:
    """A process whose command line names ``instance`` (an engine of the fleet) is alive."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if instance.encode() in cmdline.read_bytes():
                return True
        except OSError:
            continue
    return False
