"""Benchmark ``fleet``: a fleet of real engines on one shared tier, routed three ways.

The Mooncake conversation trace (``../shared/traces``, or ``$KVTIER_FLEET_TRACE``), scaled
to this machine: whole conversations sampled at random (a conversation is the requests that
share their second block: the first is everyone's system prompt) until `REQUESTS` requests,
each prompt cut to its first `MAX_BLOCKS` trace blocks, one trace block (512 tokens) made a
vLLM block of 128 tokens (deterministic token ids per trace block id, so equal ids are equal
prefixes and equal vLLM block hashes) plus 16 tokens of its own, the hour's arrival times
compressed into `DURATION_S`. Each request asks for `OUTPUT_TOKENS` tokens, streamed, and its
time to first token (TTFT) is the time to the first streamed chunk, seen by the client.

Each case runs on a fleet of its own, started by the recipe (``kvtier fleet recipe``:
``rclone serve s3``, the router with the index, `ENGINES` ``vllm serve`` engines with our
connector on one fs root and one bucket, fresh), the same trace and schedule:

- ``single``: one engine that sees every request (the hit rate a fleet's shared tier should
  reach: the reference of round robin's);
- ``round-robin``: vllm-router's ``round_robin`` in front of the engines;
- ``cache-aware``: vllm-router's ``cache_aware`` policy (its prefix tree over the token ids);
- ``kvtier``: our router (the index fed by the engines' KV events).

The cases run in turns, their order rotated each round (`ROUNDS`; a quick run: one round,
fewer requests, no verdicts). Figures per case, from vLLM's own counters on the engines:
the fleet's prefix hit rate (tokens served by vLLM's prefix cache or by our tiers, over
prompt tokens), TTFT p50 and p99, and the share of hits that came through the shared tier
from blocks another engine computed (our promotions from the shared tiers: the CPU tier
never evicts here, so a block promoted into it is one this engine did not hold). Goals:
round robin's hit rate at least 0.9x the single engine's; ours at least 1.2x faster than
vllm-router's cache-aware policy at TTFT p50. The index alone: its memory per million
blocks and the time of a match for a 4k-token prompt (a budget, not a reference).

Where the host's CPU went during each replay, per role (the router, the engines with their
engine-core processes, the S3 server, this client): the CPU seconds of each role's process
session, read from ``/proc`` before and after, printed per case with the share of the host's
cores, and the router's CPU per request as a record. On a host whose engines share its cores
with everything else, a router's own CPU is time the engines do not get.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import BenchRecord, latency_record, throughput_record

__all__ = ["CASES", "run", "scaled_trace"]

ENGINES = ("a", "b")
CASES = ("single", "round-robin", "cache-aware", "kvtier")
BLOCK_TOKENS = 128
TAIL_TOKENS = 16
MAX_BLOCKS = 8
REQUESTS, QUICK_REQUESTS = 240, 40
DURATION_S, QUICK_DURATION_S = 80.0, 20.0
ROUNDS = 2
OUTPUT_TOKENS = 4
VOCAB = (3, 1200)  # token ids every build of the tiny model's tokenizer knows
STANDING_TRACE = (
    Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "mooncake-conversation.jsonl"
)
HIT_TARGET = 0.9  # round robin with the shared tier, x the single engine's hit rate
TTFT_TARGET = 1.2  # ours against vllm-router's cache-aware policy, TTFT p50
MATCH_BUDGET_S = 1e-3  # one match of a 4k-token prompt


@dataclass(frozen=True)
class Request:
    arrival_s: float
    tokens: list[int]


def scaled_trace(path: Path, *, requests: int, duration_s: float, seed: int = 0) -> list[Request]:
    """The trace scaled to this machine (see the module docstring)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])
    by_conversation: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        ids = row["hash_ids"]
        by_conversation[ids[1] if len(ids) > 1 else -1].append(row)
    order = sorted(by_conversation)
    random.Random(seed).shuffle(order)
    chosen: list[dict[str, Any]] = []
    for conversation in order:
        chosen += by_conversation[conversation]
        if len(chosen) >= requests:
            break
    chosen.sort(key=lambda r: r["timestamp"])
    start, end = chosen[0]["timestamp"], chosen[-1]["timestamp"]
    scale = duration_s / max(end - start, 1)
    out = []
    for n, row in enumerate(chosen):
        tokens: list[int] = []
        for block_id in row["hash_ids"][:MAX_BLOCKS]:
            rng = random.Random(block_id)
            tokens += [rng.randrange(*VOCAB) for _ in range(BLOCK_TOKENS)]
        rng = random.Random(10_000_000 + n)
        tokens += [rng.randrange(*VOCAB) for _ in range(TAIL_TOKENS)]
        out.append(Request((row["timestamp"] - start) * scale, tokens))
    return out


