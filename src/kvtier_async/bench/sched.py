"""Benchmark ``sched``: what a KV connector adds to vLLM's scheduler step, ours against vLLM's.

vLLM 0.33's real v1 scheduler (`AsyncScheduler`, vLLM's default) runs one seeded trace in
`VllmHarness` three ways in one process: with no connector, with vLLM's own
``OffloadingConnector`` (``CPUOffloadingSpec``; its worker role on `FakeOffloadingWorker`),
and with ours (``KVTierConnector``, loaded through ``kv_connector_module_path`` like any
connector), both with the same ``kv_connector_extra_config``: the same CPU tier in bytes.

The trace: a few hundred requests over a few dozen shared documents of 64-512 tokens with
Zipf popularity; a request is at least half of a document plus a suffix of its own, arrives
`ARRIVALS_PER_STEP` per engine step and samples 4-32 tokens. The GPU holds `GPU_BLOCKS`
blocks, fewer than the documents need, so its prefix cache evicts; the CPU tier holds half
of the trace's distinct prompt blocks, so the offloading tier evicts too.

Only ``schedule()`` and ``update_from_output()`` are timed, not the fake model or workers.
The configurations alternate within each repetition (rotating who goes first). Other load on
the machine only ever adds time, so a mean step time keeps each step's best time over the
`REPEATS` repetitions (the step sequence repeats exactly; otherwise the best repetition's
mean). An added time is that of the connector minus that of no connector, floored at 0.1%
of the latter. Each run is checked: every request samples the same tokens as without a
connector (the fake model verifies loaded KV bytes on admission), and no block or request
is left over.

Records: the step time each connector adds (latency, ours vs vLLM's, target 2.0: ours at
most half of vLLM's), the tokens it supplied as external prefix-cache hits (the scheduler's
own connector stats, first admissions and resumptions; the median over the repetitions;
target 1.0), and the step time with the connector (no target). Without vLLM the benchmark
returns no records; without our connector it reports vLLM's figures as progress notes only.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import random
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .report import BenchRecord, latency_record, throughput_record

__all__ = [
    "ARRIVALS_PER_STEP",
    "GPU_BLOCKS",
    "OUR_CONNECTOR",
    "REPEATS",
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
# Where our connector lives: the first of these modules that defines it is used.
OUR_CONNECTOR = ("KVTierConnector", ("kvtier_async.vllm", "kvtier_async.integrations.vllm"))
VLLM_CONNECTOR = "OffloadingConnector"
VLLM_NAME = "vllm-0.33 OffloadingConnector (CPUOffloadingSpec)"
_FLOOR = 1e-3  # added time floor, as a fraction of the no-connector step time


@dataclass(frozen=True)
class SchedTrace:
    """``requests``: ``(req_id, prompt, max_tokens)`` in arrival order."""

    requests: list[tuple[str, list[int], int]]
    unique_prompt_blocks: int

    @property
    def cpu_blocks(self) -> int:
        return max(16, self.unique_prompt_blocks // 2)


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
    outputs: Mapping[str, list[int]]


@dataclass(frozen=True)
class _Side:
    name: str
    kwargs: Mapping[str, Any]


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Run the trace with no connector, vLLM's and ours; see the module docstring."""
    say = progress or (lambda _msg: None)
    if importlib.util.find_spec("vllm") is None:
        say("sched: vLLM is not installed; nothing to measure")
        return []
    _quiet_vllm()
    trace = make_trace(QUICK_REQUESTS if quick else NUM_REQUESTS)
    repeats = 1 if quick else REPEATS
    sim = importlib.import_module("kvtier_async.testing.vllm_sim")
    extra = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": trace.cpu_blocks * BLOCK_BYTES}
    sides = [
        _Side("none", {}),
        _Side("vllm", {"connector": VLLM_CONNECTOR, "extra_config": extra}),
    ]
    ours = _find_ours()
    if ours is None:
        say(f"sched: ours skipped: no {OUR_CONNECTOR[0]} in {' or '.join(OUR_CONNECTOR[1])}")
    else:
        say(f"sched: ours is {ours}:{OUR_CONNECTOR[0]}")
        sides.append(
            _Side(
                "ours",
                {
                    "connector": OUR_CONNECTOR[0],
                    "connector_module_path": ours,
                    "extra_config": extra,
                },
            )
        )
    say(
        f"sched: {len(trace.requests)} requests, {trace.unique_prompt_blocks} distinct prompt "
        f"blocks, GPU {GPU_BLOCKS} blocks, CPU tier {trace.cpu_blocks} blocks "
        f"({extra['cpu_bytes_to_use']} bytes)"
    )
    _one(sim, sides[0], _trace_slice(trace, 20))  # warm vLLM's lazy imports up, untimed
    runs: dict[str, list[_Run]] = {side.name: [] for side in sides}
    for rep in range(repeats):
        order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
        for side in order:
            say(f"sched: repetition {rep + 1}/{repeats}: {side.name}")
            runs[side.name].append(_one(sim, side, trace))
    _check_outputs(runs)
    return _records(runs, len(trace.requests), say)


