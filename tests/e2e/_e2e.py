"""Constants and helpers of the e2e suite (fixtures: `conftest`)."""

from __future__ import annotations

from typing import Any

from kvtier_async.tiny_model import prompt_ids

BLOCK_TOKENS = 128  # vLLM's CPU backend's block size, set explicitly
PROMPT_TOKENS = 600  # 4 full blocks and a partial one: 512 tokens can come from a cache
CACHED = (PROMPT_TOKENS - 1) // BLOCK_TOKENS * BLOCK_TOKENS
# What one GPU block of the tiny model holds: K and V of every layer and KV head, float32.
BLOCK_BYTES = BLOCK_TOKENS * 4 * 2 * 2 * 64 * 4

PROMPTS = {  # name -> (prompts, max_tokens)
    "P": (prompt_ids(4, PROMPT_TOKENS, seed=1), 16),
    "F": (prompt_ids(3, PROMPT_TOKENS, seed=2), 16),  # stored by the fs engine only
    "O": (prompt_ids(3, PROMPT_TOKENS, seed=3), 16),  # stored by the obj engine only
    "Q": (prompt_ids(6, PROMPT_TOKENS, seed=4), 200),  # under preemption
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 4096,
    "block_size": BLOCK_TOKENS,
    "enforce_eager": True,
    "seed": 0,
}


def generate(name: str, *, metrics: bool = True, **extra: Any) -> dict[str, Any]:
    prompts, max_tokens = PROMPTS[name]
    op = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "ignore_eos": True}
    return {**op, "metrics": metrics, "name": name, **extra}


def connector(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` for our connector with ``extra`` as its extra config."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier_async.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20, **extra},
    }


def delta(results: list[dict[str, Any]], index: int, name: str) -> float:
    """How much vLLM's metric ``name`` grew during op ``index`` (from the last snapshot)."""
    now = results[index]["metrics"].get(name, 0.0)
    before = next(
        (r["metrics"].get(name, 0.0) for r in reversed(results[:index]) if "metrics" in r), 0.0
    )
    return float(now - before)