# -- one fleet ---------------------------------------------------------------------------


def _free_base(n: int) -> int:
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
    raise RuntimeError("no run of free ports on 127.0.0.1")


def _get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def _metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for line in _get(f"{url}/metrics").splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.partition("{")[0] + _tier(name)] += float(value)
    return out


def _tier(series: str) -> str:
    marker = 'tier="'
    at = series.find(marker)
    return "" if at < 0 else "/" + series[at + len(marker) :].partition('"')[0]


@dataclass
class Fleet:
    """One fleet, started by the recipe with ``engines`` (and stopped on exit)."""

    model: Path
    run_dir: Path
    engines: Sequence[str]
    cpu_bytes: int
    env: dict[str, str] = field(default_factory=dict)
    router: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        bin_dir = Path(sys.executable).parent
        self.base = _free_base(len(self.engines) + 2)
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "MODEL": str(self.model),
            "FLEET_DIR": str(self.run_dir),
            "ENGINES": " ".join(self.engines),
            "BASE_PORT": str(self.base),
            "REPLAY_BASE": str(_free_base(len(self.engines) + 1)),
            "EVENTS_PORT": str(_free_base(1)),
            "S3_PORT": str(_free_base(1)),
            "CPU_BYTES": str(self.cpu_bytes),
            "KV_CACHE_GIB": "2",
            "PYTHON": sys.executable,
        }

    def recipe(self, *args: str) -> None:
        from kvtier_async.cli import main  # noqa: F401  (the same install as this process)

        path = Path(__file__).resolve().parents[1] / "fleet" / "fleet.sh"
        done = subprocess.run(
            ["bash", str(path), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if done.returncode != 0:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                for p in self.run_dir.glob("*.log")
            )
            raise RuntimeError(f"fleet.sh {' '.join(args)} failed:\n{done.stderr}\n{logs}")

    def url(self, engine: str) -> str:
        return f"http://127.0.0.1:{self.base + list(self.engines).index(engine) + 1}"

    def __enter__(self) -> Fleet:
        self.recipe("up")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.router is not None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        self.recipe("down")

    def vllm_router(self, policy: str) -> str:
        """vllm-router with ``policy`` in front of the engines; its URL."""
        port, metrics = _free_base(1), _free_base(1)
        exe = shutil.which("vllm-router", path=self.env["PATH"])
        if exe is None:
            raise RuntimeError("vllm-router is not installed (pip install vllm-router==0.1.17)")
        command = [
            exe,
            "--worker-urls",
            *[self.url(e) for e in self.engines],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(metrics),
            "--policy",
            policy,
            "--worker-startup-check-interval",
            "1",
        ]
        with open(self.run_dir / f"vllm-router-{policy}.log", "wb") as log:
            self.router = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"vllm-router exited {self.router.returncode}")
            try:
                _get(f"{url}/health", timeout=2)
                return url
            except OSError:
                time.sleep(0.5)  # a poll of a starting server
        raise RuntimeError("vllm-router did not come up in 120 s")


# -- one case ----------------------------------------------------------------------------


@dataclass
class Outcome:
    case: str
    ttft_s: list[float]
    prompt_tokens: float
    gpu_hits: float
    external_hits: float
    shared_hits: float
    routes: collections.Counter[str]
    why_failed: collections.Counter[str]  # failed requests by what went wrong
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by role
    wall_s: float = 0.0  # the replay's

    @property
    def failures(self) -> int:
        return self.why_failed.total()

    @property
    def hit_rate(self) -> float:
        return (self.gpu_hits + self.external_hits) / max(self.prompt_tokens, 1.0)

    @property
    def shared_share(self) -> float:
        hits = self.gpu_hits + self.external_hits
        return self.shared_hits / hits if hits else 0.0