def _one(sim: Any, side: _Side, trace: SchedTrace) -> _Run:
    """One fresh harness through the whole trace; checks it finished clean."""
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
        **side.kwargs,
    )
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
        return _Run(stats.step_seconds, stats.steps, stats.external_hit_tokens, stats.outputs)


def _check_outputs(runs: Mapping[str, Sequence[_Run]]) -> None:
    """Every run sampled what the no-connector run sampled (the model is deterministic)."""
    reference = runs["none"][0].outputs
    for name, side_runs in runs.items():
        for side_run in side_runs:
            if side_run.outputs != reference:
                bad = sorted(k for k in reference if side_run.outputs.get(k) != reference[k])
                raise AssertionError(f"sched: {name} sampled other tokens for {bad[:5]}")


def _records(
    runs: Mapping[str, Sequence[_Run]], num_requests: int, say: Callable[[str], None]
) -> list[BenchRecord]:
    def step(name: str) -> float:
        return _mean_step(runs[name])

    none = step("none")

    def added(name: str) -> float:
        return max(none * _FLOOR, step(name) - none)

    def hits(name: str) -> int:  # ours may vary between runs: its stores complete in threads
        return int(statistics.median_low(r.hit_tokens for r in runs[name]))

    vllm_added, vllm_hits = added("vllm"), hits("vllm")
    say(
        f"sched: no connector {none * 1e6:.1f} us/step ({runs['none'][0].steps} steps); "
        f"vLLM {step('vllm') * 1e6:.1f} us/step, +{vllm_added * 1e6:.1f} us, "
        f"{vllm_hits} external hit tokens ({runs['vllm'][0].steps} steps)"
    )
    if "ours" not in runs:
        return []
    ours_added, ours_hits = added("ours"), hits("ours")
    say(
        f"sched: ours {step('ours') * 1e6:.1f} us/step, +{ours_added * 1e6:.1f} us, "
        f"{ours_hits} external hit tokens ({runs['ours'][0].steps} steps)"
    )
    case = f"{num_requests} requests"
    return [
        latency_record(
            "sched",
            case,
            "added step time",
            ours_added * 1e6,
            reference=vllm_added * 1e6,
            reference_name=VLLM_NAME,
            target=ADDED_TIME_TARGET,
            unit="us",
        ),
        throughput_record(
            "sched",
            case,
            "external hit tokens",
            float(ours_hits),
            reference=float(vllm_hits),
            reference_name=VLLM_NAME,
            target=HIT_TARGET,
            unit="tok",
        ),
        latency_record(
            "sched",
            case,
            "step time",
            step("ours") * 1e6,
            reference=step("vllm") * 1e6,
            reference_name=VLLM_NAME,
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
