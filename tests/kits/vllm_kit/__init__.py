"""The connector harness: vLLM 0.33's real scheduler and a fake model, on the CPU.

For testing and benchmarking a KV connector inside vLLM's own `Scheduler` without a GPU:
the project's connector tests run on it, and so does ``kvtier bench sched`` from a source
checkout (`kvtier_async.bench.kits` finds it here, in ``tests/kits``; it is a test kit and
is not in the wheel). Importing it imports vLLM, which the kit needs installed beside the
package: vLLM 0.33.0 (on a CPU-only torch, its scheduler side with ``--no-deps``, as ``nox
-s bench`` installs it); the rest of its needs come with the ``bench`` extra. The engine and
the connector never import it.

    from vllm_kit import VllmHarness     # tests/kits on sys.path (pytest's pythonpath)

    with VllmHarness(connector="KVTierConnector",
                     connector_module_path="kvtier_async.vllm",
                     extra_config={...}) as h:
        h.add_request("a", prompt_token_ids, max_tokens=4)
        h.run_until_done()
        h.assert_no_leaks()

Modules, each readable on its own:

``harness``          `VllmHarness`: builds vLLM's config, scheduler and worker-role connector
                     and steps them (the overview of the whole kit is its docstring).
``model``            `FakeModel`: the worker's model-runner stand-in that drives the
                     connector's worker hooks, writes K/V and checks the context it reads.
``offload_worker``   `FakeOffloadingWorker`: a CPU stand-in for vLLM's CPUOffloadingWorker,
                     so vLLM's own OffloadingConnector runs here as the reference.
``pattern``          `KVPattern`, `prefix_hashes`: deterministic K/V (a token's cells are a
                     function of its prefix), `KVMismatch`.
``config``           the tiny model directory, `VllmConfig` and `KVCacheConfig`s.
"""

from .config import TINY_LLAMA_CONFIG, write_model_dir
from .harness import HarnessStats, StepResult, VllmHarness
from .model import FakeAttentionMetadata, FakeModel
from .offload_worker import FakeOffloadingWorker
from .pattern import KVMismatch, KVPattern, prefix_hashes

__all__ = [
    "TINY_LLAMA_CONFIG",
    "FakeAttentionMetadata",
    "FakeModel",
    "FakeOffloadingWorker",
    "HarnessStats",
    "KVMismatch",
    "KVPattern",
    "StepResult",
    "VllmHarness",
    "prefix_hashes",
    "write_model_dir",
]
