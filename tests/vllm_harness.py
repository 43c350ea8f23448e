"""Helpers for tests that run vLLM 0.33's real scheduler with a KV connector (no tests here).

The harness itself is the connector test kit, `vllm_kit` (``tests/kits/vllm_kit``; the
``sched`` benchmark uses it too). This module adds what tests share, connector presets and prompt
builders, and re-exports the harness's names lazily: importing this module does not import
vLLM (which takes seconds); the first use of a harness name does, through `load`.

    import vllm_harness as vh

    with vh.VllmHarness(**vh.VLLM_OFFLOADING, num_gpu_blocks=64) as h:
        h.add_request("a", prompt, max_tokens=4)
        h.run_until_done()
        h.assert_no_leaks()
"""

from __future__ import annotations

import importlib
import random
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_kit import (
        TINY_LLAMA_CONFIG,
        FakeAttentionMetadata,
        FakeModel,
        FakeOffloadingWorker,
        HarnessStats,
        KVMismatch,
        KVPattern,
        StepResult,
        VllmHarness,
        prefix_hashes,
        write_model_dir,
    )

__all__ = [
    "OURS",
    "TINY_LLAMA_CONFIG",
    "VLLM_OFFLOADING",
    "FakeAttentionMetadata",
    "FakeModel",
    "FakeOffloadingWorker",
    "HarnessStats",
    "KVMismatch",
    "KVPattern",
    "StepResult",
    "VllmHarness",
    "cpu_offloading",
    "load",
    "prefix_hashes",
    "random_tokens",
    "shared_prefix_requests",
    "write_model_dir",
]


def load() -> ModuleType:
    """Import `vllm_kit` (and so vLLM), silencing the deprecation
    warnings that importing vLLM draws from torch (pytest turns warnings into errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module("vllm_kit")


def __getattr__(name: str) -> Any:
    """The harness's names, from `vllm_kit` on first use."""
    if name in __all__:
        return getattr(load(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# 256 KiB of CPU tier: 64 blocks of the default shapes (2 layers x 2 KiB per block).
CPU_BYTES = 256 << 10


def cpu_offloading(cpu_bytes: int = CPU_BYTES, **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for a CPU tier of *cpu_bytes* (vLLM's keys; ours reads
    the same ones)."""
    return {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes, **extra}


# Keyword arguments of VllmHarness for vLLM's own connector, and for ours.
VLLM_OFFLOADING: dict[str, Any] = {
    "connector": "OffloadingConnector",
    "extra_config": cpu_offloading(),
}
OURS: dict[str, Any] = {
    "connector": "KVTierConnector",
    "connector_module_path": "kvtier_async.vllm",
    "extra_config": cpu_offloading(),
}


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """*n* token ids inside the tiny model's vocabulary, clear of the special ids 0-2."""
    return [rng.randrange(3, 1000) for _ in range(n)]


def shared_prefix_requests(
    seed: int,
    num_requests: int,
    *,
    num_prefixes: int = 4,
    prefix_tokens: Sequence[int] = (48, 200),
    suffix_tokens: Sequence[int] = (1, 40),
    max_tokens: Sequence[int] = (1, 24),
) -> list[tuple[str, list[int], int]]:
    """``(req_id, prompt, max_tokens)`` for requests that each take a random part (at least
    half) of one of *num_prefixes* shared documents, then a suffix of their own."""
    rng = random.Random(seed)
    docs = [random_tokens(rng, rng.randint(*prefix_tokens)) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        doc = rng.choice(docs)
        prompt = doc[: rng.randint(len(doc) // 2, len(doc))]
        prompt += random_tokens(rng, rng.randint(*suffix_tokens))
        requests.append((f"req-{i}", prompt, rng.randint(*max_tokens)))
    return requests
