"""One vLLM engine, one scenario: ``python -m engine_kit SPEC OUT`` (``tests/kits`` on the path).

A scenario runs in a process of its own (vLLM's engine owns process-wide state: its
distributed group, its thread binding, its signal handlers), so the e2e tests and
``kvtier bench e2e`` start one process per engine and read back one JSON document. The
parent sets the environment vLLM reads at import (`launch.engine_env`).

The spec (JSON):

- ``model``: the model directory; ``engine``: keyword arguments of vLLM's ``LLM`` (``dtype``,
  ``max_model_len``, ``num_gpu_blocks_override``, ``tensor_parallel_size``, ...);
- ``kv_transfer_config``: a dict for vLLM's ``KVTransferConfig``, or null for no connector;
- ``ops``: what to do, in order, each a dict with ``op``:

  - ``generate``: ``prompts`` (lists of token ids), ``max_tokens``, optional ``ignore_eos``;
    greedy. Its result: ``token_ids`` and ``num_cached_tokens`` per prompt, ``seconds``;
  - ``reset``: ``llm.reset_prefix_cache(reset_connector=...)`` (``connector``: bool);
    its result ``ok``;
  - ``settle``: (in-process engine only) step the engine while its scheduler has work,
    the connector's included (a cascade not yet applied), ``timeout_s`` at most; its
    result ``settled``;
  - ``metrics``: vLLM's own metrics now (``llm.get_metrics()``: counters and gauges by
    name, histograms as ``name:count`` and ``name:sum``);

  any op may carry ``"metrics": true`` to add that snapshot to its result, and a ``name``
  or ``label`` that its result repeats.

Without ``ops`` the engine is interactive (`launch.EngineProcess`): it answers
``{"ready": true, ...}`` once started, then reads one op a line from its standard input and
answers each with its result, on its standard output behind `ANSWER`, until ``{"op":
"exit"}`` or the end of its input; several engines can then be driven in turns, their
measurements interleaved.

Every op's result has ``op`` and ``seconds``. At the end the engine is shut down
explicitly (the connector's shutdown hands its last cascades to the tiers), and ``OUT``
gets ``{"results": [...], "startup_s": ...}``. An exception is written as ``{"error":
...}`` and the process exits 1.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

__all__ = ["main"]


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, int | float):
            out[metric.name] = out.get(metric.name, 0) + value
            continue
        count = getattr(metric, "count", None)
        if count is not None:  # a histogram
            out[f"{metric.name}:count"] = out.get(f"{metric.name}:count", 0) + count
            out[f"{metric.name}:sum"] = out.get(f"{metric.name}:sum", 0) + metric.sum
    return out


def _generate(llm: Any, op: Mapping[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=int(op["max_tokens"]), ignore_eos=bool(op.get("ignore_eos"))
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in op["prompts"]]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outputs],
    }


def _settle(llm: Any, timeout_s: float) -> bool:
    """Step an in-process engine while its scheduler has work (a connector's included)."""
    core = llm.llm_engine.engine_core.engine_core  # vLLM's InprocClient -> EngineCore
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            return False
        core.step_fn()
        time.sleep(0.001)  # the tier threads' turn: this is a poll, not a timed race
    return True


def _run(spec: Mapping[str, Any]) -> dict[str, Any]:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    engine = dict(spec.get("engine") or {})
    transfer = spec.get("kv_transfer_config")
    if transfer is not None:
        engine["kv_transfer_config"] = KVTransferConfig(**transfer)
    events = spec.get("kv_events_config")
    if events is not None:
        from vllm.config import KVEventsConfig

        engine["kv_events_config"] = KVEventsConfig(**events)
    started = time.perf_counter()
    llm = LLM(model=spec["model"], disable_log_stats=False, **engine)
    startup_s = time.perf_counter() - started
    results: list[dict[str, Any]] = []
    try:
        if spec.get("ops") is None:  # interactive: ops come one line at a time
            _answer({"ready": True, "startup_s": startup_s})
            for line in sys.stdin:
                op = json.loads(line)
                if op["op"] == "exit":
                    break
                _answer(_do(llm, op, len(results)))
        else:
            for op in spec["ops"]:
                results.append(_do(llm, op, len(results)))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"results": results, "startup_s": startup_s}


#: The prefix of the lines that carry an interactive engine's answers on its standard
#: output (vLLM logs there too).
ANSWER = "KVTIER-ENGINE-ANSWER "


def _answer(document: Mapping[str, Any]) -> None:
    sys.stdout.write(ANSWER + json.dumps(document) + "\n")
    sys.stdout.flush()


def _do(llm: Any, op: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Run one op; its result (see the module docstring)."""
    began = time.perf_counter()
    kind = op["op"]
    if kind == "generate":
        result = _generate(llm, op)
    elif kind == "reset":
        result = {"ok": bool(llm.reset_prefix_cache(reset_connector=op["connector"]))}
    elif kind == "settle":
        result = {"settled": _settle(llm, float(op.get("timeout_s", 30.0)))}
    elif kind == "metrics":
        result = {}
    else:
        raise ValueError(f"ops[{index}].op: unknown op {kind!r}")
    result.setdefault("seconds", time.perf_counter() - began)
    result["op"] = kind
    for echoed in ("name", "label"):  # the caller's tags, back with the result
        if echoed in op:
            result[echoed] = op[echoed]
    if op.get("metrics") or kind == "metrics":
        result["metrics"] = _metrics(llm)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m engine_kit SPEC.json OUT.json")
        return 2
    spec_path, out_path = args
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        document = _run(spec)
        code = 0
    except Exception as exc:
        traceback.print_exc()
        document = {"error": f"{type(exc).__name__}: {exc}"}
        code = 1
    with open(out_path, "w") as f:
        json.dump(document, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
