"""How vLLM's KV cache maps onto offloaded blocks, CPU slots and the shared region.

Both roles derive the same `OffloadLayout` from vLLM's config, so the scheduler (which sizes
the ledger and reads slots for the secondary tiers) and every worker (which copies GPU
blocks into its rows) agree on slot count, slot size and row layout without talking.

An offloaded block covers ``factor = block_size / gpu_block_size`` GPU blocks of one
KV-cache group and is named by the prefix hash of its last GPU block (as vLLM names it).
A worker's slot holds, per canonical view, ``factor`` pages (see
`kvtier_async.transfer.canonical`), so ``slot_bytes = factor * sum(page bytes of every
offloaded layer)``; a secondary tier stores a slot's rows of all workers as one object.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

from kvtier_async.config import ConfigError

from .config import ConnectorConfig

__all__ = ["OffloadLayout"]

_FIELD = "kv_connector_extra_config"


@dataclass(frozen=True)
class OffloadLayout:
    gpu_block_size: int
    factor: int
    groups: tuple[int, ...]  # KV-cache group indices that are offloaded
    group_layers: tuple[tuple[str, ...], ...]
    slot_bytes: int  # per worker
    num_workers: int
    rank: int
    num_slots: int
    instance_id: str
    model: str
    dtype: str
    kv_layout: str
    tp_size: int
    pp_size: int
    # What the scheduler and every worker of one engine share (vLLM's engine_id), so a
    # region of another engine with the same instance_id is refused; None checks nothing.
    token: str | None = None

    @property
    def chunk_tokens(self) -> int:
        return self.gpu_block_size * self.factor

    @property
    def row_bytes(self) -> int:
        page = mmap.PAGESIZE
        return -(-self.slot_bytes // page) * page

    @property
    def block_span_bytes(self) -> int:
        """A slot's rows of every worker: what a secondary tier stores per key."""
        return self.row_bytes * self.num_workers

    @classmethod
    def from_vllm(
        cls, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig
    ) -> OffloadLayout:
        gpu_block_size = int(vllm_config.cache_config.block_size)
        groups, layers, page_bytes = _attention_groups(kv_cache_config, gpu_block_size)
        factor = _factor(config.block_size, gpu_block_size)
        parallel = vllm_config.parallel_config
        workers = int(parallel.world_size)
        slot_bytes = factor * page_bytes
        row = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        num_slots = config.cpu_bytes_to_use // (row * workers)
        if num_slots < 1:
            raise ConfigError(
                f"{_FIELD}.cpu_bytes_to_use",
                f"holds no offloaded block: one needs {row * workers} bytes",
            )
        transfer = vllm_config.kv_transfer_config
        instance = config.instance_id or str(getattr(transfer, "engine_id", None) or "kvtier")
        model_config = vllm_config.model_config
        return cls(
            gpu_block_size,
            factor,
            groups,
            layers,
            slot_bytes,
            workers,
            int(getattr(parallel, "rank", 0)),
            num_slots,
            _safe_id(instance),
            str(getattr(model_config, "model", "model")),
            str(getattr(model_config, "dtype", "auto")).replace("torch.", ""),
            "vllm-canonical",
            int(parallel.tensor_parallel_size),
            int(parallel.pipeline_parallel_size),
            token=_engine_token(transfer),
        )


def _engine_token(transfer: Any) -> str | None:
    engine_id = getattr(transfer, "engine_id", None)
    return str(engine_id) if engine_id else None


def _factor(block_size: int | None, gpu_block_size: int) -> int:
    if block_size is None:
        return 1
    if block_size % gpu_block_size:
        raise ConfigError(
            f"{_FIELD}.block_size",
            f"must be a multiple of the GPU block size {gpu_block_size}, got {block_size}",
        )
    return block_size // gpu_block_size


def _attention_groups(
    kv_cache_config: Any, gpu_block_size: int
) -> tuple[tuple[int, ...], tuple[tuple[str, ...], ...], int]:
    """Full-attention groups (MLA included), their layers, and the bytes of one GPU block
    of every offloaded layer on this worker."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups, layers, total = [], [], 0
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
            raise ValueError(
                f"kv_cache_groups[{index}]: {type(spec).__name__} is not "
                "supported; kvtier offloads full-attention (and MLA) groups only"
            )
        if spec.block_size != gpu_block_size:
            raise ValueError(
                f"kv_cache_groups[{index}]: block size {spec.block_size} differs "
                f"from the cache's {gpu_block_size}"
            )
        groups.append(index)
        layers.append(tuple(group.layer_names))
        total += int(spec.page_size_bytes) * len(group.layer_names)
    if not groups:
        raise ValueError("the KV cache has no groups to offload")
    return tuple(groups), tuple(layers), total


def _safe_id(instance: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "-" for c in instance)[:100]