async def _replay(
    url: str, trace: Sequence[Request]
) -> tuple[list[float], collections.Counter[str], collections.Counter[str]]:
    """TTFTs, failed requests by what went wrong, routes by why."""
    import aiohttp

    ttfts: list[float] = []
    routes: collections.Counter[str] = collections.Counter()
    failures: collections.Counter[str] = collections.Counter()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        start = time.perf_counter()

        async def one(request: Request) -> None:
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the trace's arrival time
            body = {
                "model": "tiny",
                "prompt": request.tokens,
                "max_tokens": OUTPUT_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
            sent = time.perf_counter()
            try:
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        text = (await resp.text())[:120]
                        failures[f"HTTP {resp.status} {text}"] += 1
                        return
                    routes[resp.headers.get("x-kvtier-route", "-")] += 1
                    first = None
                    async for _chunk in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter() - sent
                    if first is not None:
                        ttfts.append(first)
            except (aiohttp.ClientError, TimeoutError) as exc:
                failures[f"{type(exc).__name__}: {exc}"[:160]] += 1

        await asyncio.gather(*(one(r) for r in trace))
    return ttfts, failures, routes


def _sessions_cpu_s(sids: Collection[int]) -> dict[int, float]:
    """CPU seconds (user and system) of the processes now in each of the sessions ``sids``,
    from one pass over ``/proc``."""
    ticks = dict.fromkeys(sids, 0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # it exited meanwhile
        # After the command's name: state, ppid, pgrp, session, ..., utime (12th), stime.
        sid = int(fields[3])
        if sid in ticks:
            ticks[sid] += int(fields[11]) + int(fields[12])
    tick_s = os.sysconf("SC_CLK_TCK")
    return {sid: n / tick_s for sid, n in ticks.items()}


def _roles(fleet: Fleet, case: str) -> dict[str, int]:
    """Each role's session (its leader's pid): each was started in a session of its own."""
    roles = {f"engine {e}": int((fleet.run_dir / f"{e}.pid").read_text()) for e in fleet.engines}
    roles["s3"] = int((fleet.run_dir / "s3.pid").read_text())
    if case == "kvtier":
        roles["router"] = int((fleet.run_dir / "router.pid").read_text())
    elif fleet.router is not None:
        roles["router"] = fleet.router.pid
    return roles


def _run_case(
    case: str, model: Path, trace: Sequence[Request], cpu_bytes: int, say: Callable[[str], None]
) -> Outcome:
    engines = ENGINES[:1] if case == "single" else ENGINES
    with (
        tempfile.TemporaryDirectory(prefix=f"kvtier-fleet-{case}-") as tmp,
        Fleet(model, Path(tmp), engines, cpu_bytes) as fleet,
    ):
        if case == "single":
            url = fleet.url("a")
        elif case == "kvtier":
            url = f"http://127.0.0.1:{fleet.base}"
        else:
            url = fleet.vllm_router("round_robin" if case == "round-robin" else "cache_aware")
        say(f"fleet {case}: replaying {len(trace)} requests")
        roles = _roles(fleet, case)
        cpu_before = _sessions_cpu_s(roles.values())
        client_before, wall_before = time.process_time(), time.perf_counter()
        ttfts, failures, routes = asyncio.run(_replay(url, trace))
        wall_s = time.perf_counter() - wall_before
        cpu_after = _sessions_cpu_s(roles.values())
        cpu_s = {role: cpu_after[sid] - cpu_before[sid] for role, sid in roles.items()}
        cpu_s["client"] = time.process_time() - client_before
        time.sleep(2.5)  # vLLM folds a step's stats into /metrics with the next payload
        for engine in engines:  # a step that carries the last payload
            _complete_short(fleet.url(engine))
        totals: dict[str, float] = collections.defaultdict(float)
        for engine in engines:
            for name, value in _metrics(fleet.url(engine)).items():
                totals[name] += value
    shared = sum(v for k, v in totals.items() if k.startswith("kvtier_tier_promotions_total/"))
    return Outcome(
        case,
        ttfts,
        totals["vllm:prompt_tokens_total"],
        totals["vllm:prefix_cache_hits_total"],
        totals["vllm:external_prefix_cache_hits_total"],
        shared * BLOCK_TOKENS,
        routes,
        failures,
        cpu_s,
        wall_s,
    )


def _cpu_line(outcome: Outcome) -> str:
    """Where the CPU went in a replay: seconds and share of the host's cores, per role."""
    cores = os.cpu_count() or 1
    capacity = max(outcome.wall_s * cores, 1e-9)
    engines = sum(v for k, v in outcome.cpu_s.items() if k.startswith("engine "))
    others = {k: v for k, v in outcome.cpu_s.items() if not k.startswith("engine ")}
    parts = {"engines": engines, **others}
    shown = ", ".join(f"{k} {v:.1f} s ({v / capacity:.0%})" for k, v in parts.items())
    return f"CPU in {outcome.wall_s:.0f} s of replay on {cores} cores: {shown}"


def _complete_short(url: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the index alone ---------------------------------------------------------------------


def _index_records() -> list[BenchRecord]:
    from kvtier_async.fleet import BlockHasher, FleetIndex
    from kvtier_async.fleet.wire import Batch, BlockStored

    rng = random.Random(0)
    million: list[bytes | int] = [rng.getrandbits(256).to_bytes(32, "big") for _ in range(10**6)]
    tracemalloc.start()
    index = FleetIndex(["a"], max_blocks=2_000_000)
    before = tracemalloc.get_traced_memory()[0]
    for at in range(0, len(million), 10_000):
        index.receive("a", at // 10_000, Batch(0.0, [BlockStored(million[at : at + 10_000])]))
    per_million = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del million
    hasher = BlockHasher(16)
    tokens = [rng.randrange(32000) for _ in range(4096)]
    engines = [f"e{i}" for i in range(8)]
    index = FleetIndex(engines)
    for i, engine in enumerate(engines):
        held: list[bytes | int] = list(hasher.hashes(tokens)[: 32 * i])
        index.receive(engine, 0, Batch(0.0, [BlockStored(held)]))
    times = []
    for _ in range(200):
        started = time.perf_counter()
        index.match(hasher.keys(tokens))
        times.append(time.perf_counter() - started)
    match_s = statistics.median(times)
    return [
        BenchRecord(
            "fleet", "index: 1M GPU blocks of one engine", "MiB", per_million / 2**20, unit="MiB"
        ),
        latency_record(
            "fleet",
            "index: match a 4k-token prompt (256 blocks of 16, 8 engines, hashing included), p50",
            "s",
            match_s,
            reference=MATCH_BUDGET_S,
            reference_name="a budget of 1 ms (fixed, not measured)",
            target=1.0,
            unit="s",
        ),
    ]


# -- the benchmark -----------------------------------------------------------------------


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Replay the scaled trace through each case's fleet (see the module docstring)."""
    from .e2e import engine_available

    say = progress or (lambda _msg: None)
    records = _index_records()
    if not engine_available() or shutil.which("rclone") is None:
        say(
            "fleet: no vLLM engine or no rclone here (nox -s bench_fleet installs both); "
            "only the index's figures"
        )
        return records
    trace_path = Path(os.environ.get("KVTIER_FLEET_TRACE", STANDING_TRACE))
    if not trace_path.is_file():
        raise FileNotFoundError(
            f"fleet: the trace {trace_path} is not there "
            "(set KVTIER_FLEET_TRACE to a Mooncake trace file)"
        )
    trace = scaled_trace(
        trace_path,
        requests=QUICK_REQUESTS if quick else REQUESTS,
        duration_s=QUICK_DURATION_S if quick else DURATION_S,
    )
    from kvtier_async.tiny_model import build_tiny_model

    model_dir = Path(os.environ.get("KVTIER_E2E_MODEL") or tempfile.mkdtemp(prefix="kvtier-model-"))
    model = build_tiny_model(model_dir)
    blocks = {
        tuple(r.tokens[i : i + BLOCK_TOKENS])
        for r in trace
        for i in range(0, len(r.tokens) - TAIL_TOKENS, BLOCK_TOKENS)
    }
    block_bytes = BLOCK_TOKENS * 4 * 2 * 2 * 64 * 4  # the tiny model's KV per block, float32
    cpu_bytes = 2 * (len(blocks) + len(trace)) * block_bytes  # the CPU tier never evicts
    say(
        f"fleet: {len(trace)} requests, {len(blocks)} distinct blocks, "
        f"{sum(len(r.tokens) for r in trace)} prompt tokens"
    )
    outcomes: dict[str, list[Outcome]] = collections.defaultdict(list)
    for round_ in range(1 if quick else ROUNDS):
        order = CASES[round_ % len(CASES) :] + CASES[: round_ % len(CASES)]
        for case in order:
            outcome = _run_case(case, model, trace, cpu_bytes, say)
            outcomes[case].append(outcome)
            say(
                f"fleet {case}: hit rate {outcome.hit_rate:.3f}, TTFT p50 "
                f"{statistics.median(outcome.ttft_s) * 1e3:.0f} ms, shared share "
                f"{outcome.shared_share:.3f}, failures {outcome.failures}, "
                f"routes {dict(outcome.routes)}"
            )
            say(f"fleet {case}: {_cpu_line(outcome)}")
            for why, count in outcome.why_failed.items():
                say(f"fleet {case}: {count} failed: {why}")
    return records + _records(outcomes)


def _records(outcomes: dict[str, list[Outcome]]) -> list[BenchRecord]:
    def merged(case: str) -> Outcome:
        runs = outcomes[case]
        ttft = [t for o in runs for t in o.ttft_s]
        total, why = collections.Counter[str](), collections.Counter[str]()
        cpu: dict[str, float] = collections.defaultdict(float)
        for o in runs:
            total.update(o.routes)
            why.update(o.why_failed)
            for role, seconds in o.cpu_s.items():
                cpu[role] += seconds
        return Outcome(
            case,
            ttft,
            sum(o.prompt_tokens for o in runs),
            sum(o.gpu_hits for o in runs),
            sum(o.external_hits for o in runs),
            sum(o.shared_hits for o in runs),
            total,
            why,
            cpu,
            sum(o.wall_s for o in runs),
        )

    cases = {case: merged(case) for case in CASES}
    single, ca = cases["single"], cases["cache-aware"]
    out: list[BenchRecord] = []
    for case in CASES[1:]:
        o = cases[case]
        out.append(
            throughput_record(
                "fleet",
                f"{case}: fleet prefix hit rate",
                "hit rate",
                o.hit_rate,
                reference=single.hit_rate,
                reference_name="one engine that saw every request",
                target=HIT_TARGET if case == "round-robin" else None,
            )
        )
    for case in CASES:
        o = cases[case]
        out.append(
            latency_record(
                "fleet",
                f"{case}: TTFT p50",
                "s",
                statistics.median(o.ttft_s),
                reference=statistics.median(ca.ttft_s),
                reference_name="vllm-router cache_aware, same trace and fleet",
                target=TTFT_TARGET if case == "kvtier" else None,
                unit="s",
            )
        )
        out.append(
            latency_record(
                "fleet",
                f"{case}: TTFT p99",
                "s",
                _percentile(o.ttft_s, 0.99),
                reference=_percentile(ca.ttft_s, 0.99),
                reference_name="vllm-router cache_aware, same trace and fleet",
                unit="s",
            )
        )
        out.append(
            BenchRecord(
                "fleet",
                f"{case}: share of hits through the shared tier from another engine's blocks",
                "share",
                o.shared_share,
            )
        )
        if o.cpu_s.get("router", 0.0) > 0 and ca.cpu_s.get("router", 0.0) > 0:
            out.append(
                latency_record(
                    "fleet",
                    f"{case}: the router's CPU per request",
                    "s",
                    o.cpu_s["router"] / max(len(o.ttft_s), 1),
                    reference=ca.cpu_s["router"] / max(len(ca.ttft_s), 1),
                    reference_name="vllm-router cache_aware's, same trace and fleet",
                    unit="s",
                )
            )
        if o.failures:
            out.append(BenchRecord("fleet", f"{case}: failed requests", "requests", o.failures))
    return out
