"""Benchmark ``sched``: what a KV connector adds to vLLM's scheduler step, ours against vLLM's.

vLLM 0.33's real v1 scheduler (`AsyncScheduler`, vLLM's default) runs one seeded trace in
`VllmHarness` (the connector harness, a test kit: ``tests/kits/vllm_kit`` of a source
checkout, found through `kits`) in one process: with no connector, and per case with vLLM's own
``OffloadingConnector`` and with ours (``KVTierConnector``, loaded through
``kv_connector_module_path`` like any connector), both given the same
``kv_connector_extra_config``.

Cases, each with its own rows: the CPU tier's eviction policy (``lru``, ``arc``) times the
tiers: ``cpu`` (``CPUOffloadingSpec``: the CPU tier alone) and ``fs``
(``TieringOffloadingSpec``: the same CPU tier plus a file-system tier, vLLM's own
``FileSystemTierManager`` for vLLM and ours for ours, each in a fresh directory of the same
temporary file system, with their default I/O thread counts). A block the CPU tier evicted
comes back from the files through a promotion, and counts as a hit when the scheduler
admits it. Our scheduler role always runs its tier engine (`ThreadedEngine`), with or
without tiers, so its per-step cost is in every figure; vLLM's ``fs`` case runs its tier
threads and poll thread likewise.

A fair harness. vLLM's worker role runs on `FakeOffloadingWorker`, which reports a job one
step after the step that submitted it (``offload_delay_steps=1``; vLLM submits a store at
the start of the step after it decided it, so it is reported two steps after the decision).
Ours copies inline when it submits (CPU tensors), so the harness holds its worker's output
back one step (``worker_report_delay_steps=1``): both report every store and load in the
same step (a differential test in ``tests/test_vllm_connector.py`` checks it), so neither
gets its blocks loadable earlier. Only ``schedule()`` and ``update_from_output()`` are
timed, for both; the fake model and the worker roles (theirs copy bytes in the same process)
are not.

The trace: a few hundred requests over a few dozen shared documents of 64-512 tokens with
Zipf popularity; a request is at least half of a document plus a suffix of its own, arrives
`ARRIVALS_PER_STEP` per engine step and samples 4-32 tokens. The GPU holds `GPU_BLOCKS`
blocks, fewer than the documents need, so its prefix cache evicts and documents come back
later; the CPU tier holds half of the trace's distinct prompt blocks, so it evicts too.
Requests thus mix GPU-local hits, external hits (CPU tier or, with ``fs``, promoted from the
files) and misses; the mix is printed per run.

The fake model's torch operations run on one thread (restored afterwards): torch's
intra-op pool keeps its threads spinning after each operation, and on a small machine they
took the CPU from the timed scheduler code, for every connector alike (noise, not cost).
The configurations alternate within each repetition (rotating who goes first). Other load
on the machine only ever adds time, so a mean step time keeps each step's best time over the
`REPEATS` repetitions (the step sequence repeats exactly; otherwise the best repetition's
mean). An added time is that of the connector minus that of no connector, floored at 0.1%
of the latter. Each run is checked: every request samples the same tokens as without a
connector (the fake model verifies loaded KV bytes on admission), and no block or request
is left over.

One more case, ``lru cpu worker-threads``: ours with its worker role copying on its own threads
(``worker_copies: "engine"``, what it does beside a GPU's KV cache) in the scheduler's process,
as vLLM runs the worker with one GPU, against vLLM's ``lru cpu`` run; its threads run while the
scheduler steps, so what they cost the scheduler thread (wake-ups, the GIL) is in its figure.

Records, per case: the step time each connector adds (latency, ours vs vLLM's, target 2.0:
ours at most half of vLLM's; for ``lru cpu worker-threads`` at most 0.7x of vLLM's), the
tokens it supplied as external prefix-cache hits (the scheduler's own connector stats, first
admissions and resumptions; the median over the repetitions; target 1.0), and the step time
with the connector (no target). A ``quick`` run (one short repetition) cannot support a
verdict: its records carry no ``meets``. Without
vLLM the benchmark returns no records; without our connector it reports vLLM's figures as
progress notes only.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.util
import os
import random
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import kits
from .report import BenchRecord, latency_record, throughput_record

__all__ = [
    "ARRIVALS_PER_STEP",
    "CASES",
    "GPU_BLOCKS",
    "OUR_CONNECTOR",
    "REPEATS",
    "THREADS_CASE",
    "SchedTrace",
    "make_trace",
    "run",
]

BLOCK_TOKENS = 16
GPU_BLOCKS = 256
# The tiny model's KV shapes (the harness's defaults): 2 layers x 2 KV heads x 16 (K and V).
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 2, 2, 16
BLOCK_BYTES = NUM_LAYERS * NUM_KV_HEADS * BLOCK_TOKENS * 2 * HEAD_SIZE * 2  # float16
ARRIVALS_PER_STEP = 2
REPEATS = 5
NUM_REQUESTS = 300
QUICK_REQUESTS = 60
ADDED_TIME_TARGET = 2.0
HIT_TARGET = 1.0
POLICIES = ("lru", "arc")
TIERS = ("cpu", "fs")
CASES = tuple(f"{policy} {tiers}" for policy in POLICIES for tiers in TIERS)
#: Our worker role copying on its own threads (``worker_copies: "engine"``), as on a GPU, in
#: the scheduler's process, as vLLM runs it with one GPU (``UniProcExecutor``); measured
#: against vLLM's ``lru cpu`` run. Target: our added step time at most 0.7x vLLM's.
THREADS_CASE = "lru cpu worker-threads"
THREADS_TARGET = 1 / 0.7
REPORT_DELAY_STEPS = 1  # both workers report a job this many steps after submitting it
# Where our connector lives: the first of these modules that defines it is used.
OUR_CONNECTOR = ("KVTierConnector", ("kvtier_async.vllm", "kvtier_async.integrations.vllm"))
VLLM_CONNECTOR = "OffloadingConnector"
VLLM_NAME = "vllm-0.33 OffloadingConnector"
_FLOOR = 1e-3  # added time floor, as a fraction of the no-connector step time


@dataclass(frozen=True)
class SchedTrace:
    """``requests``: ``(req_id, prompt, max_tokens)`` in arrival order."""

    requests: list[tuple[str, list[int], int]]
    unique_prompt_blocks: int

    @property
    def cpu_blocks(self) -> int:
        return max(16, self.unique_prompt_blocks // 2)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for _, prompt, _ in self.requests)


def make_trace(
    num_requests: int = NUM_REQUESTS, num_docs: int = 24, seed: int = 0, zipf_s: float = 1.0
) -> SchedTrace:
    """The seeded trace (token ids in 3..999, clear of the tiny model's special ids)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 1000) for _ in range(rng.randint(64, 512))] for _ in range(num_docs)]
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(num_docs)]
    requests = []
    for i in range(num_requests):
        doc = docs[rng.choices(range(num_docs), weights)[0]]
        prompt = doc[: rng.randint(len(doc) // 2, len(doc))]
        prompt += [rng.randrange(3, 1000) for _ in range(rng.randint(8, 64))]
        requests.append((f"req-{i}", prompt, rng.randint(4, 32)))
    unique = {
        tuple(prompt[:end])
        for _, prompt, _ in requests
        for end in range(BLOCK_TOKENS, len(prompt) + 1, BLOCK_TOKENS)
    }
    return SchedTrace(requests, len(unique))


@dataclass(frozen=True)
class _Run:
    step_s: list[float]  # scheduler seconds of each engine step
    steps: int  # schedule() calls
    hit_tokens: int
    local_tokens: int
    preemptions: int
    outputs: Mapping[str, list[int]]


@dataclass(frozen=True)
class _Side:
    name: str  # "none", or "<connector> <case>"
    kwargs: Mapping[str, Any]
    fs_tier: dict[str, Any] | None = None  # the case's fs tier, without its root_dir


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Run the trace with no connector, and vLLM's and ours per case; see the docstring."""
    say = progress or (lambda _msg: None)
    if importlib.util.find_spec("vllm") is None:
        say("sched: vLLM is not installed; nothing to measure")
        return []
    _quiet_vllm()  # before the kit imports vLLM
    try:
        sim = kits.load("vllm_kit")
    except kits.KitMissingError as exc:
        say(f"sched: {exc}; nothing measured")
        return []
    trace = make_trace(QUICK_REQUESTS if quick else NUM_REQUESTS)
    repeats = 1 if quick else REPEATS
    ours = _find_ours()
    if ours is None:
        say(f"sched: ours skipped: no {OUR_CONNECTOR[0]} in {' or '.join(OUR_CONNECTOR[1])}")
    else:
        say(f"sched: ours is {ours}:{OUR_CONNECTOR[0]}")
    sides = _sides(trace, ours)
    say(
        f"sched: {len(trace.requests)} requests, {trace.prompt_tokens} prompt tokens, "
        f"{trace.unique_prompt_blocks} distinct prompt blocks, GPU {GPU_BLOCKS} blocks, "
        f"CPU tier {trace.cpu_blocks} blocks ({trace.cpu_blocks * BLOCK_BYTES} bytes)"
    )
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _one(sim, sides[0], _trace_slice(trace, 20))  # warm vLLM's lazy imports up, untimed
        runs = _repetitions(sim, sides, trace, repeats, say)
    finally:
        torch.set_num_threads(threads)
    _check_outputs(runs)
    return _records(runs, quick, say)


def _repetitions(
    sim: Any, sides: list[_Side], trace: SchedTrace, repeats: int, say: Callable[[str], None]
) -> dict[str, list[_Run]]:
    runs: dict[str, list[_Run]] = {side.name: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sched-") as root:
        for rep in range(repeats):
            order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
            for side in order:
                say(f"sched: repetition {rep + 1}/{repeats}: {side.name}")
                result = _one(sim, side, trace, root)
                runs[side.name].append(result)
                say(f"sched: {side.name}: {_mix(result, trace)}")
    return runs


def _sides(trace: SchedTrace, ours: str | None) -> list[_Side]:
    sides = [_Side("none", {})]
    for case in CASES:
        policy, tiers = case.split()
        extra: dict[str, Any] = {
            "spec_name": "CPUOffloadingSpec",
            "cpu_bytes_to_use": trace.cpu_blocks * BLOCK_BYTES,
            "eviction_policy": policy,
        }
        fs = None
        if tiers == "fs":
            extra["spec_name"] = "TieringOffloadingSpec"
            fs = {"type": "fs"}
        sides.append(
            _Side(f"vllm {case}", {"connector": VLLM_CONNECTOR, "extra_config": extra}, fs)
        )
        if ours is not None:
            kwargs = {
                "connector": OUR_CONNECTOR[0],
                "connector_module_path": ours,
                "extra_config": extra,
                "worker_report_delay_steps": REPORT_DELAY_STEPS,
            }
            sides.append(_Side(f"ours {case}", kwargs, fs))
    if ours is not None:
        lru_cpu = next(side for side in sides if side.name == "ours lru cpu")
        extra = {**lru_cpu.kwargs["extra_config"], "worker_copies": "engine"}
        sides.append(_Side(f"ours {THREADS_CASE}", {**lru_cpu.kwargs, "extra_config": extra}))
    return sides


def _one(sim: Any, side: _Side, trace: SchedTrace, root: str | None = None) -> _Run:
    """One fresh harness through the whole trace (a fresh fs root); checks it ended clean."""
    kwargs = dict(side.kwargs)
    directory = None
    if side.fs_tier is not None:
        assert root is not None
        directory = tempfile.mkdtemp(dir=root)
        extra = dict(kwargs["extra_config"])
        extra["secondary_tiers"] = [{**side.fs_tier, "root_dir": directory}]
        kwargs["extra_config"] = extra
    harness = sim.VllmHarness(
        num_gpu_blocks=GPU_BLOCKS,
        block_size=BLOCK_TOKENS,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        max_num_batched_tokens=1024,
        max_num_seqs=32,
        async_scheduling=True,
        verify="admission",
        offload_delay_steps=REPORT_DELAY_STEPS,
        **kwargs,
    )
    try:
        with harness:
            gc.collect()
            gc.disable()
            try:
                harness.drive(trace.requests, per_step=ARRIVALS_PER_STEP)
            finally:
                gc.enable()
            problems = harness.leaks()
            if problems:
                raise AssertionError(f"sched: {side.name} left {'; '.join(problems)}")
            stats = harness.stats
            if stats.finished != len(trace.requests):
                raise AssertionError(
                    f"sched: {side.name} finished {stats.finished} of {len(trace.requests)}"
                )
            return _Run(
                stats.step_seconds,
                stats.steps,
                stats.external_hit_tokens,
                stats.local_hit_tokens,
                stats.preemptions,
                stats.outputs,
            )
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _mix(result: _Run, trace: SchedTrace) -> str:
    """Where prompt tokens came from: the GPU prefix cache, the connector, computed."""
    total = trace.prompt_tokens
    computed = max(0, total - result.local_tokens - result.hit_tokens)
    return (
        f"prompt tokens {total}: GPU-local hits {result.local_tokens} "
        f"({result.local_tokens / total:.0%}), external hits {result.hit_tokens} "
        f"({result.hit_tokens / total:.0%}), computed {computed} ({computed / total:.0%}); "
        f"{result.preemptions} preemptions (their resumed hits count too), "
        f"{result.steps} steps"
    )


def _check_outputs(runs: Mapping[str, Sequence[_Run]]) -> None:
    """Every run sampled what the no-connector run sampled (the model is deterministic)."""
    reference = runs["none"][0].outputs
    for name, side_runs in runs.items():
        for side_run in side_runs:
            if side_run.outputs != reference:
                bad = sorted(k for k in reference if side_run.outputs.get(k) != reference[k])
                raise AssertionError(f"sched: {name} sampled other tokens for {bad[:5]}")


def _records(
    runs: Mapping[str, Sequence[_Run]], quick: bool, say: Callable[[str], None]
) -> list[BenchRecord]:
    none = _mean_step(runs["none"])
    say(f"sched: no connector {none * 1e6:.1f} us/step ({runs['none'][0].steps} steps)")
    records: list[BenchRecord] = []
    for case in CASES:
        vllm = _Figures.of(runs[f"vllm {case}"], none)
        say(f"sched: {case}: vLLM {vllm.describe()}")
        if f"ours {case}" not in runs:
            continue
        ours = _Figures.of(runs[f"ours {case}"], none)
        say(f"sched: {case}: ours {ours.describe()}")
        records += _case_records(case, ours, vllm)
    if f"ours {THREADS_CASE}" in runs:
        vllm = _Figures.of(runs["vllm lru cpu"], none)
        ours = _Figures.of(runs[f"ours {THREADS_CASE}"], none)
        say(f"sched: {THREADS_CASE}: ours {ours.describe()}")
        records += _case_records(THREADS_CASE, ours, vllm, target=THREADS_TARGET)
    if quick:  # one short repetition: figures, no verdict
        records = [dataclasses.replace(record, meets=None) for record in records]
    return records


@dataclass(frozen=True)
class _Figures:
    step_s: float
    added_s: float
    hits: int
    steps: int

    @classmethod
    def of(cls, runs: Sequence[_Run], none_s: float) -> _Figures:
        step = _mean_step(runs)
        # Hits may vary between runs where tier I/O completes in threads: the median.
        hits = int(statistics.median_low(r.hit_tokens for r in runs))
        return cls(step, max(none_s * _FLOOR, step - none_s), hits, runs[0].steps)

    def describe(self) -> str:
        return (
            f"{self.step_s * 1e6:.1f} us/step, +{self.added_s * 1e6:.1f} us, "
            f"{self.hits} external hit tokens ({self.steps} steps)"
        )


def _case_records(
    case: str, ours: _Figures, vllm: _Figures, *, target: float = ADDED_TIME_TARGET
) -> list[BenchRecord]:
    spec = "TieringOffloadingSpec + fs" if case.endswith("fs") else "CPUOffloadingSpec"
    name = f"{VLLM_NAME} ({spec}, {case.split()[0]})"
    return [
        latency_record(
            "sched",
            case,
            "added step time",
            ours.added_s * 1e6,
            reference=vllm.added_s * 1e6,
            reference_name=name,
            target=target,
            unit="us",
        ),
        throughput_record(
            "sched",
            case,
            "external hit tokens",
            float(ours.hits),
            reference=float(vllm.hits),
            reference_name=name,
            target=HIT_TARGET,
            unit="tok",
        ),
        latency_record(
            "sched",
            case,
            "step time",
            ours.step_s * 1e6,
            reference=vllm.step_s * 1e6,
            reference_name=name,
            unit="us",
        ),
    ]


def _mean_step(runs: Sequence[_Run]) -> float:
    """Mean scheduler seconds per step, robust to other load on the machine: when every run
    took the same steps (the scheduler is deterministic), the best time of each step over the
    runs, summed; otherwise the best run's sum. Divided by the ``schedule()`` calls."""
    if len({len(r.step_s) for r in runs}) == 1 and len({r.steps for r in runs}) == 1:
        best: list[float] = [min(times) for times in zip(*(r.step_s for r in runs), strict=True)]
        return sum(best) / runs[0].steps
    return min(sum(r.step_s) / r.steps for r in runs)


def _find_ours() -> str | None:
    """The first module of `OUR_CONNECTOR` that defines the connector class."""
    name, modules = OUR_CONNECTOR
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return module_name
    return None


def _trace_slice(trace: SchedTrace, n: int) -> SchedTrace:
    return SchedTrace(trace.requests[:n], trace.unique_prompt_blocks)


def _quiet_vllm() -> None:
    """vLLM logs INFO lines to stdout by default, which would mix into ``--json`` output."""
    if "vllm" in sys.modules:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
