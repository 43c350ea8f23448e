"""What vLLM's engine core builds before its scheduler, through vLLM's own functions: the
model directory (a tiny Llama ``config.json``, no download), the `VllmConfig`, and the worker's
and scheduler's `KVCacheConfig`s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

__all__ = [
    "TINY_LLAMA_CONFIG",
    "KVRole",
    "build_vllm_config",
    "kv_cache_configs",
    "write_model_dir",
]

# ../shared/vllm-cpu/tiny-llama-config.json, kept here so nothing outside the package is read.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# What a CUDA attention backend that states no layout preference reports
# (vllm/v1/attention/backends/utils.py: _DEFAULT_LAYOUT_PREFERENCE); the connector's
# get_required_kvcache_layout, when it has one, is then chosen among them.
_BACKEND_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


def write_model_dir(
    path: str | Path,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 16,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write the tiny Llama ``config.json`` with these KV shapes into *path*."""
    config = dict(TINY_LLAMA_CONFIG)
    num_heads = 2 * num_kv_heads
    config.update(
        num_hidden_layers=num_layers,
        num_key_value_heads=num_kv_heads,
        num_attention_heads=num_heads,
        hidden_size=num_heads * head_size,
        head_dim=head_size,
        torch_dtype=_DTYPE_NAMES[dtype],
    )
    if (num_layers, num_kv_heads, head_size) == (2, 2, 16):
        del config["head_dim"]  # exactly the shared file
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def build_vllm_config(
    *,
    model_dir: str,
    dtype: torch.dtype,
    block_size: int,
    num_gpu_blocks: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    async_scheduling: bool,
    connector: str | None,
    connector_module_path: str | None,
    kv_role: KVRole,
    kv_load_failure_policy: Literal["recompute", "fail"],
    extra_config: dict[str, Any],
) -> VllmConfig:
    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_gpu_blocks,
    )
    transfer = None
    if connector is not None:
        transfer = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=connector_module_path,
            kv_role=kv_role,
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy=kv_load_failure_policy,
        )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer,
    )


def kv_cache_configs(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], num_gpu_blocks: int
) -> tuple[KVCacheConfig, KVCacheConfig, int]:
    """The worker's and the scheduler's KVCacheConfig, and the hash block size, as
    ``EngineCore._initialize_kv_caches`` derives them."""
    resolve_kv_cache_layout(vllm_config, [_BACKEND_LAYOUTS], list(specs.values()))
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    page_bytes = sum(spec.page_size_bytes for spec in specs.values())
    (worker,) = get_kv_cache_configs(vllm_config, [specs], [page_bytes * num_gpu_blocks], groups)
    worker.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    scheduler = generate_scheduler_kv_cache_config([worker])
    vllm_config.cache_config.num_gpu_blocks = scheduler.num_blocks
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(
        scheduler, vllm_config, scheduler_block_size, hash_block_size
    )
    for config in (worker, scheduler):
        config.hash_block_size = hash_block_size
        config.cache_hit_alignment_tokens = alignment
    vllm_config.cache_config.hash_block_size = hash_block_size
    vllm_config.cache_config.cache_hit_alignment_tokens = alignment
    return worker, scheduler, hash_block_size
