"""Where a tier hit's first token goes, traced through one whole vLLM engine.

A trace, not a benchmark (issue 40 item 1): one engine in this process (vLLM's CPU build, the
tiny model, ``kvtier_async.bench.e2e``'s engine settings), with every KV-connector hook,
vLLM's ``Scheduler.schedule`` / ``update_from_output`` and ``EngineCore.step`` wrapped in a
timer. For ``--prompts`` prompts of ``TOKENS`` tokens it computes each prompt, then times
vLLM's own prefix-cache hit (the same prompt again) and, with the connector, the CPU tier's
hit after vLLM's prefix cache was reset, and with ``--fs`` (or ``--obj``: ``rclone serve s3``
on 127.0.0.1, started here) that tier's hit after our CPU tier was cleared as well; per case
the median first token and, with ``--hooks``, the median time and calls of each hook within
it (``step``: the engine's steps, each a round trip of the scheduler's hooks; ``(fs lookup
jobs)`` and ``(fs promotion jobs)``, or obj's: the tier's job run time in the case, from its
counters). The first prompt is a warm-up.

``--connector none`` runs the engine without our connector: its prefix-cache hit is the floor
`kvtier bench e2e` compares with. The two modes run in separate processes one after the
other, not interleaved: compare them over repeated runs.

Run in the e2e environment (``nox -s e2e`` builds it)::

    .nox/e2e/bin/python tools/trace_hit.py 2048 --connector none
    .nox/e2e/bin/python tools/trace_hit.py 2048 --hooks
    .nox/e2e/bin/python tools/trace_hit.py 2048 --hooks --fs
    .nox/e2e/bin/python tools/trace_hit.py 2048 --hooks --obj
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The engine in this process, offline, with a small CPU KV cache (as the e2e kit runs it).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "clear_connector_metadata",
    "get_kv_connector_stats",
    "take_events",
)

spent: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


def timed(cls: type, name: str) -> None:
    """Wrap ``cls.name`` so that each call adds its time to ``spent[name]``."""
    original: Callable[..., Any] = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started
            calls[name] += 1

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, nargs="?", default=2048, help="prompt length")
    parser.add_argument("--prompts", type=int, default=8, help="prompts, the first a warm-up")
    parser.add_argument("--connector", choices=("kvtier", "none"), default="kvtier")
    parser.add_argument("--hooks", action="store_true", help="show each hook's median time")
    second = parser.add_mutually_exclusive_group()
    second.add_argument(
        "--fs", action="store_true", help="also our fs tier's hit (the CPU tier cleared first)"
    )
    second.add_argument(
        "--obj", action="store_true", help="also our obj tier's hit, on rclone serve s3"
    )
    args = parser.parse_args()
    if args.tokens < 256 or args.prompts < 2:
        parser.error("tokens: at least 256; --prompts: at least 2 (the first is a warm-up)")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from kvtier_async.bench import e2e
    from kvtier_async.integrations.vllm.connector import KVTierConnector
    from kvtier_async.tiny_model import build_tiny_model, prompt_ids

    for name in HOOKS:
        timed(KVTierConnector, name)
    for name in ("schedule", "update_from_output"):
        timed(Scheduler, name)
    timed(EngineCore, "step")

    tier_name = "obj" if args.obj else "fs"
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-trace-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        model = str(build_tiny_model(Path(tmp) / "model"))
        engine: dict[str, Any] = dict(e2e.ENGINE)
        if args.connector == "kvtier":
            tier = {"type": "fs", "root_dir": str(Path(tmp) / "fs")}
            if args.obj:
                from kvtier_async.bench.rclone import RcloneS3Server

                tier = stack.enter_context(RcloneS3Server("kvtier-trace")).tier_config()
            config = e2e._connector(tier)["kv_transfer_config"]
            engine["kv_transfer_config"] = KVTransferConfig(**config)
        llm = LLM(model=model, disable_log_stats=False, **engine)
        core = llm.llm_engine.engine_core.engine_core
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def settle() -> None:  # the connector's stores finish before the next case
            deadline = time.monotonic() + 60
            while core.scheduler.has_requests() and time.monotonic() < deadline:
                core.step_fn()
                time.sleep(0.001)

        # The second tier's counters (`kvtier_async.ledger.TierCounters`): its lanes' run time.
        second = (
            core.scheduler.connector.scheduler.tiers[0]
            if (args.fs or args.obj) and args.connector == "kvtier"
            else None
        )

        def first_token(prompt: list[int]) -> tuple[float, dict[str, float], dict[str, int]]:
            spent.clear()
            calls.clear()
            was = second.counters.copy() if second is not None else None
            started = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            took = time.perf_counter() - started
            if second is not None and was is not None:
                spent[f"({tier_name} lookup jobs)"] = (
                    second.counters.lookup_seconds - was.lookup_seconds
                )
                spent[f"({tier_name} promotion jobs)"] = (
                    second.counters.read_seconds - was.read_seconds
                )
            return took, dict(spent), dict(calls)

        cases: dict[str, list[tuple[float, dict[str, float], dict[str, int]]]] = {}
        for prompt in prompt_ids(args.prompts, args.tokens, seed=args.tokens):
            first_token(prompt)
            settle()
            cases.setdefault(f"vLLM's prefix-cache hit ({args.connector})", []).append(
                first_token(prompt)
            )
            llm.reset_prefix_cache(reset_connector=False)
            if args.connector == "kvtier":
                cases.setdefault("our CPU tier's hit", []).append(first_token(prompt))
                settle()
                llm.reset_prefix_cache(reset_connector=second is not None)
                if second is not None:  # our CPU tier cleared too: the blocks come from the tier
                    cases.setdefault(f"our {tier_name} tier's hit", []).append(first_token(prompt))
                    settle()
                    llm.reset_prefix_cache(reset_connector=True)
        llm.llm_engine.engine_core.shutdown()

    for case, runs in cases.items():
        runs = runs[1:]  # the warm-up
        median = statistics.median(run[0] for run in runs)
        print(f"{args.tokens} tokens, {case}: {median * 1e3:.2f} ms (median of {len(runs)})")
        if args.hooks:
            for name in sorted({name for run in runs for name in run[1]}):
                took = statistics.median(run[1].get(name, 0.0) for run in runs)
                count = statistics.median(run[2].get(name, 0) for run in runs)
                # a name in brackets is a job's time, not a hook's: it has no calls
                calls_ = "" if name.startswith("(") else f"  x{count:g}"
                print(f"    {name:32s} {took * 1e3:7.3f} ms{calls_}")


if __name__ == "__main__":
    main()
