"""``vllm serve`` on 127.0.0.1 with our connector, as a user of vLLM's CPU wheel starts it
(``kvtier vllm serve``: the wheel's own ``vllm`` script cannot start).

One server for the module: OpenAI completions, ``/reset_prefix_cache``, ``/metrics``, vLLM's
KV events received over ZMQ by a subscriber here, then SIGTERM. The fs tier has room for a
few blocks only (``max_bytes``), so its GC deletes some and vLLM announces their removal.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _e2e import BLOCK_BYTES, BLOCK_TOKENS, ENGINE, connector

from engine_kit import engine_env
from engine_kit.launch import stop_group

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 600.0  # a cold start on a loaded 2-core machine
STOP_TIMEOUT_S = 60.0
FS_BLOCKS = 6  # what the fs tier holds: its GC deletes the oldest beyond that
WORDS = ("alpha", "beta", "gamma", "delta", "kv", "cache", "tier", "block")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def text_prompt(seed: int, words: int = 400) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(words))


class Server:
    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process, self.port, self.log = process, port, log

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            raw = response.read().decode()
        return json.loads(raw) if raw.startswith(("{", "[")) else raw

    def complete(self, prompt: str) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        body["return_token_ids"] = True
        out: dict[str, Any] = self.call("POST", "/v1/completions", body)
        return out

    def metrics(self) -> dict[str, float]:
        """The scrape's samples: ``name{labels}`` -> value."""
        out: dict[str, float] = {}
        for line in self.call("GET", "/metrics").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.process.returncode}:\n{self.tail()}")
            try:
                self.call("GET", "/health")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1.0)  # a poll of a starting server, not a timed race
        raise AssertionError(f"vllm serve not up after {START_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


class Events:
    """vLLM's KV event batches, as a subscriber of its ZMQ publisher receives them.

    The socket is bound here and vLLM's publisher connects to it. A ZMQ socket attaches a
    new peer (and sends it the subscription) only while its own thread calls into it, so a
    thread polls it from before the server starts: a publisher whose subscriber never
    answered drops every batch."""

    def __init__(self, port: int) -> None:
        import zmq

        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._batches = 0
        self._thread = threading.Thread(target=self._run, args=(zmq, port), daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("the ZMQ subscriber did not start")

    def _run(self, zmq: Any, port: int) -> None:
        import msgspec

        ctx = zmq.Context()
        socket = ctx.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.bind(f"tcp://127.0.0.1:{port}")  # vLLM's publisher connects here
            self._ready.set()
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                _topic, _seq, payload = socket.recv_multipart()
                _ts, events, *_ = msgspec.msgpack.decode(payload)
                with self._lock:
                    self.events += events
                    self._batches += 1
        finally:
            socket.close(linger=0)
            ctx.term()

    def wait_quiet(self, quiet_s: float, timeout_s: float = 60.0) -> None:
        """Wait until no batch arrived for ``quiet_s`` (``timeout_s`` at most)."""
        deadline = time.monotonic() + timeout_s
        seen, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            with self._lock:
                batches = self._batches
            if batches != seen:
                seen, since = batches, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            self._stop.wait(0.1)

    def of(self, kind: str, medium: str) -> list[dict[str, Any]]:
        with self._lock:
            events = list(self.events)
        return [e for e in events if e.get("type") == kind and e.get("medium") == medium]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(
    tiny_model: Path, workdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The server's life: requests, resets, metrics, events, then SIGTERM."""
    root = tmp_path_factory.mktemp("fs-serve")
    instance = f"e2e-serve-{uuid.uuid4().hex[:8]}"
    fs = {"type": "fs", "root_dir": str(root), "max_bytes": FS_BLOCKS * (BLOCK_BYTES + 4096)}
    transfer = connector({"secondary_tiers": [fs], "instance_id": instance})
    port, events_port = free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{events_port}",
    }
    command = [
        str(Path(sys.executable).parent / "kvtier"), "vllm", "serve", str(tiny_model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
        "--block-size", str(BLOCK_TOKENS), "--enforce-eager",
        "--kv-transfer-config", json.dumps(transfer),
        "--kv-events-config", json.dumps(events_config),
    ]  # fmt: skip
    env = engine_env(multiprocess=True)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    log = workdir / "serve.log"
    subscriber = Events(events_port)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Server(process, port, log)
    try:
        server.wait_ready()
        first = text_prompt(1)
        record: dict[str, Any] = {"instance": instance, "server": server}
        record["cold"] = server.complete(first)
        record["again"] = server.complete(first)
        record["reset"] = server.call("POST", "/reset_prefix_cache?reset_external=true")
        record["promoted"] = server.complete(first)
        # More prompts than the fs tier holds: its GC deletes the oldest blocks.
        record["more"] = [server.complete(text_prompt(seed)) for seed in (2, 3)]
        subscriber.wait_quiet(quiet_s=3.0)
        # vLLM's frontend folds the connector's stats into /metrics once a step's
        # payload arrives; our series are read at most once a second.
        time.sleep(2.5)
        server.complete(text_prompt(9, words=20))  # a step that carries the last payload
        record["metrics"] = server.metrics()
        subscriber.wait_quiet(quiet_s=2.0)
        record["events"] = subscriber
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            record["exit_code"] = process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            record["exit_code"] = None
        record["stop_s"] = time.monotonic() - started
        record["survivors"] = _survivors(process.pid, within_s=15.0)
        yield record
    finally:
        stop_group(process, grace_s=5.0)
        subscriber.close()


def _group_members(pgid: int) -> list[str]:
    """The processes of group ``pgid`` still alive (zombies aside): ``pid name`` each."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # ended meanwhile
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, _ppid, group = text[text.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            members.append(f"{stat.parent.name} {name}")
    return members


def _survivors(pgid: int, within_s: float) -> list[str]:
    """The group's processes that are still alive ``within_s`` after its leader exited
    (vLLM's server kills its engine and workers on the way out; they take a moment)."""
    deadline = time.monotonic() + within_s
    while (members := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)  # a poll of processes that are exiting, not a timed race
    return members


def _tokens(out: dict[str, Any]) -> list[int]:
    return list(out["choices"][0]["token_ids"])


def _cached(out: dict[str, Any]) -> int:
    prompt = int(out["usage"]["prompt_tokens"])
    return (prompt - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def test_completions_are_the_same_computed_cached_and_promoted(served: dict[str, Any]) -> None:
    cold, again, promoted = served["cold"], served["again"], served["promoted"]
    assert len(_tokens(cold)) == 8
    assert _tokens(again) == _tokens(cold)
    assert _tokens(promoted) == _tokens(cold)
    assert promoted["choices"][0]["text"] == cold["choices"][0]["text"]
    assert served["reset"] == {"success": True}


def test_metrics_count_the_requests_made(served: dict[str, Any]) -> None:
    m = served["metrics"]
    requests = [served["cold"], served["again"], served["promoted"], *served["more"]]
    prompt_tokens = sum(int(r["usage"]["prompt_tokens"]) for r in requests)
    engine = '{engine="0",model_name="tiny"}'
    # vLLM's own series: every prompt token, and the one promoted request's blocks as
    # external hits (the reset dropped the CPU tier's copy: they came from the files).
    assert m[f"vllm:prompt_tokens_total{engine}"] >= prompt_tokens  # + the last short one
    assert m[f"vllm:external_prefix_cache_hits_total{engine}"] == _cached(served["promoted"])
    stored_blocks = sum(_cached(r) // BLOCK_TOKENS for r in (served["cold"], *served["more"]))
    assert m[f"vllm:kv_offload_store_bytes_total{engine}"] == stored_blocks * BLOCK_BYTES
    loaded = _cached(served["promoted"]) // BLOCK_TOKENS
    assert m[f"vllm:kv_offload_load_bytes_total{engine}"] == loaded * BLOCK_BYTES
    # Ours: every stored block cascaded into the files, the promoted ones read back.
    tier = '{engine="0",model_name="tiny",tier="fs[0]"}'
    assert m[f"kvtier_tier_cascades_total{tier}"] == stored_blocks
    assert m[f"kvtier_tier_promotions_total{tier}"] == loaded
    assert m[f"kvtier_tier_hits_total{tier}"] == loaded


def test_kv_events_arrive_over_zmq(served: dict[str, Any]) -> None:
    events = served["events"]
    stored_cpu = events.of("BlockStored", "CPU")
    stored_fs = events.of("BlockStored", "STORAGE")
    assert stored_cpu and stored_fs
    assert all(e.get("ownership") == "fs[0]" for e in stored_fs)
    # The fs tier holds FS_BLOCKS: its GC deleted the rest, each announced once.
    removed = events.of("BlockRemoved", "STORAGE")
    stored = sum(len(e["block_hashes"]) for e in stored_fs)
    gone = sum(len(e["block_hashes"]) for e in removed)
    assert stored > FS_BLOCKS
    assert gone >= stored - FS_BLOCKS


def test_what_vllm_0_32_lacks_is_said_once_at_start_up(served: dict[str, Any]) -> None:
    log = served["server"].log.read_text(errors="replace")
    # Once per process that runs a connector role: the engine core and the worker.
    assert 1 <= log.count("this vLLM predates 0.33: left out") <= 2
    assert "vllm:kv_offload_config_info" in log


def test_sigterm_ends_the_server_and_leaves_nothing_behind(served: dict[str, Any]) -> None:
    assert served["exit_code"] is not None, f"still running {STOP_TIMEOUT_S} s after SIGTERM"
    assert served["stop_s"] < STOP_TIMEOUT_S
    assert served["survivors"] == [], "processes of the server's group outlived it"
    left = [p.name for p in Path("/dev/shm").iterdir() if served["instance"] in p.name]
    assert left == []
